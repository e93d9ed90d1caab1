"""Sample-and-walk is distribution-preserving; the lossy shortcut is not (the test has power)."""

import math

import pytest
import torch

import bastion.engine as engine_mod
from bastion.engine import Engine, GenerationConfig
from bastion.verify import Acceptance, target_choices
from tiny import tiny_drafter, tiny_target

V = 6
RUNS = 3000


def chi2_critical(df: int, alpha_z: float = 3.09) -> float:
    """Wilson–Hilferty upper quantile of chi-square(df); z = 3.09 ↔ significance 0.001."""
    return df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3


def exact_pair_distribution(target, prompt, temperature):
    """P(x1, x2 | prompt) of the target at temperature T, by enumeration."""
    m = target.model
    with torch.no_grad():
        p1 = torch.softmax(m(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        probs = {}
        for a in range(V):
            p2 = torch.softmax(m(torch.tensor([prompt + [a]])).logits[0, -1] / temperature, -1)
            for b in range(V):
                probs[(a, b)] = (p1[a] * p2[b]).item()
    return probs


def chi2(counts, probs, n):
    cells = [c for c in probs if probs[c] * n >= 5]  # pool sparse cells
    stat, rest_o, rest_e = 0.0, n, n
    for c in cells:
        e = probs[c] * n
        stat += (counts.get(c, 0) - e) ** 2 / e
        rest_o -= counts.get(c, 0)
        rest_e -= e
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
    return stat, len(cells)


def lossy_accept(tree, logits, params, kernels, positions, noise=None):
    """What the published code does at T > 0: match drafts against the argmax, sample only the bonus."""
    greedy = torch.argmax(logits, -1).tolist()
    path, _ = kernels.tree_walk(tree.parents, tree.tokens, greedy)
    sampled = target_choices(logits, params, kernels, positions, noise).tolist()
    return Acceptance(path, sampled[path[-1]], greedy)


def first_pairs(engine, prompt, strategy, temperature):
    counts = {}
    for seed in range(RUNS):
        cfg = GenerationConfig(strategy=strategy, max_new_tokens=2, temperature=temperature, seed=seed, budget=12)
        ids = engine.run(prompt, cfg).token_ids
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    return counts


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    target = tiny_target("llama", vocab=V, dtype=torch.float64, seed=3)
    with torch.no_grad():  # a flatter distribution so several tokens have real mass
        target.model.get_output_embeddings().weight.mul_(0.05)
    drafter = tiny_drafter(target, block_size=4)
    return target, Engine(target, drafter, kernels="torch", stop_ids=set())


@pytest.mark.parametrize("strategy", ["fixed", "bastion"])
def test_sample_and_walk_matches_target(setup, strategy):
    target, engine = setup
    prompt, temperature = [1, 2, 3], 1.0
    probs = exact_pair_distribution(target, prompt, temperature)
    counts = first_pairs(engine, prompt, strategy, temperature)
    stat, cells = chi2(counts, probs, RUNS)
    assert stat < chi2_critical(cells), (stat, chi2_critical(cells))


def test_lossy_variant_is_detected(setup, monkeypatch):
    target, engine = setup
    prompt, temperature = [1, 2, 3], 1.0
    probs = exact_pair_distribution(target, prompt, temperature)
    monkeypatch.setattr(engine_mod, "accept", lossy_accept)
    counts = first_pairs(engine, prompt, "fixed", temperature)
    stat, cells = chi2(counts, probs, RUNS)
    assert stat > chi2_critical(cells), (stat, chi2_critical(cells))


def test_seed_reproduces_and_differs(setup):
    _, engine = setup
    cfg = GenerationConfig(strategy="bastion", max_new_tokens=12, temperature=0.9, seed=7)
    a = engine.run([1, 2], cfg).token_ids
    assert a == engine.run([1, 2], cfg).token_ids
    others = {tuple(engine.run([1, 2], GenerationConfig(strategy="bastion", max_new_tokens=12, temperature=0.9,
                                                         seed=s)).token_ids) for s in range(8)}
    assert len(others) > 1


def test_top_k_top_p_never_leave_the_allowed_set(setup):
    target, engine = setup
    logits = torch.randn(50, V, dtype=torch.float64)
    from bastion.kernels import get_kernels
    from bastion.verify import SamplingParams
    k = get_kernels("torch")
    for params in (SamplingParams(1.0, top_k=2, seed=1), SamplingParams(0.7, top_p=0.5, seed=2)):
        allowed_sets = []
        for row in logits:
            order = torch.argsort(row / params.temperature, descending=True).tolist()
            if params.top_k:
                allowed_sets.append(set(order[:params.top_k]))
            else:
                p = torch.softmax(row / params.temperature, -1)[order]
                cut = int((torch.cumsum(p, 0) - p < params.top_p).sum())
                allowed_sets.append(set(order[:cut]))
        for offset in range(0, 400, 50):
            choice = target_choices(logits, params, k, torch.arange(offset, offset + 50)).tolist()
            assert all(c in s for c, s in zip(choice, allowed_sets))


def test_sampled_output_is_the_same_for_every_strategy():
    """The stream is indexed by position, so one seed gives one sample whatever the tree (float64)."""
    target = tiny_target("qwen3", vocab=40, dtype=torch.float64, seed=5)
    with torch.no_grad():
        target.model.get_output_embeddings().weight.mul_(0.2)
    engine = Engine(target, tiny_drafter(target, block_size=5), kernels="torch", stop_ids=set())
    for seed in range(3):
        outs = {s: engine.run([2, 3], GenerationConfig(strategy=s, max_new_tokens=16, temperature=1.0, top_p=0.9,
                                                        seed=seed, budget=9)).token_ids
                for s in ("ar", "chain", "fixed", "bastion")}
        assert len({tuple(v) for v in outs.values()}) == 1, outs


def test_noise_rows_are_hashed_once_per_position_and_change_no_draw(monkeypatch):
    """With the torch backend a request hashes each position's noise row once (GumbelRows), not
    once per tree node and round — coupled drafting and the verification share it; the tokens equal
    those of a backend that hashes every row anew (and drafts uncoupled)."""
    import dataclasses

    from bastion.kernels import TORCH
    from bastion.kernels.reference import GumbelRows

    target = tiny_target("qwen3", vocab=40, dtype=torch.float64, seed=5)
    with torch.no_grad():
        target.model.get_output_embeddings().weight.mul_(0.2)
    drafter = tiny_drafter(target, block_size=5)
    memos = []

    class Recorded(GumbelRows):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            memos.append(self)

    monkeypatch.setattr(engine_mod, "GumbelRows", Recorded)
    reusing = Engine(target, drafter, kernels="torch", stop_ids=set())
    fresh = Engine(target, drafter, kernels="torch", stop_ids=set())
    fresh.kernels = dataclasses.replace(TORCH, reuses_noise=False)
    for strategy in ("fixed", "bastion"):
        cfg = GenerationConfig(strategy=strategy, max_new_tokens=24, temperature=1.0, seed=4, budget=9)
        res = reusing.run([2, 3], cfg)  # coupled drafting (the default) reads the same memo first
        assert res.token_ids == fresh.run([2, 3], dataclasses.replace(cfg, couple=False)).token_ids
        nodes = res.mean_tree_size * res.steps
        # one row per position the walk reached, plus the rejected depths of the last round
        assert len(res.token_ids) <= memos[-1].computed <= len(res.token_ids) + drafter.block_size, \
            (memos[-1].computed, nodes)
        assert nodes > 1.5 * memos[-1].computed  # the trees drew from far more rows than were hashed
    assert len(memos) == 2  # the fresh engine made none


@pytest.mark.parametrize("seed", [0, 4, 2**31 + 7, 2**40 + 123, 2**64 - 1])
def test_native_uniform_rows_are_the_reference_streams_bits(seed):
    """GumbelRows hashes new CPU rows natively (cpu_rows.uniform_rows): the same bits as the torch
    reference's uniform_stream (and so the Triton kernel's), for any seed and row counter."""
    from bastion.kernels import cpu_native, cpu_rows
    from bastion.kernels.reference import GumbelRows, row_keys, uniform_stream

    if not cpu_native.available():
        pytest.skip(f"native kernel unavailable: {cpu_native.unavailable_reason()}")
    counters = [0, 1, 17, 2**31 - 1, 2**31, 2**32 + 5, 3 * 2**40]
    for vocab in (1, 7, 49152):
        rows = torch.tensor(counters, dtype=torch.int64)
        want = uniform_stream(seed, 0, len(counters), vocab, counters=rows)
        keys = row_keys(seed, rows & 0xFFFFFFFF).tolist()
        assert torch.equal(cpu_rows.uniform_rows(keys, vocab), want)
    native, reference = GumbelRows(seed), GumbelRows(seed, native=False)
    assert native.native and not reference.native
    assert torch.equal(native.rows([5, 9, 9, 12], 300), reference.rows([5, 9, 9, 12], 300))
