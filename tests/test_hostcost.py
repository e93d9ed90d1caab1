"""HostCost (the host's build + commit time as a + b·n) and the engine's opt-in pricing of it."""

from __future__ import annotations

import math

import torch

from bastion.engine import Engine, GenerationConfig
from bastion.hostcost import HostCost, HostCosts
from tiny import OracleDrafter, hf_greedy, tiny_drafter, tiny_target


def test_host_cost_fits_a_line_and_trusts_the_slope_only_once_sizes_spread():
    """Exact data on a line gives the line back; equal sizes give no slope (their mean as a); a cost
    that falls with n gives slope 0, never a negative one; NaN and empty trees are no measurements;
    the fit follows a change of the host within a few dozen rounds (rate 0.05)."""
    h = HostCost()
    for i in range(200):
        n = 1 + i % 20
        h.observe(n, 0.002 + 1e-4 * n)
    a, b = h.line()
    assert math.isclose(a, 0.002, rel_tol=1e-9) and math.isclose(b, 1e-4, rel_tol=1e-9)

    same = HostCost()
    for _ in range(50):
        same.observe(5, 0.003)
    assert math.isclose(same.line()[0], 0.003, rel_tol=1e-12) and same.line()[1] == 0.0

    falling = HostCost()
    for i in range(100):
        n = 1 + i % 10
        falling.observe(n, 0.01 - 5e-4 * n)
    assert falling.line()[1] == 0.0 and falling.line()[0] > 0

    h.observe(3, float("nan"))
    h.observe(0, 1.0)
    assert math.isclose(h.line()[1], 1e-4, rel_tol=1e-9)
    assert HostCost().line() == (0.0, 0.0)

    for i in range(200):  # the host slows down: the line follows
        n = 1 + i % 20
        h.observe(n, 0.004 + 3e-4 * n)
    a, b = h.line()
    assert abs(a - 0.004) < 1e-4 and abs(b - 3e-4) < 1e-5


class FixedHost(HostCost):
    """A host whose per-node work is known and large (what a GPU's flat verification exposes)."""

    def __init__(self, a: float, b: float):
        super().__init__()
        self.fixed = (a, b)

    def observe(self, nodes: int, seconds: float) -> None:
        pass

    def line(self) -> tuple[float, float]:
        return self.fixed


def test_node_cost_prices_host_work_per_node_shrinks_trees_and_stays_lossless():
    """With ``node_cost`` the engine's cost adds b·n and its overhead takes a instead of T_o; a large b
    shrinks Bastion's trees against the same engine without it; the output is AR's either way, and
    the engine learns a HostCost per kind of tree from every round."""
    target = tiny_target("llama", dtype=torch.float64)
    prompt = [3, 5, 7]
    full = hf_greedy(target, prompt, 40)
    engine = Engine(target, OracleDrafter(tiny_drafter(target), full, target.vocab_size, hit=0.9, spread=3),
                    kernels="torch", stop_ids=set())
    ref = engine.run(prompt, GenerationConfig(strategy="ar", max_new_tokens=40)).token_ids
    plain = engine.run(prompt, GenerationConfig(strategy="bastion", max_new_tokens=40))
    kinds = {GenerationConfig(strategy=s).builder() for s in ("ar", "bastion")}
    assert set(engine.host.lines) == kinds
    assert engine.host.lines[GenerationConfig(strategy="bastion").builder()].sums[0] > 0

    priced = GenerationConfig(strategy="bastion", max_new_tokens=40, node_cost=True)
    engine.host.lines[priced.builder()] = FixedHost(a=0.0005, b=0.05)
    base = engine.cost(GenerationConfig(strategy="bastion"), 10)
    assert math.isclose(engine.cost(priced, 10)(7) - base(7), 0.35, rel_tol=1e-9)
    assert math.isclose(engine.overhead(priced), engine.latency.draft_s + 0.0005, rel_tol=1e-12)
    own = engine.latency.overheads(GenerationConfig(strategy="bastion").setting())
    assert engine.overhead(GenerationConfig(strategy="bastion"), drafting=False) == own[1] > 0
    small = engine.run(prompt, priced)
    assert plain.token_ids == ref and small.token_ids == ref
    assert plain.mean_tree_size > 2.0 and small.mean_tree_size < plain.mean_tree_size / 2


def test_a_setting_plans_with_its_own_round_times_whatever_ran_before():
    """T_d and T_o of one setting come from that setting's rounds only (a benchmark runs several
    strategies on one engine): a ``fixed:16`` request leaves Bastion's overhead exactly as it was while
    the engine's average over every setting moves; the request's length and seed are not part of the
    setting; a setting that has not run yet plans with the engine's average."""
    target = tiny_target("llama", dtype=torch.float64)
    prompt = [3, 5, 7]
    full = hf_greedy(target, prompt, 24)
    engine = Engine(target, OracleDrafter(tiny_drafter(target), full, target.vocab_size, hit=0.9, spread=3),
                    kernels="torch", stop_ids=set())
    bastion = GenerationConfig(strategy="bastion", max_new_tokens=24)
    assert engine.overhead(bastion) == engine.latency.round_overhead() == 0.0
    assert engine.run(prompt, bastion).token_ids == full[len(prompt):]
    before, average = engine.overhead(bastion), engine.latency.round_overhead()
    assert before > 0
    engine.run(prompt, GenerationConfig(strategy="fixed", budget=16, max_new_tokens=24, seed=5))
    assert engine.overhead(bastion) == before
    assert engine.overhead(GenerationConfig(strategy="bastion", max_new_tokens=7, seed=3)) == before
    assert engine.latency.round_overhead() != average
    assert engine.overhead(GenerationConfig(strategy="bastion", condition=False)) == engine.latency.round_overhead()


def test_each_kind_of_tree_keeps_its_own_host_line_priced_or_not():
    """The host's line is keyed by the setting less ``node_cost`` (``GenerationConfig.builder``): Bastion
    with and without the n-gram re-weighting learn apart (their trees cost differently per node), a
    priced request reads the unpriced twin's line, length and seed do not matter; a kind with no round
    yet prices nothing (b = 0, T_o as usual); the table keeps the newest ``max_kinds``."""
    plain = GenerationConfig(strategy="bastion")
    assert GenerationConfig(strategy="bastion", node_cost=True, max_new_tokens=9, seed=4).builder() == plain.builder()
    assert GenerationConfig(strategy="bastion", condition=False).builder() != plain.builder()
    assert plain.builder() is plain.builder()  # made once per config

    costs = HostCosts(max_kinds=2)
    assert costs.line(plain.builder()) is None
    for i in range(40):
        costs.observe(plain.builder(), 1 + i % 8, 0.001 + 1e-4 * (1 + i % 8))
        costs.observe(GenerationConfig(strategy="bastion", condition=False).builder(), 1 + i % 8, 0.005)
    a, b = costs.line(plain.builder())
    assert math.isclose(a, 0.001, rel_tol=1e-6) and math.isclose(b, 1e-4, rel_tol=1e-6)
    other = costs.line(GenerationConfig(strategy="bastion", condition=False).builder())
    assert math.isclose(other[0], 0.005, rel_tol=1e-9) and other[1] == 0.0
    costs.observe(GenerationConfig(strategy="fixed").builder(), 4, 0.002)  # a third kind: the oldest goes
    assert costs.line(plain.builder()) is None and len(costs.lines) == 2

    target = tiny_target("llama", dtype=torch.float64)
    engine = Engine(target, OracleDrafter(tiny_drafter(target), [3, 5, 7] * 4, target.vocab_size),
                    kernels="torch", stop_ids=set())
    priced = GenerationConfig(strategy="bastion", node_cost=True)
    engine.host.lines[GenerationConfig(strategy="bastion", condition=False).builder()] = FixedHost(a=0.0005, b=0.05)
    assert engine.cost(priced, 10)(7) == engine.cost(plain, 10)(7)  # another kind's line is not this one's
    assert engine.overhead(priced) == engine.overhead(plain)
