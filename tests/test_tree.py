"""Tree invariants, masks and position ids, and JSON round trips."""

import random

import torch

from bastion.expansion import BudgetRule, best_first_tree, chain_tree
from bastion.kernels.reference import tree_mask_torch, tree_walk_torch
from bastion.tree import DraftTree


def random_logq(depth, vocab, rng):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return torch.log_softmax(torch.randn(depth, vocab, generator=g) * rng.choice([0.5, 2.0, 5.0]), -1)


def test_best_first_invariants():
    rng = random.Random(0)
    for _ in range(40):
        logq = random_logq(rng.randint(1, 15), rng.choice([5, 50, 300]), rng)
        n = rng.randint(1, 120)
        exp = best_first_tree(7, logq, BudgetRule("fixed", budget=n, max_nodes=n, max_depth=15))
        t = exp.tree
        t.validate()
        assert len(t) == 1 + min(n, sum(min(n, logq.shape[1]) ** 0 * logq.shape[1] ** (d + 1)
                                         for d in range(logq.shape[0])))
        assert all(t.parents[i] < i for i in range(1, len(t)))
        assert all(t.path_probs[i] >= t.path_probs[i + 1] - 1e-12 for i in range(1, len(t) - 1))
        for i in range(1, len(t)):  # P(v) = P(parent)·q_d(token)
            assert abs(t.path_probs[i] - t.path_probs[t.parents[i]] * t.marginals[i]) < 1e-9
            assert abs(t.marginals[i] - logq[t.depths[i] - 1, t.tokens[i]].exp().item()) < 1e-5
        for kids in t.children():  # siblings carry distinct tokens
            assert len({t.tokens[k] for k in kids}) == len(kids)


def test_best_first_is_the_best_tree_of_its_size():
    """On a small vocabulary, compare S_n with brute force over all valid trees of size n."""
    rng = random.Random(1)
    logq = random_logq(3, 3, rng)
    # all nodes of the full tree (3 + 9 + 27), with their P
    nodes = {}
    for d in range(1, 4):
        for path in __import__("itertools").product(range(3), repeat=d):
            nodes[path] = float(torch.exp(sum(logq[i, t] for i, t in enumerate(path))))
    for n in range(1, 10):
        exp = best_first_tree(0, logq, BudgetRule("fixed", budget=n, max_nodes=n, max_depth=3))
        # the best tree of n nodes under a monotone surrogate takes the n largest P (parents have larger P)
        best = sum(sorted(nodes.values(), reverse=True)[:n])
        assert abs(exp.tree.expected_tokens - 1 - best) < 1e-6


def test_chain_is_argmax_path():
    logq = random_logq(6, 20, random.Random(2))
    t = chain_tree(3, logq, 6).tree
    assert t.tokens[1:] == logq.argmax(-1).tolist()
    assert t.parents == [-1, 0, 1, 2, 3, 4, 5]


def test_mask_and_positions_match_ancestry():
    rng = random.Random(3)
    for _ in range(20):
        n = rng.randint(1, 40)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        prefix = rng.randint(0, 9)
        mask, pos = tree_mask_torch(parents, prefix, torch.float32)
        assert mask.shape == (1, 1, n, prefix + n) and pos.shape == (1, n)
        assert (mask[0, 0, :, :prefix] == 0).all()
        for i in range(n):
            anc, d, j = set(), 0, i
            while j >= 0:
                anc.add(j)
                j = parents[j]
            d = len(anc) - 1
            assert pos[0, i].item() == prefix + d
            for j in range(n):
                allowed = mask[0, 0, i, prefix + j].item() == 0
                assert allowed == (j in anc)
                if not allowed:
                    assert mask[0, 0, i, prefix + j].item() == torch.finfo(torch.float32).min


def test_walk():
    parents, tokens = [-1, 0, 0, 1, 1, 3], [9, 4, 5, 6, 7, 8]
    assert tree_walk_torch(parents, tokens, [5, 0, 0, 0, 0, 0]) == ([0, 2], 0)
    assert tree_walk_torch(parents, tokens, [4, 6, 0, 8, 0, 1]) == ([0, 1, 3, 5], 1)
    assert tree_walk_torch(parents, tokens, [3, 0, 0, 0, 0, 0]) == ([0], 3)


def test_json_round_trip_and_validation():
    logq = random_logq(5, 30, random.Random(4))
    t = best_first_tree(1, logq, BudgetRule("fixed", budget=20, max_nodes=20, max_depth=5)).tree
    back = DraftTree.from_dict(t.to_dict())
    assert back.tokens == t.tokens and back.parents == t.parents and back.depths == t.depths
    bad = t.to_dict()
    bad["parents"][3] = 5
    try:
        DraftTree.from_dict(bad)
    except ValueError as exc:
        assert "precede" in str(exc)
    else:
        raise AssertionError("invalid tree accepted")


class _PairPrior:
    """A stand-in for datastore.NgramPrior: a fixed random weight per (prev, last, token), the mass
    kept — enough to make every node's children differ."""

    def __init__(self, seed):
        self.rng, self.w = random.Random(seed), {}

    def reweight(self, prev, last, q, tokens, mass):
        w = [qi * self.w.setdefault((prev, last, t), self.rng.uniform(0.1, 1.0)) for qi, t in zip(q, tokens)]
        return [x * mass / sum(w) for x in w]


def test_reranked_best_first_is_the_best_tree_of_its_size():
    """With per-node candidate lists (expansion.Rerank, children listed lazily), the first n pops
    are still the n most likely nodes of the whole conditioned tree."""
    import itertools
    import math

    from bastion.expansion import Rerank, best_first_from_topk, topk_marginals

    rng = random.Random(2)
    for trial in range(6):
        D, V = 3, 4
        logq = random_logq(D, V, rng)
        vals, ids = topk_marginals(logq, V)
        calibrate = (lambda d, qs: [math.log(max(x, 1e-300)) * 1.3 - 0.05 * d for x in qs]) if trial % 2 else None  # monotone
        rerank = Rerank(vals, ids, _PairPrior(trial), calibrate, width=V)
        score = {(): 0.0}
        for d in range(1, D + 1):  # the conditioned log P of every path, by brute force
            for path in itertools.product(range(V), repeat=d):
                prev = ([9, 0] + list(path))[-3]
                lv, lt, _ = rerank(d, prev, ([9, 0] + list(path))[-2])
                score[path] = score[path[:-1]] + lv[lt.index(path[-1])]
        ranked = sorted((s for p, s in score.items() if p), reverse=True)
        for n in (1, 3, 7, 15):
            exp = best_first_from_topk(0, vals, ids, BudgetRule("fixed", budget=n, max_nodes=n, max_depth=D),
                                       rerank=rerank, before_root=9)
            t = exp.tree
            t.validate()
            got = sorted((math.log(p) for p in t.path_probs[1:]), reverse=True)
            assert len(got) == n and all(abs(a - b) < 1e-9 for a, b in zip(got, ranked[:n]))
            assert all(t.parents[i] < i for i in range(1, len(t)))


def test_rerank_with_an_identity_prior_builds_the_plain_tree():
    from bastion.expansion import Rerank, best_first_from_topk, topk_marginals

    class Identity:
        def reweight(self, prev, last, q, tokens, mass):
            return None

    rng = random.Random(4)
    for _ in range(10):
        logq = random_logq(rng.randint(1, 8), 50, rng)
        vals, ids = topk_marginals(logq, 8)
        n = rng.randint(1, 30)
        rule = BudgetRule("fixed", budget=n, max_nodes=n, max_depth=15)
        a = best_first_from_topk(1, vals, ids, rule).tree
        b = best_first_from_topk(1, vals, ids, rule, rerank=Rerank(vals, ids, Identity()), before_root=2).tree
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
