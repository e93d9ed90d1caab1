"""Greedy speculative decoding must reproduce plain greedy decoding token for token."""

import random

import pytest
import torch

from bastion.engine import Engine, GenerationConfig
from tiny import OracleDrafter, frozen_latency, hf_greedy, tiny_drafter, tiny_target

STRATS = [("chain", {}), ("fixed", {"budget": 1}), ("fixed", {"budget": 7}), ("fixed", {"budget": 40}),
          ("bastion", {}), ("bastion", {"max_nodes": 3}), ("bastion", {"min_nodes": 20})]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_all_strategies_equal_ar_and_hf_generate(family):
    target = tiny_target(family, dtype=torch.float64)
    inner = tiny_drafter(target, block_size=6)
    rng = random.Random(0)
    for trial in range(6):
        prompt = [rng.randrange(target.vocab_size - 1) for _ in range(rng.randint(1, 12))]
        n = 24
        full = hf_greedy(target, prompt, n)
        ref = full[len(prompt):]
        drafter = OracleDrafter(inner, full, target.vocab_size, hit=rng.choice([0.5, 0.8, 0.95]),
                                spread=rng.choice([1, 2, 4]), seed=trial)
        engine = Engine(target, drafter, kernels="torch", stop_ids=set())
        assert engine.run(prompt, GenerationConfig(strategy="ar", max_new_tokens=n)).token_ids == ref
        for strategy, kw in STRATS:
            res = engine.run(prompt, GenerationConfig(strategy=strategy, max_new_tokens=n, **kw))
            assert res.token_ids == ref, (family, trial, strategy, kw)


def test_trees_actually_accept_drafts():
    """The oracle must produce multi-token rounds, or the test above would prove little."""
    target = tiny_target("llama", dtype=torch.float64)
    prompt = [3, 5, 7]
    full = hf_greedy(target, prompt, 30)
    engine = Engine(target, OracleDrafter(tiny_drafter(target), full, target.vocab_size, hit=0.9, spread=3),
                    kernels="torch", stop_ids=set())
    res = engine.run(prompt, GenerationConfig(strategy="fixed", budget=20, max_new_tokens=30))
    assert res.tau > 2.0
    steps = list(engine.generate(prompt, GenerationConfig(strategy="fixed", budget=20, max_new_tokens=30)))
    # some accepted paths leave node order (siblings rejected), which exercises the cache gather
    assert any(s.accepted != list(range(len(s.accepted))) for s in steps)


def test_real_random_drafter_float32():
    target = tiny_target("qwen3", dtype=torch.float32)
    engine = Engine(target, tiny_drafter(target, block_size=8, layers=2), kernels="torch", stop_ids=set())
    prompt = [1, 2, 3, 4, 5]
    ref = engine.run(prompt, GenerationConfig(strategy="ar", max_new_tokens=16)).token_ids
    assert ref == hf_greedy(target, prompt, 16)[len(prompt):]
    for strategy in ("chain", "fixed", "bastion"):
        assert engine.run(prompt, GenerationConfig(strategy=strategy, max_new_tokens=16)).token_ids == ref


def test_refined_drafts_stay_lossless_greedy_and_sampled():
    """Refinement passes (GenerationConfig.refine) change what is drafted, never what is emitted: greedy
    output is AR's, and at T = 1 every strategy draws AR's tokens from the same seed."""
    target = tiny_target("qwen3", dtype=torch.float32)
    engine = Engine(target, tiny_drafter(target, block_size=8, layers=2), kernels="torch", stop_ids=set())
    prompt = [1, 2, 3, 4, 5]
    for temperature in (0.0, 1.0):
        ref = engine.run(prompt, GenerationConfig(strategy="ar", max_new_tokens=16, temperature=temperature,
                                                  seed=3)).token_ids
        for strategy in ("chain", "fixed", "bastion"):
            for refine in (1, 3, 9):  # 9 > the block's depths: as many as a draft allows
                cfg = GenerationConfig(strategy=strategy, max_new_tokens=16, temperature=temperature, seed=3,
                                       refine=refine)
                assert engine.run(prompt, cfg).token_ids == ref, (strategy, refine, temperature)
    passes, inner = [], engine.drafter._pass
    engine.drafter._pass = lambda *a, **k: passes.append(1) or inner(*a, **k)
    res = engine.run(prompt, GenerationConfig(strategy="chain", max_new_tokens=16, refine=3))
    assert len(passes) == 4 * res.steps  # the first pass and three refinements every round
    # refine=None (the default) takes the drafter's own passes (its config's refine_passes); 0 turns them off
    engine.drafter.cfg.refine_passes = 2
    passes.clear()
    res = engine.run(prompt, GenerationConfig(strategy="chain", max_new_tokens=16))
    assert len(passes) == 3 * res.steps and res.token_ids == hf_greedy(target, prompt, 16)[len(prompt):]
    passes.clear()
    res = engine.run(prompt, GenerationConfig(strategy="chain", max_new_tokens=16, refine=0))
    assert len(passes) == res.steps
    with pytest.raises(ValueError, match="refine"):
        engine.run(prompt, GenerationConfig(strategy="ar", refine=1))
    with pytest.raises(ValueError, match="refine"):
        engine.run(prompt, GenerationConfig(strategy="chain", refine=-1))


def test_stop_tokens_and_context_limit():
    target = tiny_target("llama", dtype=torch.float64, max_positions=40)
    prompt = [4, 8, 15]
    full = hf_greedy(target, prompt, 30)
    stop = full[len(prompt) + 5]
    engine = Engine(target, tiny_drafter(target), kernels="torch", stop_ids={stop})
    res = engine.run(prompt, GenerationConfig(strategy="bastion", max_new_tokens=30))
    first = full[len(prompt):].index(stop)
    assert res.token_ids == full[len(prompt):len(prompt) + first + 1] and res.finish_reason == "stop token"
    engine = Engine(target, tiny_drafter(target), kernels="torch", stop_ids=set())
    res = engine.run(prompt, GenerationConfig(strategy="bastion", max_new_tokens=100))
    assert res.finish_reason == "context limit"
    assert len(prompt) + len(res.token_ids) <= 40


def test_bad_generation_settings():
    target = tiny_target("llama")
    engine = Engine(target, tiny_drafter(target), kernels="torch", stop_ids=set())
    for kw, msg in [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1}, "temperature"),
                    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"budget": 0}, "budget"),
                    ({"strategy": "nope"}, "unknown strategy")]:
        with pytest.raises(ValueError, match=msg):
            list(engine.generate([1, 2], GenerationConfig(**kw)))
    with pytest.raises(ValueError, match="empty"):
        list(engine.generate([], GenerationConfig()))
    with pytest.raises(ValueError, match="context"):
        list(engine.generate(list(range(5)) * 200, GenerationConfig()))


def test_decode_clock_excludes_the_consumers_time():
    """Step.elapsed_s is engine time: a viewer that spends 50 ms per step must not slow the rate."""
    import time
    target = tiny_target("llama", dtype=torch.float32)
    engine = Engine(target, tiny_drafter(target), kernels="torch", stop_ids=set())
    cfg = GenerationConfig(strategy="chain", max_new_tokens=6)
    wall0 = time.perf_counter()
    steps = []
    for s in engine.generate([1, 2, 3], cfg):
        steps.append(s)
        time.sleep(0.05)
    wall = time.perf_counter() - wall0
    assert len(steps) >= 2
    assert steps[-1].elapsed_s < wall - 0.05 * (len(steps) - 1)
    assert all(b.elapsed_s >= a.elapsed_s for a, b in zip(steps, steps[1:]))


def test_draft_gate_skips_a_useless_drafter_with_backoff_and_stays_lossless():
    from bastion.draft_policy import DraftGate
    target = tiny_target("llama", dtype=torch.float64)
    engine = Engine(target, tiny_drafter(target), kernels="torch", stop_ids=set())
    frozen_latency(engine, draft_s=5e-3)  # a draft costs five plain steps: a random drafter cannot pay
    prompt = [3, 5, 7]
    ref = engine.run(prompt, GenerationConfig(strategy="ar", max_new_tokens=40)).token_ids
    steps = list(engine.generate(prompt, GenerationConfig(strategy="bastion", max_new_tokens=40)))
    assert [t for s in steps for t in s.tokens] == ref
    drafted = [bool(s.draft_ids) for s in steps]
    # draft, skip 1, draft, skip 2, draft, skip 4, draft, skip 8, draft, skip 8 ...
    expect = []
    for k in (1, 2, 4, 8, 8, 8, 8):
        expect += [True] + [False] * k
    n = len(drafted)
    assert drafted == expect[:n], drafted
    # a skipped round has no drafter nodes (a prompt-lookup branch, rank −1, may still be there)
    assert all(s.stop_reason.startswith("draft skipped") and all(r == -1 for r in s.tree.ranks[1:])
               for s in steps if not s.draft_ids)
    # switched off, every round drafts
    steps = list(engine.generate(prompt, GenerationConfig(strategy="bastion", max_new_tokens=12, skip_draft=False)))
    assert all(s.draft_ids for s in steps)
    g = DraftGate(max_skip=4)
    g.judge(2.0, 1.0)
    assert g.draft_now() and g.skip == 1


def test_draft_gate_never_skips_a_drafter_that_pays():
    target = tiny_target("llama", dtype=torch.float64)
    prompt = [3, 5, 7]
    full = hf_greedy(target, prompt, 30)
    engine = Engine(target, OracleDrafter(tiny_drafter(target), full, target.vocab_size, hit=0.95, spread=1,
                                                   sharpness=20.0),
                    kernels="torch", stop_ids=set())
    frozen_latency(engine, draft_s=2e-4)
    steps = list(engine.generate(prompt, GenerationConfig(strategy="bastion", max_new_tokens=30)))
    assert all(s.draft_ids for s in steps)
    assert [t for s in steps for t in s.tokens] == full[len(prompt):]


def test_row_padding_keeps_every_strategy_lossless():
    """Dummy rows added to reach a cheaper row count never change the output (greedy and sampled)."""
    from bastion.latency import RowPadding

    target = tiny_target("qwen3", dtype=torch.float64)
    prompt = [4, 9, 2, 7]
    full = hf_greedy(target, prompt, 20)
    drafter = OracleDrafter(tiny_drafter(target, block_size=6), full, target.vocab_size, hit=0.8, spread=2)
    engine = Engine(target, drafter, kernels="torch", stop_ids=set())
    ref = engine.run(prompt, GenerationConfig(strategy="ar", max_new_tokens=20)).token_ids
    # a made-up cost table under which every tree is padded to a multiple of 8 rows
    engine.padding = RowPadding.from_times([1.0 + 0.1 * (n % 8) for n in range(1, 49)], 0.0, max_extra=7)
    padded_rounds = 0
    for strategy, kw in STRATS + [("ar", {})]:
        steps = list(engine.generate(prompt, GenerationConfig(strategy=strategy, max_new_tokens=20, **kw)))
        assert [t for s in steps for t in s.tokens] == ref, (strategy, kw)
        assert all(s.rows == engine.padding.rows(len(s.tree)) >= len(s.tree) for s in steps)
        padded_rounds += sum(s.rows > len(s.tree) for s in steps)
    assert padded_rounds > 40  # the padding was really exercised
    for seed in range(3):
        cfg = dict(max_new_tokens=16, temperature=1.0, seed=seed, budget=9)
        padded = engine.run(prompt, GenerationConfig(strategy="fixed", **cfg)).token_ids
        plain = engine.run(prompt, GenerationConfig(strategy="fixed", pad_rows=False, **cfg)).token_ids
        assert padded == plain == engine.run(prompt, GenerationConfig(strategy="ar", **cfg)).token_ids


def test_draft_depth_follows_the_trees_and_stays_lossless():
    from bastion.draft_policy import DraftDepth
    from bastion.tree import DraftTree

    policy = DraftDepth(15, margin=3, window=2, floor=0)
    assert policy.depth() == 15  # the full block until a tree has been seen
    shallow = DraftTree.root_only(0)
    a = shallow.add(5, 0, 0.9, 0.9, 0)
    shallow.add(6, a, 0.8, 0.7, 0)           # drafter nodes down to depth 2 ...
    node = 0
    for _ in range(9):                        # ... and a copied chain (rank -1) down to depth 9
        node = shallow.add(7, node, 0.5, 0.1, -1)
    policy.observe(shallow)
    assert policy.depth() == 5                # copied nodes need no drafted depths
    deep = DraftTree.root_only(0)
    node = 0
    for _ in range(5):
        node = deep.add(1, node, 0.9, 0.5, 0)
    policy.observe(deep)
    assert policy.depth() == 8                # a tree at the cap raises the next one
    policy.observe(DraftTree.root_only(0))
    policy.observe(DraftTree.root_only(0))
    assert policy.depth() == 3                # the window forgot the deep tree
    policy.floor = 6
    assert policy.depth() == 6                # never below the floor
    # the candidates kept per depth: the cap until a tree was seen, then twice the largest recent
    # tree's drafter nodes (copied nodes not counted), never below min_width
    width = DraftDepth(15, window=2, min_width=4)
    assert width.width(128) == 128
    width.observe(shallow)
    assert width.width(128) == 4              # 2 drafter nodes (and 9 copied ones)
    width.observe(deep)
    assert width.width(128) == 10 and width.width(6) == 6
    width.observe(shallow)
    width.observe(shallow)
    assert width.width(128) == 4              # the window forgot the deep tree
    assert DraftDepth(15, window=0).width(32) == 32  # a fixed policy keeps the cap

    target = tiny_target("llama", dtype=torch.float64)
    prompt = [3, 5, 7]
    full = hf_greedy(target, prompt, 40)
    drafter = OracleDrafter(tiny_drafter(target, block_size=16), full, target.vocab_size, hit=0.3, spread=2)
    engine = Engine(target, drafter, kernels="torch", stop_ids=set())
    ref = full[len(prompt):]
    steps = list(engine.generate(prompt, GenerationConfig(strategy="bastion", max_new_tokens=40, skip_draft=False)))
    assert [t for s in steps for t in s.tokens] == ref
    expect, seen = 15, []
    for s in steps:
        assert len(s.draft_logq) == expect, ([len(x.draft_logq) for x in steps], seen)
        assert (f"drafted {expect} of 15 depths" in s.stop_reason) == (expect < 15)  # shown in the app
        seen.append(max((d for d, r in zip(s.tree.depths[1:], s.tree.ranks[1:]) if r >= 0), default=0))
        expect = min(15, max(8, max(seen[-8:]) + 3))
    assert min(len(s.draft_logq) for s in steps) < 15  # the depth really adapted
    for strategy, kw, depth in (("fixed", {"budget": 4}, 4), ("chain", {}, 15),
                                ("bastion", {"adaptive_depth": False, "skip_draft": False}, 15)):
        steps = list(engine.generate(prompt, GenerationConfig(strategy=strategy, max_new_tokens=40, **kw)))
        assert [t for s in steps for t in s.tokens] == ref, strategy
        assert all(len(s.draft_logq) == depth for s in steps if s.draft_ids), strategy


def test_engine_freezes_the_loaded_heap_out_of_the_collector():
    import gc

    target = tiny_target("llama", dtype=torch.float64)
    gc.unfreeze()
    Engine(target, None, kernels="torch", stop_ids=set(), freeze=False)
    assert gc.get_freeze_count() == 0
    engine = Engine(target, None, kernels="torch", stop_ids=set())
    assert gc.get_freeze_count() > 0  # the model's objects no longer scanned by full collections
    prompt = [3, 5, 7]
    assert engine.run(prompt, GenerationConfig(strategy="ar", max_new_tokens=6)).token_ids == \
        hf_greedy(target, prompt, 6)[len(prompt):]
