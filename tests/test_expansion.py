"""The stopping rule picks the size that maximises predicted throughput (brute force check)."""

import random

import torch

from bastion.expansion import BudgetRule, best_first_tree


def random_convex_cost(rng):
    """C(n): flat for a while, then rising with non-decreasing increments (convex), in seconds."""
    flat = rng.randint(1, 60)
    base = rng.uniform(0.005, 0.06)
    slope0 = rng.uniform(0.0, 0.002)
    curve = rng.uniform(0.0, 5e-5)

    def cost(n):
        k = max(0, n - flat)
        return base + slope0 * k + curve * k * k
    return cost


def test_adaptive_stop_is_brute_force_optimum():
    rng = random.Random(0)
    for trial in range(150):
        depth, vocab = rng.randint(1, 15), rng.choice([8, 64, 500])
        g = torch.Generator().manual_seed(trial)
        logq = torch.log_softmax(torch.randn(depth, vocab, generator=g) * rng.choice([0.3, 1.0, 3.0, 8.0]), -1)
        cost = random_convex_cost(rng)
        overhead = rng.uniform(0.0, 0.05)
        cap = rng.choice([16, 64, 200])
        exp = best_first_tree(0, logq, BudgetRule("adaptive", max_nodes=cap, max_depth=15), cost, overhead)
        # brute force over every prefix of the full pop order (up to the cap)
        full = best_first_tree(0, logq, BudgetRule("fixed", budget=cap, max_nodes=cap, max_depth=15)).tree
        s, best, best_n = 0.0, -1.0, 0
        for n in range(1, len(full) + 1):
            s += full.path_probs[n - 1]
            thr = s / (overhead + cost(n))
            if thr > best * (1 + 1e-12):
                best, best_n = thr, n
        got = exp.tree.expected_tokens / (overhead + cost(len(exp.tree)))
        assert abs(got - best) <= 1e-9 * best, (trial, len(exp.tree), best_n)
        assert exp.tree.tokens == full.tokens[:len(exp.tree)]


def test_trace_records_every_pop_and_the_stop():
    g = torch.Generator().manual_seed(1)
    logq = torch.log_softmax(torch.randn(8, 100, generator=g) * 3, -1)
    cost = lambda n: 0.02 + 0.001 * n  # noqa: E731
    exp = best_first_tree(0, logq, BudgetRule("adaptive", max_nodes=200, max_depth=8, lookahead=4), cost, 0.01)
    n = len(exp.tree)
    added = [d for d in exp.trace if d.added]
    assert len(added) == n - 1 and [d.node for d in added] == list(range(1, n))
    assert all(not d.added for d in exp.trace[n - 1:])
    assert "throughput" in exp.stop_reason or "cap" in exp.stop_reason
    for d in exp.trace:
        assert abs(d.throughput - d.expected / (0.01 + d.cost)) < 1e-6 * d.throughput


def test_min_nodes_and_caps():
    g = torch.Generator().manual_seed(2)
    logq = torch.log_softmax(torch.randn(5, 50, generator=g), -1)
    steep = lambda n: 0.01 * n  # noqa: E731
    assert len(best_first_tree(0, logq, BudgetRule("adaptive", max_nodes=100, max_depth=5, min_nodes=10),
                               steep, 0.0).tree) >= 11
    assert len(best_first_tree(0, logq, BudgetRule("adaptive", max_nodes=100, max_depth=2),
                               lambda n: 0.01, 0.0).tree) == 101
    assert max(best_first_tree(0, logq, BudgetRule("adaptive", max_nodes=100, max_depth=2),
                               lambda n: 0.01, 0.0).tree.depths) <= 2
