"""Prompt lookup: the n-gram index, merging a proposal into a tree, and the engine with both sources."""

import random

import pytest
import torch

from bastion.engine import Engine, GenerationConfig
from bastion.expansion import BudgetRule, best_first_from_topk, extend_with_copy
from bastion.lookup import LookupStats, NgramIndex, Proposal, Sourced
from tiny import frozen_latency, tiny_drafter, tiny_target


def brute_force(tokens: list[int], max_ngram: int, m: int):
    """Latest earlier occurrence of the longest suffix n-gram; what followed it, never past the end."""
    L = len(tokens)
    for n in range(min(max_ngram, L), 0, -1):
        pat = tokens[L - n:]
        for s in range(L - n - 1, -1, -1):
            if tokens[s:s + n] == pat:
                out = tokens[s + n:min(s + n + m, L)]
                if out:
                    return out, n
    return None


@pytest.mark.parametrize("seed", range(6))
def test_index_matches_brute_force_as_tokens_arrive(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])  # small vocabularies: many repeats
    tokens = [rng.randrange(vocab) for _ in range(5)]
    index = NgramIndex(tokens, max_ngram=3)
    for _ in range(60):
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        tokens += new
        index.extend(new)
        got = index.propose(6)
        ref = brute_force(tokens, 3, 6)
        assert (None if got is None else (got.tokens, got.ngram)) == ref


def test_index_never_proposes_from_the_future_and_rejects_bad_sizes():
    index = NgramIndex([1, 2, 3, 1, 2], max_ngram=2)
    p = index.propose(10)
    assert p.tokens == [3, 1, 2] and p.ngram == 2  # after the earlier "1 2": up to the current end
    assert NgramIndex([7, 8, 9]).propose(4) is None
    assert NgramIndex([5]).propose(3) is None
    with pytest.raises(ValueError):
        NgramIndex([1], max_ngram=0)


def _tree_with_one_branch():
    # root 0 → 11 (q .6) → 12 (q .5); root → 21 (q .3)
    vals = [[-0.51, -1.2], [-0.69, -3.0]]
    ids = [[11, 21], [12, 22]]
    return best_first_from_topk(0, vals, ids, BudgetRule("fixed", 3, 3))


def test_merge_reuses_matching_nodes_and_hangs_the_rest_below():
    exp = _tree_with_one_branch()
    n0 = len(exp.tree)
    chain = extend_with_copy(exp, [11, 12, 13, 14], [0.9, 0.9, 0.8, 0.8], lambda n: 0.0, 1.0, 100, 100)
    tree = exp.tree
    tree.validate()
    assert chain[:2] == [tree.tokens.index(11), tree.tokens.index(12)]  # reused, not duplicated
    assert [tree.tokens[v] for v in chain] == [11, 12, 13, 14] and len(tree) == n0 + 2
    assert tree.parents[chain[2]] == chain[1] and tree.ranks[chain[2]] == tree.ranks[chain[3]] == -1
    # P of the new nodes starts from max(P of the attach node, product of the reused rates)
    assert tree.path_probs[chain[2]] == pytest.approx(max(0.6 * 0.5, 0.81) * 0.8)
    assert "lookup: 2 of 2" in exp.stop_reason


def test_merge_prices_reused_tokens_and_new_nodes_with_their_own_rates():
    exp = _tree_with_one_branch()
    chain = extend_with_copy(exp, [11, 12, 13, 14], [0.9, 0.9, 0.8, 0.8], lambda n: 0.0, 1.0, 100, 100,
                               fresh_rates=[0.1, 0.1, 0.4, 0.5])
    tree = exp.tree
    assert tree.path_probs[chain[2]] == pytest.approx(0.81 * 0.4)  # reused part at 0.9 · 0.9, new at 0.4
    assert tree.path_probs[chain[3]] == pytest.approx(0.81 * 0.4 * 0.5)
    prop = Sourced("lookup", Proposal([11, 12, 13, 14], 3), [0.1, 0.1, 0.4, 0.5], [0.9, 0.9, 0.8, 0.8],
                   "branch", chain, reused=2)
    assert prop.kinds() == ["reuse", "reuse", "branch", "branch"]
    assert prop.used_rates() == [0.9, 0.9, 0.4, 0.5]  # what a replay prices the same merge with


def test_merge_keeps_only_what_the_throughput_rule_pays_for():
    # free verification: everything is kept; expensive verification: nothing
    exp = _tree_with_one_branch()
    assert len(extend_with_copy(exp, [5, 6, 7], [0.5, 0.5, 0.5], lambda n: 0.0, 1.0, 100, 100)) == 3
    exp = _tree_with_one_branch()
    n0 = len(exp.tree)
    assert extend_with_copy(exp, [5, 6, 7], [0.5, 0.5, 0.5], lambda n: float(n), 0.0, 100, 100) == []
    assert len(exp.tree) == n0 and [d.added for d in exp.trace[-3:]] == [False] * 3
    # a cost step after one node: only the first is worth it
    exp = _tree_with_one_branch()
    cost = lambda n: 1.0 if n <= n0 + 1 else 5.0  # noqa: E731
    assert len(extend_with_copy(exp, [5, 6, 7], [0.9, 0.9, 0.9], cost, 0.0, 100, 100)) == 1
    # caps: node budget and depth
    exp = _tree_with_one_branch()
    assert len(extend_with_copy(exp, [5, 6, 7], [1.0] * 3, lambda n: 0.0, 1.0, n0 - 1 + 2, 100)) == 2
    exp = _tree_with_one_branch()
    assert len(extend_with_copy(exp, [5, 6, 7], [1.0] * 3, lambda n: 0.0, 1.0, 100, 1)) == 1


def test_stats_learn_per_depth_and_skip_untested_tokens():
    st = LookupStats(prior_rate=0.3, prior_strength=2.0, decay=1.0)
    assert st.rate(2, 1) == pytest.approx(0.3)
    for _ in range(50):  # token 1 always accepted, token 2 never, token 3 never tested
        st.observe(2, [1, 2, 3], [True, True, False], accepted={0, 1})
    assert st.rate(2, 1) > 0.95 and st.rate(2, 2) < 0.05 and st.rate(2, 3) == pytest.approx(0.3)
    assert st.rate(3, 1) == pytest.approx(0.3)  # another n-gram length has its own cells


def test_stats_keep_reused_branch_and_alone_tokens_apart():
    st = LookupStats(prior_rate=0.3, prior_strength=2.0, decay=1.0)
    for _ in range(50):  # agreeing with the drafter: accepted; contradicting it: rejected
        st.observe(3, [1, 5], [True, True], accepted={0, 1}, kinds=["reuse", "branch"])
    assert st.rate(3, 1, "reuse") > 0.95 and st.rate(3, 2, "branch") < 0.05
    assert st.rate(3, 1, "branch") == pytest.approx(0.3) and st.rate(3, 2, "alone") == pytest.approx(0.3)
    with pytest.raises(ValueError, match="kind"):
        st.rate(3, 1, "other")


def _looping_prompt(target, n=40):
    """A prompt whose greedy continuation repeats itself (tiny random models fall into cycles)."""
    out = target.model.generate(torch.tensor([[3, 5, 7]]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0].tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_with_lookup_is_lossless_and_accepts_copies(temperature):
    target = tiny_target("llama", dtype=torch.float64)
    prompt = _looping_prompt(target)
    engine = Engine(target, tiny_drafter(target), kernels="torch", stop_ids=set())
    cfg = dict(max_new_tokens=60, temperature=temperature, seed=5)
    ref = engine.run(prompt, GenerationConfig(strategy="ar", **cfg)).token_ids
    steps = list(engine.generate(prompt, GenerationConfig(strategy="bastion", **cfg)))
    assert [t for s in steps for t in s.tokens] == ref
    off = list(engine.generate(prompt, GenerationConfig(strategy="bastion", lookup=False, **cfg)))
    assert [t for s in off for t in s.tokens] == ref
    assert all(-1 not in s.tree.ranks for s in off) and not any(s.lookup_tokens for s in off)
    looked = [s for s in steps if -1 in s.tree.ranks]
    assert looked and all(s.lookup_tokens for s in looked)
    if temperature == 0.0:  # a random drafter accepts ~nothing; copies from the loop do
        accepted_lookup = sum(1 for s in steps for v in s.accepted[1:] if s.tree.ranks[v] == -1)
        assert accepted_lookup >= 10
        assert len(ref) / len(steps) > len(ref) / len(off)  # τ with lookup > τ without
    with pytest.raises(ValueError, match="lookup"):
        GenerationConfig(lookup_tokens=0).validate()


def test_plain_rate_prices_a_round_without_draft_as_the_copied_chains_alone():
    """The draft gate's other option: root + copied chains at their "alone" rates, sized by the
    throughput rule — the tree a skipped round would verify — against a brute force over prefixes."""
    from bastion.draft_policy import plain_rate
    from bastion.lookup import CopySources

    cost = lambda n: 1.0 + 0.1 * n  # noqa: E731
    t_o = 0.5
    st = LookupStats(prior_rate=0.3, prior_strength=2.0, decay=1.0)
    for _ in range(40):  # alone: depths 1-2 always accepted, 3 half the time; branch: never
        st.observe(3, [1, 2, 3], [True, True, True], accepted={0, 1, 2}, kinds=["alone"] * 3)
        st.observe(3, [1, 2, 3], [True, True, True], accepted={0, 1, 2, 3}, kinds=["alone"] * 3)
        st.observe(3, [1, 2, 3], [True, False, False], accepted={0}, kinds=["branch"] * 3)
    prompt = [7, 8, 9, 4, 5, 6, 1, 7, 8, 9]  # suffix 7 8 9 seen before: lookup proposes 4 5 6 1
    copies = CopySources(prompt, 4, {"lookup": st})
    props = copies.propose(drafted=True)  # priced as branches: plain_rate must re-price them
    assert [p.proposal.tokens for p in props] == [[4, 5, 6, 1]] and props[0].rates[0] < 0.1
    alone = st.rates(props[0].proposal, "alone")
    best, p, s = 1.0 / (t_o + cost(1)), 1.0, 1.0
    for j, r in enumerate(alone, start=1):
        p *= r
        s += p
        best = max(best, s / (t_o + cost(1 + j)))
    got = plain_rate(0, props, copies, cost, t_o, 100, 100)
    assert got == pytest.approx(best) and got > 1.5 / (t_o + cost(1))
    assert plain_rate(0, [], copies, cost, t_o, 100, 100) == pytest.approx(1.0 / (t_o + cost(1)))
    # a depth cap of 1 keeps one copied token at most
    assert plain_rate(0, props, copies, cost, t_o, 100, 1) == pytest.approx(
        max(1.0 / (t_o + cost(1)), (1 + alone[0]) / (t_o + cost(2))))


def test_engine_gate_weighs_the_merged_tree_against_the_copied_chains_alone(monkeypatch):
    """The engine hands the draft gate the round's two real options: the tree it verifies (copy
    branches included) and :func:`plain_rate` of the same proposals — not the drafter's tree alone
    against a bare step, the comparison of sessions 2–53 (which this test would fail)."""
    import bastion.engine as engine_module
    from bastion.draft_policy import DraftGate

    target = tiny_target("llama", dtype=torch.float64)
    prompt = _looping_prompt(target)
    engine = Engine(target, tiny_drafter(target), kernels="torch", stop_ids=set())
    frozen_latency(engine, draft_s=2e-4)
    cfg = GenerationConfig(strategy="bastion", max_new_tokens=60)
    judged, priced = [], []
    real_judge, real_plain = DraftGate.judge, engine_module.plain_rate
    monkeypatch.setattr(DraftGate, "judge", lambda g, t, p: judged.append((t, p, engine.overhead(cfg)))
                        or real_judge(g, t, p))
    monkeypatch.setattr(engine_module, "plain_rate",
                        lambda *a: priced.append((a[1], a[3], a[4], real_plain(*a))) or priced[-1][3])
    ref = engine.run(prompt, GenerationConfig(strategy="ar", max_new_tokens=60)).token_ids
    steps = list(engine.generate(prompt, cfg))
    assert [t for s in steps for t in s.tokens] == ref
    drafted = [s for s in steps if s.draft_ids]
    assert len(judged) == len(priced) == len(drafted) > 0
    copied = 0
    for s, (tree_rate, other, t_round), (proposals, cost, t_plain, price) in zip(drafted, judged, priced):
        assert other == price and t_plain < t_round  # the round without a draft saves T_d
        # the tree judged is the tree verified, copied branches (rank < 0) and all
        assert tree_rate == pytest.approx(s.tree.expected_tokens / (t_round + cost(len(s.tree))))
        bare = 1.0 / (t_plain + cost(1))  # the old comparison's other side: a bare step
        assert other >= bare * (1 - 1e-12)
        if other > 1.01 * bare:  # a copied chain that pays alone makes the round without a draft worth more
            assert proposals
            copied += 1
    assert copied >= 3, copied


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_copies_alone_never_draft_and_stay_lossless(temperature):
    """``draft=False`` (the benchmark's ``bastion:copies``): no drafter forward, no drafter context,
    every tree the root plus copied chains — and still AR's tokens."""
    from bastion.bench import parse_strategies

    target = tiny_target("llama", dtype=torch.float64)
    prompt = _looping_prompt(target)
    drafter = tiny_drafter(target)
    calls = []
    real = drafter.draft
    drafter.draft = lambda *a, **k: calls.append(1) or real(*a, **k)
    engine = Engine(target, drafter, kernels="torch", stop_ids=set())
    cfg = dict(max_new_tokens=60, temperature=temperature, seed=5)
    ref = engine.run(prompt, GenerationConfig(strategy="ar", **cfg)).token_ids
    steps = list(engine.generate(prompt, GenerationConfig(strategy="bastion", draft=False, **cfg)))
    assert [t for s in steps for t in s.tokens] == ref
    assert not calls and not any(s.draft_ids for s in steps)
    assert all(r < 0 for s in steps for r in s.tree.ranks[1:])  # copy nodes only (rank −1 / −2)
    if temperature == 0.0:  # the loop's copies are accepted
        assert len(steps) < len(ref)
    assert not {s.name: s for s in parse_strategies("bastion:copies")}["bastion:copies"].draft
    with pytest.raises(ValueError, match="copy sources alone"):
        GenerationConfig(strategy="chain", draft=False).validate()
