"""Triton verification kernels against the pure-torch references.

On a machine without CUDA, tests/conftest.py turns on Triton's interpreter, so the Triton kernels
run on CPU tensors; with CUDA every test here runs on the GPU (``DEV``), compiled. The statistical
tests check the reference sampler itself (the Triton sampler is checked to be bit-identical to it).
"""

from __future__ import annotations

import random

import pytest
import torch

from bastion.kernels import TORCH, get_kernels, reference as R
from bastion.kernels import triton_kernels as TK

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Statistical tests fail when the chi-square p-value is below this (deterministic streams, so a
# pass is reproducible; a correct sampler fails one such test with probability 1e-4).
P_VALUE_THRESHOLD = 1e-4


def _logits(n, vocab, dtype=torch.float32, scale=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=gen) * scale).to(dtype).to(DEV)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; p = Q(df / 2, stat / 2) (regularised upper gamma)."""
    counts = counts.double()
    expected = probs.double() * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((counts.numel() - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


# ---------------------------------------------------------------------------------------------
# dispatcher
# ---------------------------------------------------------------------------------------------


def test_dispatch():
    kernels = get_kernels("triton", "cpu")
    assert kernels is TK.KERNELS and kernels.name == "triton"
    assert kernels.node_choice is TK.node_choice
    assert kernels.tree_walk is TK.tree_walk and kernels.tree_mask is TK.tree_mask
    assert kernels.filter_thresholds is R.filter_thresholds
    assert get_kernels("auto", "cpu") is TORCH and TORCH.name == "torch"
    assert get_kernels("torch", DEV) is TORCH
    with pytest.raises(ValueError):
        get_kernels("cuda-graphs", "cpu")
    with pytest.raises(ValueError):
        get_kernels("", DEV)


# ---------------------------------------------------------------------------------------------
# node_choice
# ---------------------------------------------------------------------------------------------

SHAPES = [(1000, 24), (49152, 3), (151936, 2)]  # (V, n): V never a power of two


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab,n", SHAPES)
def test_argmax_matches(vocab, n, dtype):
    x = _logits(n, vocab, dtype, seed=vocab + n)
    got = TK.node_choice(x, 0.0)
    assert got.dtype == torch.int64 and got.device == x.device and got.shape == (n,)
    assert torch.equal(got, R.node_choice_torch(x, 0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.7, 1.5])
@pytest.mark.parametrize("vocab,n", SHAPES)
def test_sample_matches_reference_stream(vocab, n, temperature, dtype):
    rng = random.Random(vocab * 7 + n)
    x = _logits(n, vocab, dtype, scale=2.0, seed=vocab + 1)
    for _ in range(2):
        seed, offset = rng.getrandbits(64), rng.getrandbits(20)
        want = R.node_choice_torch(x, temperature, seed=seed, offset=offset)
        assert torch.equal(TK.node_choice(x, temperature, seed=seed, offset=offset), want)
    # a different stream gives different samples (the stream is really used)
    other = TK.node_choice(x, temperature, seed=seed + 1, offset=offset)
    assert torch.equal(other, R.node_choice_torch(x, temperature, seed=seed + 1, offset=offset))


@pytest.mark.parametrize("top_k,top_p", [(1, None), (5, None), (50, None), (None, 0.5), (None, 0.9), (20, 0.8)])
@pytest.mark.parametrize("vocab,n", [(1000, 24), (151936, 2)])
def test_sample_with_thresholds(vocab, n, top_k, top_p):
    temperature = 0.7
    x = _logits(n, vocab, torch.bfloat16, seed=3)
    thresholds = R.filter_thresholds(x.float() / temperature, top_k, top_p)
    for seed, offset in [(11, 0), (2**40 + 3, 977)]:
        want = R.node_choice_torch(x, temperature, thresholds, seed=seed, offset=offset)
        got = TK.node_choice(x, temperature, thresholds, seed=seed, offset=offset)
        assert torch.equal(got, want)
        tempered = x.float() / temperature
        assert bool((tempered.gather(1, got[:, None]).squeeze(1) >= thresholds).all())
    if top_k == 1:  # top-1 sampling is greedy
        assert torch.equal(got, R.node_choice_torch(x, 0.0))


@pytest.mark.parametrize("temperature", [1.1, 0.6])
def test_tempering_probe_and_the_torch_fallback_reproduce_torch(temperature, monkeypatch):
    """``_tempering`` measures how torch divides by T on the device (a true division on the CPU);
    the measured mode and the "other" fallback (torch tempers, the kernel multiplies by 1) both give
    the reference's samples bit for bit, the boundary token of a top-1 threshold included."""
    # the two reciprocals differ at T = 1.1; torch 2.11 on an H200 used the second
    assert TK._reciprocals(1.1) == {"reciprocal32": 0.9090908765792847, "reciprocal64": 0.9090909361839294}
    monkeypatch.setattr(TK, "_TEMPERING", {})
    measured = TK._tempering(DEV, temperature)
    if DEV.type == "cpu":
        assert measured == "divide"
    x = _logits(48, 1000, seed=8)
    top1 = R.filter_thresholds(x.float() / temperature, 1, None)
    top3 = R.filter_thresholds(x.float() / temperature, 3, None)
    for mode in (measured, "other"):
        TK._TEMPERING[(DEV.type, DEV.index, temperature)] = mode
        assert torch.equal(TK.node_choice(x, temperature, top1, seed=1), R.node_choice_torch(x, 0.0)), mode
        for seed in range(3):
            want = R.node_choice_torch(x, temperature, top3, seed=seed)
            assert torch.equal(TK.node_choice(x, temperature, top3, seed=seed), want), mode


@pytest.mark.parametrize("temperature", [0.7, 0.3, 1.1])
def test_threshold_boundary_token_is_kept(temperature):
    # the k-th token sits exactly on its threshold: the kernel must temper the logits bit for bit
    # as torch does on that device, or it drops that token (top-1 would then return token 0)
    x = _logits(64, 1000, seed=21)
    greedy = R.node_choice_torch(x, 0.0)
    thresholds = R.filter_thresholds(x.float() / temperature, 1, None)
    assert torch.equal(TK.node_choice(x, temperature, thresholds, seed=1), greedy)
    thresholds = R.filter_thresholds(x.float() / temperature, 2, None)
    runner_up = torch.topk(x.float(), 2, dim=-1).indices
    for seed in range(4):
        got = TK.node_choice(x, temperature, thresholds, seed=seed)
        assert torch.equal(got, R.node_choice_torch(x, temperature, thresholds, seed=seed))
        assert bool(((got == runner_up[:, 0]) | (got == runner_up[:, 1])).all())


@pytest.mark.parametrize("seed", [0, 1, 2**31, 2**32 - 1, 2**32, 2**40 + 123, 2**63 - 1, -1])
def test_stream_hash_matches_for_extreme_seeds_and_offsets(seed):
    # flat logits: the sample is the argmax of the noise alone, so any hash difference shows
    x = torch.zeros(4, 1000, device=DEV)
    for offset in [0, 2**31 - 1, 2**32 - 2, 2**40 + 5]:
        want = R.node_choice_torch(x, 1.0, seed=seed, offset=offset)
        assert torch.equal(TK.node_choice(x, 1.0, seed=seed, offset=offset), want)


@pytest.mark.parametrize("block,split", [(128, 1), (128, 3), (256, 7), (1024, 2)])
def test_tiling_and_vocab_split(block, split):
    # ties everywhere (integer logits): the first maximum must win across tiles and chunks
    gen = torch.Generator().manual_seed(block + split)
    ties = torch.randint(0, 4, (6, 1000), generator=gen).float().to(DEV)
    assert torch.equal(TK._node_choice(ties, 0.0, block=block, split=split), R.node_choice_torch(ties, 0.0))
    x = _logits(3, 9001, torch.bfloat16, seed=split)
    assert torch.equal(TK._node_choice(x, 0.0, block=block, split=split), R.node_choice_torch(x, 0.0))
    thresholds = R.filter_thresholds(x.float() / 0.9, 40, 0.95)
    want = R.node_choice_torch(x, 0.9, thresholds, seed=5, offset=3)
    assert torch.equal(TK._node_choice(x, 0.9, thresholds, seed=5, offset=3, block=block, split=split), want)


def test_node_choice_edge_cases():
    # -inf logits (a masked vocabulary tail) and a fully masked row: torch.argmax returns 0 there
    x = _logits(5, 1000, seed=9)
    x[:, 700:] = float("-inf")
    x[2] = float("-inf")
    for temperature in [0.0, 1.0]:
        want = R.node_choice_torch(x, temperature, seed=4)
        assert torch.equal(TK.node_choice(x, temperature, seed=4), want)
        assert torch.equal(TK._node_choice(x, temperature, seed=4, block=128, split=3), want)
        assert int(want[2]) == 0
    # a row-strided view and a transposed (non-unit column stride) input
    wide = _logits(6, 1200, seed=10)
    view = wide[:, 100:1100]
    assert torch.equal(TK.node_choice(view, 0.6, seed=8), R.node_choice_torch(view, 0.6, seed=8))
    transposed = _logits(1000, 6, seed=11).t()
    assert torch.equal(TK.node_choice(transposed, 0.0), R.node_choice_torch(transposed, 0.0))
    # one-token vocabulary, no nodes
    assert TK.node_choice(torch.zeros(3, 1, device=DEV), 1.0).tolist() == [0, 0, 0]
    assert TK.node_choice(torch.zeros(0, 10, device=DEV), 1.0).shape == (0,)


def test_cpu_argmax_keeps_torchs_rule():
    """argmax_rows (NumPy's argmax on the CPU) returns what torch.argmax returns: the first of tied
    maxima, 0 on an all −inf row, the first NaN where a row has one; views and empty inputs too."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 3, (64, 500), generator=g).float()  # many ties
    x[5] = float("-inf")
    x[6, 10] = x[6, 400] = float("nan")
    x[7, 499] = float("inf")
    for t in (x, x[:, 50:450], x.t().contiguous().t(), x[::3]):
        got = R.argmax_rows(t)
        assert got.dtype == torch.int64 and torch.equal(got, torch.argmax(t, dim=-1))
    assert R.argmax_rows(x)[5] == 0 and R.argmax_rows(x)[6] == 10
    assert R.argmax_rows(torch.zeros(0, 10)).shape == (0,)
    big = torch.randn(9, 49152, generator=g)
    assert torch.equal(R.argmax_rows(big), torch.argmax(big, dim=-1))


def test_many_rows_small_vocab():
    x = _logits(256, 8, scale=1.0, seed=12)
    assert torch.equal(TK.node_choice(x, 1.0, seed=99, offset=1000),
                       R.node_choice_torch(x, 1.0, seed=99, offset=1000))


# ---------------------------------------------------------------------------------------------
# the reference sampler's distribution (Triton's sampler is bit-identical to it)
# ---------------------------------------------------------------------------------------------

SMALL = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5])
DRAWS = 40000


def _draw(temperature, thresholds=None, seed=1234):
    """DRAWS samples of the same row: row i of the batch uses counter offset + i."""
    x = SMALL.to(DEV).expand(DRAWS, -1)
    if thresholds is not None:
        thresholds = thresholds.expand(DRAWS)
    tokens = R.node_choice_torch(x, temperature, thresholds, seed=seed, offset=0)
    return torch.bincount(tokens, minlength=SMALL.numel()).cpu()


def test_uniform_stream_range():
    u = R.uniform_stream(7, 0, 64, 1000)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    assert _chi2_pvalue(counts, torch.full((16,), 1 / 16)) > P_VALUE_THRESHOLD


def test_extreme_hashes_stay_strictly_inside_the_unit_interval():
    """The largest hash once mapped to u = 1.0 in float32 (k + 0.5 rounded up to 2^24): Gumbel noise
    +inf, a token drawn whatever its probability, NaN under a top-k/top-p mask. Seen on an H200 as a
    Triton/torch disagreement on one row of 256."""
    h = torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 512, 2**32 - 1], dtype=torch.int64)
    u = R.bits_to_unit(h)
    assert u.dtype == torch.float32
    assert float(u.min()) == 2.0**-24 and float(u.max()) == 1.0 - 2.0**-24
    gumbel = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(gumbel).all())
    # the cells are exact midpoints: k + 0.5 survives float32 for every 23-bit k
    k = h >> 9
    assert torch.equal(u.double() * 2**23 - 0.5, k.double())


def test_the_h200_row_samples_inside_its_top_k():
    """The disagreement seen on the H200: seed 3, counter 159 (row 158 at offset 1) is the one row of
    1–256 where column 25,390's old variate was exactly 1.0. With that token masked by top-k, the
    reference drew it anyway (NaN wins argmax); now both backends draw inside the top k."""
    x = _logits(1, 49152, seed=4)
    x[0, 25390] = x[0].min() - 5.0  # far below any top-k threshold
    thresholds = R.filter_thresholds(x.float() / 0.6, 50, None)
    allowed = set(torch.topk(x[0].float(), 50).indices.tolist())
    want = R.node_choice_torch(x, 0.6, thresholds, seed=3, offset=159)
    assert int(want) in allowed and int(want) != 25390
    assert torch.equal(TK.node_choice(x, 0.6, thresholds, seed=3, offset=159), want)


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_sampling_matches_softmax(temperature):
    counts = _draw(temperature)
    probs = torch.softmax(SMALL.double() / temperature, dim=0)
    assert _chi2_pvalue(counts, probs) > P_VALUE_THRESHOLD


@pytest.mark.parametrize("top_k,top_p", [(3, None), (1, None), (None, 0.8), (None, 0.3), (5, 0.9)])
def test_restricted_sampling(top_k, top_p):
    temperature = 1.0
    tempered = SMALL / temperature
    thresholds = R.filter_thresholds(tempered[None], top_k, top_p).to(DEV)
    keep = tempered >= thresholds.cpu()
    order = torch.argsort(tempered, descending=True)
    if top_k is not None:
        assert int(keep.sum()) <= top_k
    if top_p is not None:  # the smallest prefix of the sorted distribution reaching p
        probs = torch.softmax(tempered.double(), dim=0)[order]
        kept = int(keep.sum())
        assert top_k is not None and kept == top_k or float(probs[:kept].sum()) >= top_p
        assert float(probs[:kept - 1].sum()) < top_p
    assert bool(keep[order[: int(keep.sum())]].all())  # the kept set is a top set
    counts = _draw(temperature, thresholds)
    assert int(counts[~keep].sum()) == 0
    if int(keep.sum()) > 1:
        renormalised = torch.softmax(tempered.double()[keep], dim=0)
        assert _chi2_pvalue(counts[keep], renormalised) > P_VALUE_THRESHOLD
    else:
        assert int(counts[keep].sum()) == DRAWS


def test_filter_thresholds_keeps_the_top_token_for_any_top_p():
    x = _logits(3, 100, seed=14)
    top = x.max(dim=-1).values
    for top_p in [0.0, 1e-9]:
        assert torch.equal(R.filter_thresholds(x, None, top_p), top)
        assert torch.equal(R.filter_thresholds(x, 5, top_p), top)


# ---------------------------------------------------------------------------------------------
# trees: walk and mask
# ---------------------------------------------------------------------------------------------

SIZES = [1, 2, 3, 17, 64, 255, 512]


def _tree(shape: str, n: int, rng: random.Random) -> list[int]:
    parents = [-1]
    for i in range(1, n):
        if shape == "chain":
            parents.append(i - 1)
        elif shape == "star":
            parents.append(0)
        elif shape == "deep":  # a long spine with a few side branches
            parents.append(i - 1 if rng.random() < 0.85 else rng.randrange(i))
        elif shape == "binary":
            parents.append((i - 1) // 2)
        elif shape == "bushy":  # best-first-like: recent nodes get most children
            parents.append(rng.randrange(max(0, i - 6), i) if rng.random() < 0.7 else rng.randrange(i))
        else:
            raise ValueError(shape)
    return parents


def _tokens(parents: list[int], vocab: int, rng: random.Random) -> list[int]:
    """Random tokens, distinct among siblings (as the draft tree guarantees)."""
    used: dict[int, set[int]] = {}
    tokens = [rng.randrange(vocab)]
    for p in parents[1:]:
        siblings = used.setdefault(p, set())
        tok = rng.randrange(vocab)
        while tok in siblings:
            tok = rng.randrange(vocab)
        siblings.add(tok)
        tokens.append(tok)
    return tokens


def _choices(parents, tokens, vocab, rng, mode):
    n = len(parents)
    choices = [rng.randrange(vocab) for _ in range(n)]
    children = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)
    if mode == "follow":  # the target agrees with some child wherever there is one
        for i in range(n):
            if children[i] and rng.random() < 0.9:
                choices[i] = tokens[rng.choice(children[i])]
    elif mode == "planted":  # the path to a random node matches
        node = rng.randrange(n)
        while node > 0:
            choices[parents[node]] = tokens[node]
            node = parents[node]
    return choices


@pytest.mark.parametrize("shape", ["chain", "star", "deep", "binary", "bushy"])
def test_tree_walk_matches(shape):
    rng = random.Random(shape)
    vocab = 1000
    for n in SIZES:
        parents = _tree(shape, n, rng)
        tokens = _tokens(parents, vocab, rng)
        for mode in ["random", "follow", "planted"]:
            choices = _choices(parents, tokens, vocab, rng, mode)
            want = R.tree_walk_torch(parents, tokens, choices)
            got = TK.tree_walk(parents, tokens, torch.tensor(choices, device=DEV))
            assert got == want, (shape, n, mode)
            assert isinstance(got[1], int) and all(isinstance(i, int) for i in got[0])
        assert TK.tree_walk(parents, tokens, choices) == want  # choices as a list


def test_tree_walk_with_node_choice_output():
    rng = random.Random(5)
    parents = _tree("bushy", 100, rng)
    tokens = _tokens(parents, 50, rng)
    x = _logits(100, 50, seed=13)
    for node in [0, 37, 99]:  # make the target prefer the path to ``node``
        while node > 0:
            x[parents[node], tokens[node]] += 100.0
            node = parents[node]
        choices = TK.node_choice(x, 0.0)
        assert TK.tree_walk(parents, tokens, choices) == R.tree_walk_torch(parents, tokens, choices)


@pytest.mark.parametrize("shape", ["chain", "star", "deep", "binary", "bushy"])
def test_tree_mask_matches(shape):
    rng = random.Random("mask" + shape)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    for k, n in enumerate(SIZES):
        parents = _tree(shape, n, rng)
        prefix_len = [0, 1, 37, 1000][k % 4]
        dtype = dtypes[k % 3]
        want_mask, want_pos = R.tree_mask_torch(parents, prefix_len, dtype, DEV)
        mask, pos = TK.tree_mask(parents, prefix_len, dtype, DEV)
        assert mask.dtype == dtype and mask.shape == (1, 1, n, prefix_len + n) and mask.device == want_mask.device
        assert pos.dtype == torch.int64 and pos.device == want_pos.device
        assert torch.equal(mask, want_mask), (shape, n, prefix_len, dtype)
        assert torch.equal(pos, want_pos), (shape, n, prefix_len)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_tree_mask_dtypes_and_default_device(dtype):
    parents = _tree("bushy", 40, random.Random(7))
    want_mask, want_pos = R.tree_mask_torch(parents, 5, dtype)
    mask, pos = TK.tree_mask(parents, 5, dtype)  # device=None: CPU tensors, as the reference
    assert mask.device.type == "cpu" and pos.device.type == "cpu"
    assert torch.equal(mask, want_mask) and torch.equal(pos, want_pos)


# ---------------------------------------------------------------------------------------------
# GPU only: compiled Triton with the automatic tiling (vocabulary split for few nodes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_triton_matches_torch_on_cuda():
    assert torch.cuda.is_available()
    assert get_kernels("auto", "cuda") is TK.KERNELS
    for vocab in [49152, 151936]:
        for n in [1, 16, 64, 256]:
            x = _logits(n, vocab, torch.bfloat16, seed=n)
            assert x.is_cuda
            assert torch.equal(TK.node_choice(x, 0.0), R.node_choice_torch(x, 0.0))
            for temperature in [0.6, 1.0]:
                want = R.node_choice_torch(x, temperature, seed=77, offset=n)
                assert torch.equal(TK.node_choice(x, temperature, seed=77, offset=n), want)
                thresholds = R.filter_thresholds(x.float() / temperature, 50, 0.9)
                want = R.node_choice_torch(x, temperature, thresholds, seed=3, offset=1)
                assert torch.equal(TK.node_choice(x, temperature, thresholds, seed=3, offset=1), want)
    # CPU inputs are processed on the GPU and come back on the CPU
    x = _logits(4, 1000).cpu()
    assert torch.equal(TK.node_choice(x, 0.0), R.node_choice_torch(x, 0.0))
    parents = _tree("bushy", 300, random.Random(1))
    mask, pos = TK.tree_mask(parents, 4096, torch.bfloat16, "cuda")
    want_mask, want_pos = R.tree_mask_torch(parents, 4096, torch.bfloat16, "cuda")
    assert torch.equal(mask, want_mask) and torch.equal(pos, want_pos)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_output_same_with_triton_and_torch_backends(temperature):
    """The whole engine, verification through the interpreted Triton kernels vs the torch ones."""
    from bastion.engine import Engine, GenerationConfig
    from tiny import tiny_drafter, tiny_target

    target = tiny_target("llama", dtype=torch.float32)
    drafter = tiny_drafter(target)
    outs = {}
    for backend in ("torch", "triton"):
        engine = Engine(target, drafter, kernels=backend, stop_ids=set())
        assert engine.kernels.name == backend
        outs[backend] = [engine.run([3, 1, 4], GenerationConfig(strategy=s, max_new_tokens=10, temperature=temperature,
                                                                 seed=5, budget=6)).token_ids
                         for s in ("ar", "chain", "fixed", "bastion")]
    assert outs["torch"] == outs["triton"]


@pytest.mark.parametrize("vocab", [49152, 1000, 37])
def test_noise_memo_draws_what_the_stream_draws(vocab):
    """GumbelRows reuses rows across rounds; every draw equals node_choice_torch without it, rows are
    hashed once per position, and rows behind the walk are dropped."""
    g = torch.Generator().manual_seed(vocab)
    memo = R.GumbelRows(seed=7)
    pos = 20
    for depths in ([0, 1, 1, 2, 3], [0, 1, 2, 2, 2, 3, 4], [0], [0, 1, 1, 1]):
        counters = torch.tensor([pos + d for d in depths])
        x = torch.randn(len(depths), vocab, generator=g) * 3
        thr = R.filter_thresholds(x, 5, None) if depths[0] % 2 == 0 and vocab > 5 else None
        want = R.node_choice_torch(x, 0.8, thr, seed=7, counters=counters)
        assert torch.equal(R.node_choice_torch(x, 0.8, thr, seed=7, counters=counters, noise=memo), want)
        u = R.uniform_stream(7, 0, len(depths), vocab, counters=counters)
        assert torch.equal(memo.rows(counters.tolist(), vocab), -torch.log(-torch.log(u)))
        pos += 2  # two tokens committed: the next round's root sits two positions on
    # positions 20..24 then 22..26, 24, 26..27: each hashed once, older ones dropped
    assert memo.computed == len(set(range(20, 25)) | set(range(22, 27)) | {24} | set(range(26, 28)))
    assert min(memo._rows) == 26
    with pytest.raises(ValueError, match="vocabulary"):
        memo.rows([30], vocab + 1)
    with pytest.raises(ValueError, match="seed"):
        R.node_choice_torch(torch.zeros(1, vocab), 1.0, seed=8, counters=torch.tensor([30]), noise=memo)


def _kept_exactly(x, top_p, top_k=None):
    """Tokens the top-p/top-k rule keeps, in float64 (sorted row, mass before each token < top_p),
    and per row the smallest distance of a prefix mass to top_p (where float32 may decide otherwise)."""
    s, _ = torch.sort(x.double(), dim=-1, descending=True)
    probs = torch.softmax(s, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    keep = before < top_p
    keep[:, 0] = True
    if top_k:
        keep[:, top_k:] = False
    threshold = s.gather(1, (keep.sum(-1) - 1)[:, None])  # tokens tied with the last kept one stay
    return (x.double() >= threshold).sum(-1), (before - top_p).abs().min(-1).values


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 30.0])
def test_top_p_search_finds_the_threshold_of_a_full_sort(scale):
    """filter_thresholds searches the sorted prefix with growing top-k instead of sorting all V logits;
    the thresholds equal a one-shot full sort's, from nearly flat rows (the prefix needs thousands of
    tokens: the search goes on to the whole row) to peaked ones, and keep the tokens the rule keeps
    in float64 (except where a prefix mass lies within float32 rounding of top_p)."""
    g = torch.Generator().manual_seed(int(scale * 100))
    x = torch.randn(7, 49152, generator=g) * scale
    x[3, :10] = x[3].max() + 1  # ties at the top
    for top_p in (0.0, 0.3, 0.9, 0.99):
        for top_k in (None, 40, 5000):
            limit = top_k or x.shape[-1]
            got = R.filter_thresholds(x, top_k, top_p)
            assert torch.equal(got, R._top_p_thresholds(x, top_p, limit, first=limit)), (top_p, top_k)
            want, margin = _kept_exactly(x, top_p, top_k)
            kept = (x >= got[:, None]).sum(-1)
            close = margin < 1e-5
            assert torch.equal(kept[~close], want[~close]), (top_p, top_k)
            assert ((kept - want).abs() <= 1).all()
