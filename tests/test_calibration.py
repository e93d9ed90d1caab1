"""The acceptance calibrator: identity when empty, learns a known g, monotone, used by the engine."""

import math
import random

import pytest
import torch

from bastion.calibration import AcceptanceCalibrator, isotonic_fit
from bastion.engine import Engine, GenerationConfig
from bastion.expansion import BudgetRule, best_first_from_topk
from bastion.tree import DraftTree
from tiny import OracleDrafter, tiny_drafter, tiny_target


def _feed(cal: AcceptanceCalibrator, rate, n: int, depth: int = 1, seed: int = 0) -> None:
    """n chains whose node at ``depth`` has marginal q ~ U(0, 1) and is accepted w.p. rate(q)."""
    rng = random.Random(seed)
    for _ in range(n):
        tree = DraftTree.root_only(0)
        marg, parent = [1.0], 0
        for d in range(1, depth):  # accepted ancestors
            parent = tree.add(d, parent, 1.0, 1.0, 0)
            marg.append(1.0)
        q = rng.random()
        node = tree.add(99, parent, q, q, 0)
        marg.append(q)
        accepted = list(range(depth)) + ([node] if rng.random() < rate(q) else [])
        cal.observe(tree, marg, accepted)


def test_empty_calibrator_is_the_identity():
    logq = torch.log_softmax(torch.randn(5, 12), -1).sort(-1, descending=True).values
    assert torch.equal(AcceptanceCalibrator().log_g(logq), logq)


def test_learns_an_overconfident_drafter_per_depth_group():
    cal = AcceptanceCalibrator(decay=1.0)
    _feed(cal, lambda q: q * q, 4000, depth=1)
    _feed(cal, lambda q: q, 4000, depth=3, seed=1)
    q = torch.tensor([[0.2, 0.5, 0.8, 0.95]] * 3)
    g = cal.log_g(q.log(), path_scale=False).exp()  # the per-node fit (these trees' P are not its own)
    assert torch.allclose(g[0], q[0] ** 2, atol=0.06), g[0]          # depth 1: learned q²
    assert torch.allclose(g[2], q[2], atol=0.06), g[2]               # depth 3: calibrated already
    assert torch.allclose(g[1], q[1], atol=1e-2), g[1]               # depth 2: no data, identity
    assert cal.group(1) == 0 and cal.group(3) == cal.group(4) == 2 and cal.group(15) == 4
    rel = cal.reliability()
    assert rel and all(0.0 <= r["rate"] <= 1.0 and r["count"] >= 1 for r in rel)


def test_calibrated_values_are_monotone_and_keep_best_first_exact():
    cal = AcceptanceCalibrator(decay=1.0, prior=0.5)
    # a non-monotone truth (noisy bins) must still give a non-decreasing g
    _feed(cal, lambda q: 0.9 if 0.3 < q < 0.4 else 0.1, 3000)
    grid = torch.linspace(1e-4, 1.0, 400)
    g = cal.log_g(grid.log()[None]).exp()[0]
    assert bool((g[1:] >= g[:-1] - 1e-7).all()) and float(g.max()) <= 1.0
    assert isotonic_fit([3.0, 1.0, 2.0], [1.0, 1.0, 1.0]) == [2.0, 2.0, 2.0]
    # siblings stay in descending order, so the heap's best-first order is still exact
    logq = torch.log_softmax(3 * torch.randn(6, 20), -1).sort(-1, descending=True).values
    lg = cal.log_g(logq)
    assert bool((lg[:, 1:] <= lg[:, :-1] + 1e-7).all())
    exp = best_first_from_topk(0, lg.tolist(), [list(range(20))] * 6, BudgetRule("fixed", 25, 25))
    probs = exp.tree.path_probs[1:]
    assert all(a >= b - 1e-9 for a, b in zip(probs, probs[1:]))  # pops in non-increasing P
    for i in range(1, len(exp.tree)):
        assert exp.tree.path_probs[i] <= exp.tree.path_probs[exp.tree.parents[i]] + 1e-12


def test_engine_calibration_fixes_the_surrogate_at_t1_and_stays_lossless():
    target = tiny_target("llama", dtype=torch.float64)
    prompt = [3, 5, 7]
    greedy = target.model.generate(torch.tensor([prompt]), max_new_tokens=80, min_new_tokens=80,
                                   do_sample=False)[0].tolist()
    bias, outputs = {}, {}
    for calibrate in (False, True):
        # an overconfident drafter: sharp on the greedy path, but at T = 1 the target often samples off it
        drafter = OracleDrafter(tiny_drafter(target), greedy, target.vocab_size, hit=0.95, spread=1, sharpness=20.0)
        engine = Engine(target, drafter, kernels="torch", stop_ids=set())
        cfg = GenerationConfig(strategy="fixed", budget=6, max_new_tokens=80, temperature=1.0, seed=3,
                               calibrate=calibrate)
        steps = list(engine.generate(prompt, cfg))
        late = steps[8:]
        bias[calibrate] = sum(s.expected_tokens - len(s.tokens) for s in late) / len(late)
        outputs[calibrate] = [t for s in steps for t in s.tokens]
        if calibrate:
            assert engine.calibrator(cfg).observed > 0
            assert engine.calibrator(GenerationConfig()).observed == 0  # T = 0 keeps its own
    assert bias[False] > 0.5, bias                      # raw q overstates acceptance at T = 1 ...
    assert abs(bias[True]) < 0.5 * bias[False], bias    # ... the calibrated surrogate much less
    assert outputs[True] == outputs[False]              # same seed, same samples: still lossless
    assert not math.isnan(bias[True])


def test_path_scale_learns_how_much_path_products_overstate_and_scales_depth_one_only():
    # a prior so strong that the per-node fit stays g(q) = q: trees of q = 0.8, 0.8 predict
    # 0.8 + 0.64 = 1.44 accepted drafter nodes, and accept 1.0 on average (both or neither)
    cal = AcceptanceCalibrator(decay=1.0, prior=1e9)
    assert cal.path_scale == 1.0
    for r in range(200):
        tree = DraftTree.root_only(0)
        a = tree.add(5, 0, 0.8, 0.8, 0)
        tree.add(6, a, 0.8, 0.64, 0)
        tree.add(9, 0, 0.5, 0.5, -1)  # a copy node (rank < 0): not the drafter's, not counted
        cal.observe(tree, tree.marginals, [0, 1, 2] if r % 2 else [0])
    assert cal.path_scale == pytest.approx((2 * 100 + 4) / (200 * 1.44 + 4), rel=1e-2)
    logq = torch.log(torch.tensor([[0.8, 0.1], [0.8, 0.1]]))
    diff = cal.log_g(logq) - cal.log_g(logq, path_scale=False)
    assert torch.allclose(diff[0], torch.full((2,), math.log(cal.path_scale)))  # depth 1: every P(v) × κ
    assert torch.allclose(diff[1], torch.zeros(2))                              # deeper: unchanged


def test_table_rebuilt_once_new_counts_reach_the_refresh_share():
    """Between rebuilds the per-node fit is the last table's (the path scale κ still moves every
    tree); a rebuild follows once the counts added since exceed ``refresh`` of the total, and
    refresh = 0 rebuilds after every tree (the exact fit)."""
    lazy, exact = AcceptanceCalibrator(decay=1.0, refresh=0.05), AcceptanceCalibrator(decay=1.0, refresh=0.0)
    logq = torch.log(torch.tensor([[0.3, 0.6, 0.9]]))
    stale = 0
    for seed in range(300):
        before = lazy.log_g(logq, path_scale=False).clone() if lazy.observed else None
        _feed(lazy, lambda q: q * q, 1, seed=seed)
        _feed(exact, lambda q: q * q, 1, seed=seed)
        if lazy._table is not None:  # kept: log g unchanged although a count was added
            assert before is not None and torch.equal(lazy.log_g(logq, path_scale=False), before)
            assert lazy._since <= 0.05 * lazy.observed
            stale += 1
        else:
            assert torch.equal(lazy.log_g(logq, path_scale=False), exact.log_g(logq, path_scale=False))
    assert 200 < stale < 300  # most rounds reuse the table; rebuilds keep coming
    assert torch.allclose(lazy.log_g(logq).exp(), exact.log_g(logq).exp(), atol=0.02)


def test_scalar_lookup_equals_the_table_lookup():
    """expansion.Rerank calibrates a node's few candidates through scalar(); it must give log_g's values."""
    assert AcceptanceCalibrator().scalar() is None  # nothing observed: the identity, applied by the caller
    cal = AcceptanceCalibrator(decay=1.0)
    _feed(cal, lambda q: q * q, 3000, depth=1)
    _feed(cal, lambda q: 0.7 * q, 3000, depth=2, seed=1)
    f = cal.scalar()
    qs = [0.001, 0.2, 0.5, 0.73, 0.999, 1.0]
    for depth in (1, 2, 5):
        rows = torch.full((depth, len(qs)), -30.0)
        rows[depth - 1] = torch.tensor(qs).log()
        want = cal.log_g(rows)[depth - 1].tolist()  # depth 1 includes the path scale in both
        assert f(depth, qs) == pytest.approx(want, abs=1e-6)


def test_row_lookup_equals_the_tensor_lookup():
    """The engine calibrates each draft's top-k through log_g_rows (NumPy); it must give log_g's values,
    path scale included, and None (the identity) while nothing is observed."""
    logq = torch.log_softmax(torch.randn(7, 16), -1).sort(-1, descending=True).values
    assert AcceptanceCalibrator().log_g_rows(logq) is None
    cal = AcceptanceCalibrator()
    _feed(cal, lambda q: q * q, 2000, depth=1)
    _feed(cal, lambda q: 0.6 * q, 2000, depth=4, seed=2)
    for r in range(50):  # a path scale below 1, so depth 1's shift is exercised
        tree = DraftTree.root_only(0)
        a = tree.add(5, 0, 0.9, 0.9, 0)
        tree.add(6, a, 0.9, 0.81, 0)
        cal.observe(tree, tree.marginals, [0])
    assert cal.path_scale < 0.9
    got = torch.tensor(cal.log_g_rows(logq), dtype=torch.float64)
    assert got.shape == logq.shape
    assert torch.allclose(got, cal.log_g(logq).double(), atol=1e-6)
    assert not torch.allclose(got, logq.double(), atol=1e-2)  # it did calibrate
