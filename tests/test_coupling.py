"""Noise-coupled drafting (bastion/coupling.py): the formula, its alignment with the verification's
own draws, and in the engine: lossless, and more tokens per round for a drafter that knows the target."""

import pytest
import torch

from bastion.coupling import DraftNoise, coupled_logq
from bastion.engine import Engine, GenerationConfig
from bastion.kernels import get_kernels
from bastion.kernels.reference import GumbelRows, uniform_stream
from bastion.verify import SamplingParams, target_choices
from tiny import tiny_drafter, tiny_target


def test_coupled_logq_is_the_even_mixture_of_q_and_the_perturbed_softmax():
    torch.manual_seed(0)
    v, d, t, seed, root = 50, 3, 0.8, 11, 17
    logq = torch.log_softmax(torch.randn(d, 12), -1)
    vocab = torch.tensor([3, 7, 8, 1, 40, 41, 22, 0, 9, 30, 31, 49])
    u = uniform_stream(seed, 0, d, v, counters=torch.arange(root, root + d))
    g = -torch.log(-torch.log(u))[:, vocab]
    want = torch.log(0.5 * logq.exp() + 0.5 * torch.softmax(logq / t + g, -1))
    got = coupled_logq(logq, DraftNoise(GumbelRows(seed, native=False), v), root, vocab, t)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got.exp().sum(-1), torch.ones(d), atol=1e-5)
    # no draft vocabulary: columns are token ids
    full = torch.log_softmax(torch.randn(d, v), -1)
    got = coupled_logq(full, DraftNoise(GumbelRows(seed, native=False), v), root, None, t)
    g = -torch.log(-torch.log(u))
    assert torch.allclose(got, torch.log(0.5 * full.exp() + 0.5 * torch.softmax(full / t + g, -1)), atol=1e-5)
    assert coupled_logq(full[:0], DraftNoise(GumbelRows(seed), v), root, None, t).shape == (0, v)
    with pytest.raises(ValueError, match="T > 0"):
        coupled_logq(full, DraftNoise(GumbelRows(seed), v), root, None, 0.0)


def test_draft_noise_is_the_verifications_noise_at_the_draft_vocabulary_made_once_per_position():
    v, seed = 300, 5
    want = -torch.log(-torch.log(uniform_stream(seed, 0, 6, v, counters=torch.arange(10, 16))))
    vocab = torch.tensor([5, 2, 250, 17])
    memo = GumbelRows(seed, native=False)
    noise = DraftNoise(memo, v)
    a = noise.rows(10, 4, vocab)  # a draft vocabulary: hashed at its columns only, bit for bit
    assert torch.equal(a, want[:4][:, vocab]) and memo.computed == 0
    b = noise.rows(12, 4, vocab)  # the next round, two positions on: kept rows reused
    assert torch.equal(b, want[2:6][:, vocab])
    wider = torch.cat([vocab, torch.tensor([9])])  # the request's vocabulary grew: rows made anew
    assert torch.equal(noise.rows(12, 2, wider), want[2:4][:, wider])
    # no draft vocabulary: full rows from the request's memo, which the verification then finds hashed
    full = DraftNoise(memo, v)
    assert torch.equal(full.rows(10, 4, None), want[:4]) and memo.computed == 4
    assert torch.equal(full.rows(12, 4, None), want[2:6]) and memo.computed == 6
    memo.rows([12, 13], v)
    assert memo.computed == 6


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_depth_d_is_coupled_to_the_row_its_parent_draws_from(temperature):
    """A drafter whose q equals the target's tempered distribution: the coupled term's argmax at depth
    d is exactly the token the verification draws at the depth-(d − 1) node (position root + d − 1)."""
    torch.manual_seed(1)
    v, d, root, seed = 64, 5, 30, 3
    logits = torch.randn(d, v) * 2  # the target's logits at the root and the next d − 1 nodes of a path
    params, kernels = SamplingParams(temperature, seed=seed), get_kernels("torch")
    drawn = target_choices(logits, params, kernels, torch.arange(root, root + d))
    own = torch.log_softmax(logits / temperature, -1)
    # the coupled term alone: log(2c − q) = log softmax(log q / T + G); its argmax must be the draw
    c = coupled_logq(own, DraftNoise(GumbelRows(seed), v), root, None, 1.0).exp()
    coupled = (2 * c - own.exp()).clamp_min(0)
    assert torch.equal(coupled.argmax(-1), drawn)
    # a row off by one would pick other tokens: the test can fail
    shifted = (2 * coupled_logq(own, DraftNoise(GumbelRows(seed), v), root + 1, None, 1.0).exp() - own.exp()).argmax(-1)
    assert not torch.equal(shifted, drawn)


class TwinDrafter:
    """A drafter whose depth-i marginal is the target's own tempered distribution along a known
    sampled continuation (a drafter that equals the target, as far as that path goes)."""

    def __init__(self, inner, logprobs: torch.Tensor):
        self.inner, self.cfg, self.block_size = inner, inner.cfg, inner.block_size
        self.logprobs = logprobs  # [L, V]: row j = log p_T(token j + 1 | tokens ≤ j)

    def new_cache(self):
        return self.inner.new_cache()

    def extend_cache(self, cache, features):
        self.inner.extend_cache(cache, features)

    def draft(self, cache, root, embed, lm_head, vocab=None, depth=None):
        depth = depth or self.block_size - 1
        at = cache.length  # the root's position: row `at` predicts the token after it
        rows = [self.logprobs[min(at + i, len(self.logprobs) - 1)] for i in range(depth)]
        return torch.stack(rows).float()


def test_coupling_stays_lossless_and_accepts_more_for_a_twin_drafter():
    target = tiny_target("qwen3", vocab=48, dtype=torch.float64, seed=2)
    with torch.no_grad():  # a flat target: its draws are often not its argmax
        target.model.get_output_embeddings().weight.mul_(0.15)
    engine = Engine(target, None, kernels="torch", stop_ids=set())
    prompt, t, n = [3, 5, 7], 1.0, 40
    taus = {True: [], False: []}
    for seed in range(4):
        ref = engine.run(prompt, GenerationConfig(strategy="ar", max_new_tokens=n, temperature=t, seed=seed)).token_ids
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt + ref])).logits[0].float()
        twin = TwinDrafter(tiny_drafter(target, block_size=5), torch.log_softmax(logits / t, -1))
        eng = Engine(target, twin, kernels="torch", stop_ids=set())
        for couple in (True, False):
            res = eng.run(prompt, GenerationConfig(strategy="fixed", budget=4, max_new_tokens=n, temperature=t,
                                                  seed=seed, couple=couple))
            assert res.token_ids == ref  # the drafter reads the noise; the draws stay AR's
            taus[couple].append(res.tau)
    mean = {k: sum(v) / len(v) for k, v in taus.items()}
    # measured: 2.81 coupled against 1.09 — the twin's likeliest tokens are rarely this flat target's draws
    assert mean[True] > mean[False] + 1.0, taus


def test_native_uniform_cells_are_the_references_bits():
    from bastion.kernels import cpu_native, cpu_rows
    from bastion.kernels.reference import _row_key, column_keys, uniform_cells

    if not cpu_native.available():
        pytest.skip(f"native CPU kernel unavailable: {cpu_native.unavailable_reason()}")
    cols = torch.tensor([0, 1, 5, 49151, 2**31 - 1, 2**32 - 5, 123456])
    for seed in (0, 7, 2**40 + 3):
        rows = [0, 9, 2**31 + 4, 2**32 - 1]
        want = uniform_cells(seed, torch.tensor(rows), column_keys(cols))
        got = cpu_rows.uniform_cells([_row_key(seed, r) for r in rows], column_keys(cols))
        assert torch.equal(got, want)
