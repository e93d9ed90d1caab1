"""The teacher-forced held-out evaluation agrees with what the engine does."""

import pytest
import torch

from bastion.engine import Engine, GenerationConfig
from bastion.heldout import chain_lengths, evaluate
from bastion.simulate import lookup_lengths, simulate_tau
from tiny import tiny_drafter, tiny_target


def test_simulated_tau_counts_rounds_like_a_decoder():
    assert simulate_tau([0, 0, 0]) == (3, 3)
    assert simulate_tau([2, 9, 9, 0, 1, 5]) == (6, 3)  # rounds at anchors 0 (3 tokens), 3 (1), 4 (2)
    assert simulate_tau([]) == (0, 0)


def test_lookup_lengths_see_only_the_past():
    rec = {"ids": [1, 2, 3, 1, 2, 3, 1, 2, 4], "prompt_len": 3}
    # anchor 2 (token 3): no earlier "3" → 0; anchor 3 (token 1): the earlier "1" was followed by "2 3 1",
    # exactly what comes next
    assert lookup_lengths(rec, max_ngram=3, max_tokens=3)[:2] == [0, 3]


def test_teacher_forced_chain_equals_the_engines_chain_rounds():
    target = tiny_target("llama", dtype=torch.float64)
    drafter = tiny_drafter(target, block_size=6)
    prompt = [3, 5, 7, 11]
    engine = Engine(target, drafter, kernels="torch", stop_ids=set())
    steps = list(engine.generate(prompt, GenerationConfig(strategy="chain", max_new_tokens=40)))
    ids = prompt + [t for s in steps for t in s.tokens]
    target.set_feature_layers(drafter.cfg.target_layer_ids)
    feats = target.batch_features(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
    rec = {"category": "x", "ids": ids, "prompt_len": len(prompt), "feats": feats}
    lengths, hits = chain_lengths(drafter, target, rec)
    assert len(lengths) == len(ids) - len(prompt)
    for s in steps[:-1]:  # the last round may be cut by max_new_tokens
        a = s.context_len - 1  # the root's position
        assert lengths[a - (len(prompt) - 1)] == len(s.accepted) - 1, s.index
    tokens, rounds = simulate_tau(lengths)
    assert rounds == len(steps) or abs(rounds - len(steps)) <= 1
    res = evaluate(drafter, target, [rec], depths=3)
    assert set(res) == {"x", "all"} and len(res["all"]["acc"]) == 3
    assert res["all"]["tau"]["both"] >= max(res["all"]["tau"]["chain"], res["all"]["tau"]["lookup"]) - 1e-9
    assert set(res["all"]["tau"]) == {"chain", "lookup", "both"}
    from bastion.datastore import Datastore

    ds = Datastore.from_sequences([ids[2:]], target.vocab_size)  # knows this very reply
    res = evaluate(drafter, target, [rec], depths=3, datastore=ds)
    tau = res["all"]["tau"]
    assert tau["datastore"] > tau["chain"] + 0.5 and tau["all"] >= max(tau["both"], tau["datastore"]) - 1e-9


def test_teacher_forced_refined_drafts_equal_the_engines_refined_chain_rounds():
    """heldout.scan(refine=r) drafts at every anchor what a chain round with GenerationConfig.refine = r
    drafts there: the same tokens at every depth (and r = 0 differs: the passes are not idle)."""
    from bastion.heldout import scan

    target = tiny_target("llama", dtype=torch.float64)
    drafter = tiny_drafter(target, block_size=6)
    prompt = [3, 5, 7, 11]
    engine = Engine(target, drafter, kernels="torch", stop_ids=set())
    steps = list(engine.generate(prompt, GenerationConfig(strategy="chain", max_new_tokens=30, refine=2)))
    ids = prompt + [t for s in steps for t in s.tokens]
    target.set_feature_layers(drafter.cfg.target_layer_ids)
    feats = target.batch_features(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
    rec = {"category": "x", "ids": ids, "prompt_len": len(prompt), "feats": feats}
    _, _, refined = scan(drafter, target, rec, k=1, refine=2)
    _, _, plain = scan(drafter, target, rec, k=1)
    changed = 0
    for s in steps:
        at = s.context_len - 1 - (len(prompt) - 1)  # the root's anchor index
        engine_tokens = [row[0] for row in s.draft_ids]
        assert [row[0] for row in refined[at][1]][:len(engine_tokens)] == engine_tokens, s.index
        changed += [row[0] for row in plain[at][1]][:len(engine_tokens)] != engine_tokens
    assert changed > 0


def test_datastore_lengths_count_matching_proposed_tokens():
    from bastion.datastore import Datastore
    from bastion.simulate import datastore_lengths

    rec = {"ids": [9, 9, 1, 2, 3, 4, 8], "prompt_len": 3}
    ds = Datastore.from_sequences([[0, 1, 2, 3, 4, 5]] * 2, 10, ngrams=(1,))  # twice: the walk needs agreement
    # anchor 2 (token 1): proposes 2 3 4 5, the reply goes 2 3 4 8 → 3; then 3 4 5 vs 3 4 8 → 2; ...
    assert datastore_lengths(rec, ds, max_tokens=4) == [3, 2, 1, 0]


def test_a_shorter_block_scores_what_the_engine_drafts_at_that_depth():
    """chain_lengths(block=B') judges the block [token_a, MASK × (B'−1)] — what DFlashDrafter.draft
    runs at depth B'−1 (the engine's adaptive depth) — not the full block."""
    target = tiny_target("llama", dtype=torch.float64)
    drafter = tiny_drafter(target, block_size=6)
    ids = [3, 5, 7, 11, 2, 9, 4, 4, 8, 1, 6, 3]
    target.set_feature_layers(drafter.cfg.target_layer_ids)
    feats = target.batch_features(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
    rec = {"category": "x", "ids": ids, "prompt_len": 4, "feats": feats}
    _, hits = chain_lengths(drafter, target, rec, block=4)
    _, full = chain_lengths(drafter, target, rec)
    # rows end where the reply ends
    assert [len(h) for h in hits] == [min(3, len(ids) - 1 - a) for a in range(3, len(ids) - 1)]
    assert [len(h) for h in full] == [min(5, len(ids) - 1 - a) for a in range(3, len(ids) - 1)]
    for a in range(3, len(ids) - 1):
        cache = drafter.new_cache()
        drafter.extend_cache(cache, feats[:a])
        pred = drafter.draft(cache, ids[a], target.embed, target.lm_head, depth=3).argmax(-1).tolist()
        truth = ids[a + 1:a + 4]
        assert hits[a - 3] == [p == t for p, t in zip(pred, truth)], a
    res = evaluate(drafter, target, [rec], block=4)
    assert len(res["all"]["acc"]) == 3
    with pytest.raises(ValueError, match="block"):
        chain_lengths(drafter, target, rec, block=7)


def test_prompt_suites_are_checked_and_cached_replies_survive_other_feature_layers(tmp_path, monkeypatch, capsys):
    """A bad --prompts file is refused before the target loads; a cache of replies made for other
    feature layers keeps the replies (no generation) and recomputes the features, equal to fresh ones."""
    import json

    from bastion.heldout import eval_records, main, suite_items
    from bastion.loading import DEV_PROMPTS, load_target

    assert len(suite_items(DEV_PROMPTS)) == 90
    bad = tmp_path / "bad.json"
    for text, msg in [("[1, 2]", "must hold a JSON object"), ('{"chat": [""]}', "not a non-empty string"), ("{", "not valid JSON")]:
        bad.write_text(text)
        with pytest.raises(SystemExit):
            main(["--prompts", str(bad)])
        assert msg in capsys.readouterr().err
    suite = tmp_path / "two.json"
    suite.write_text(json.dumps({"_about": "test", "math": ["What is 2 + 3?"], "chat": ["Say hello."]}))
    target = load_target("embedded", torch.float32, "cpu")
    cache = tmp_path / "cache.pt"
    first = eval_records(target, [1, 10], cache, max_new_tokens=4, prompts_file=suite)
    assert [r["category"] for r in first] == ["math", "chat"] and all(len(r["ids"]) > r["prompt_len"] for r in first)

    def no_generation(*args, **kwargs):
        raise AssertionError("the cached replies should have been reused")

    monkeypatch.setattr(target.model, "generate", no_generation)
    again = eval_records(target, [1, 10, 29], cache, max_new_tokens=4, prompts_file=suite)
    target.set_feature_layers([1, 10, 29])
    for a, b in zip(first, again):
        assert a["ids"] == b["ids"] and b["feats"].shape[-1] == 3 * target.hidden_size
        fresh = target.batch_features(torch.tensor([b["ids"]]), torch.ones(1, len(b["ids"]), dtype=torch.long))[0]
        assert torch.equal(b["feats"], fresh.to(torch.float16))
        assert torch.equal(b["feats"][:, :2 * target.hidden_size], a["feats"])
    assert eval_records(target, [1, 10, 29], cache, max_new_tokens=4, prompts_file=suite)[0]["feats"].shape == \
        again[0]["feats"].shape  # read back from the cache now


def test_depth1_accuracy_by_the_targets_confidence_partitions_the_positions():
    """evaluate(by_confidence=True): every anchor falls in exactly one bin of the target's probability
    of the next token, the bins' hits add up to the depth-1 accuracy, and that probability is the
    target's own softmax at the position (checked against a forward over the prefix alone)."""
    from bastion.heldout import CONFIDENCE_EDGES, _confidence_bin, greedy_confidence

    target = tiny_target("llama", dtype=torch.float64)
    drafter = tiny_drafter(target, block_size=6)
    prompt = [3, 5, 7, 11]
    engine = Engine(target, drafter, kernels="torch", stop_ids=set())
    ids = prompt + [t for s in engine.generate(prompt, GenerationConfig(strategy="ar", max_new_tokens=30))
                    for t in s.tokens]
    target.set_feature_layers(drafter.cfg.target_layer_ids)
    feats = target.batch_features(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
    rec = {"category": "x", "ids": ids, "prompt_len": len(prompt), "feats": feats}

    conf = greedy_confidence(target, rec, drafter.cfg.target_layer_ids[-1])
    assert len(conf) == len(ids) - len(prompt) == len(chain_lengths(drafter, target, rec)[0])
    for a in (len(prompt) - 1, len(ids) - 2):  # first and last anchor
        with torch.no_grad():
            p = target.model(input_ids=torch.tensor([ids[:a + 1]])).logits[0, -1].softmax(-1)[ids[a + 1]].item()
        assert conf[a - (len(prompt) - 1)] == pytest.approx(p, rel=1e-6)  # float32 softmax
    # on a greedy reply the token that follows is the argmax: no probability of the position is higher
    with torch.no_grad():
        probs = target.model(input_ids=torch.tensor([ids])).logits[0].softmax(-1)
    assert all(c >= probs[a].max().item() * (1 - 1e-6) for a, c in zip(range(len(prompt) - 1, len(ids) - 1), conf))
    assert [_confidence_bin(x) for x in (0.0, 0.29, 0.3, 0.989, 0.99, 1.0)] == [0, 0, 1, 4, 5, 5]

    res = evaluate(drafter, target, [rec], depths=3, by_confidence=True)["all"]
    bins = res["by_confidence"]
    assert [(b["lo"], b["hi"]) for b in bins] == list(zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:]))
    assert sum(b["n"] for b in bins) == len(conf) and sum(b["share"] for b in bins) == pytest.approx(1, abs=1e-3)
    hits = sum(b["acc1"] * b["n"] for b in bins if b["n"])
    assert hits == pytest.approx(res["acc"][0] * len(conf), abs=0.01 * len(conf))
    assert "by_confidence" not in evaluate(drafter, target, [rec], depths=3)["all"]


def test_data_records_sample_training_replies_with_their_stored_features(tmp_path, capsys):
    """heldout --data: replies drawn from a training data folder, seeded and without repeats, carry the
    folder's stored features (equal to the target's own, as the shards were written); folders for other
    feature layers, without features or without meta.json are refused with the reason."""
    import json

    from bastion.heldout import data_records, evaluate, main
    from bastion.traindata import _records

    target = tiny_target("llama", dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, dtype=torch.float32)
    layers = drafter.cfg.target_layer_ids
    target.set_feature_layers(layers)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 90, (12 + i,), generator=gen).tolist() for i in range(6)]
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"layer_ids": layers, "features": True}))
    torch.save(_records(target, seqs, [3] * 6, 0), folder / "shard_00000.pt")
    recs = data_records([folder], layers, 4, seed=1)
    assert len(recs) == 4 and len({tuple(r["ids"]) for r in recs}) == 4
    assert [r["ids"] for r in recs] == [r["ids"] for r in data_records([folder], layers, 4, seed=1)]
    assert [r["ids"] for r in recs] != [r["ids"] for r in data_records([folder], layers, 4, seed=2)]
    for r in recs:
        assert r["ids"] in seqs and r["category"] == "trained" and r["prompt_len"] == 3
        fresh = target.batch_features(torch.tensor([r["ids"]]), torch.ones(1, len(r["ids"]), dtype=torch.long))[0]
        assert torch.equal(r["feats"], fresh.to(torch.float16))
    assert len(data_records([folder], layers, 100)) == 6  # a sample larger than the data: all of it
    res = evaluate(drafter, target, recs, block=4)
    assert set(res) == {"trained", "all"} and len(res["all"]["acc"]) == 3
    with pytest.raises(ValueError, match="target layers"):
        data_records([folder], [0, 1], 4)
    (folder / "meta.json").write_text(json.dumps({"layer_ids": layers, "features": False}))
    with pytest.raises(ValueError, match="token ids only"):
        data_records([folder], layers, 4)
    with pytest.raises(SystemExit):
        main(["--data", str(tmp_path / "nowhere")])
    assert "no meta.json" in capsys.readouterr().err


def test_teacher_forced_trees_equal_the_engines_fixed_rounds():
    """tree_lengths over scan's top-k lists reproduces every round of the engine's ``fixed:N`` (calibration
    off: the tree is ranked by the drafter's raw q) drafting N depths, i.e. blocks of N + 1; with a
    datastore that knows the reply, the per-parent re-weighting (cond:N) holds more of it."""
    from bastion.datastore import Datastore, NgramPrior
    from bastion.heldout import scan
    from bastion.simulate import simulations, tree_lengths

    target = tiny_target("llama", vocab=13, dtype=torch.float64)  # a small vocabulary: random trees hit
    drafter = tiny_drafter(target, block_size=6)
    prompt = [3, 5, 7, 11]
    engine = Engine(target, drafter, kernels="torch", stop_ids=set())
    cfg = GenerationConfig(strategy="fixed", budget=4, calibrate=False, pad_rows=False, max_new_tokens=40)
    steps = list(engine.generate(prompt, cfg))
    ids = prompt + [t for s in steps for t in s.tokens]
    target.set_feature_layers(drafter.cfg.target_layer_ids)
    feats = target.batch_features(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
    rec = {"category": "x", "ids": ids, "prompt_len": len(prompt), "feats": feats}
    lengths, hits, lists = scan(drafter, target, rec, k=8, block=5)
    assert (lengths, hits) == chain_lengths(drafter, target, rec, block=5)
    assert len(lists) == len(lengths) and all(len(v) == 4 and len(v[0]) == 8 for v, _ in lists)
    got = tree_lengths(rec, lists, 4)
    checked = [(got[s.context_len - len(prompt)], len(s.accepted) - 1) for s in steps[:-1]]
    assert [g for g, _ in checked] == [e for _, e in checked]
    assert any(e > 0 for _, e in checked)  # not only rounds that accepted nothing
    assert tree_lengths(rec, lists, 1) == [min(c, 1) for c in lengths]  # one node: the argmax of depth 1
    ds = Datastore.from_sequences([ids[2:]], target.vocab_size)
    cond = tree_lengths(rec, lists, 4, NgramPrior(ds))
    assert sum(cond) > sum(got)
    res = evaluate(drafter, target, [rec], depths=3, block=5, trees=(2, 4), datastore=ds)
    tau = res["all"]["tau"]
    assert {"fixed:2", "fixed:4", "cond:2", "cond:4", "all:2", "all:4"} <= set(tau)
    assert tau["fixed:4"] == round(simulate_tau(got)[0] / simulate_tau(got)[1], 3)
    sims = simulations(rec, lengths, lists, ds, (4,))  # all:N = the longest of the tree and both copy branches
    assert sims["all:4"] == [max(c, x, y) for c, x, y in zip(cond, sims["lookup"], sims["datastore"])]
    assert sum(sims["all:4"]) > sum(cond)  # the datastore knows the reply: its branch adds to the tree


def test_bad_tree_sizes_are_refused_before_the_target_loads(capsys):
    """heldout --trees: a size that is not a number, or outside 1–128 (the engine's largest tree), stops the
    command with the reason."""
    from bastion.heldout import main

    for arg, msg in [("4,x", "comma-separated sizes"), ("0", "must be in [1, 128]"), ("129", "must be in [1, 128]")]:
        with pytest.raises(SystemExit):
            main(["--trees", arg])
        assert msg in capsys.readouterr().err


def test_the_drafters_products_follow_the_engines_probe_or_the_mode_named():
    """``--drafter-linear auto`` (the default) scores the proposals the engine would draft on this host:
    the probe's choice of bf16 or float32 panels, timed once; a named mode is kept as named."""
    from bastion.heldout import set_products
    from bastion.kernels import cpu_native
    from bastion.probe import DRAFTER_MODES

    target = tiny_target("llama", dtype=torch.float32, seed=5)
    named = tiny_drafter(target)
    assert set_products(named, target, "native-f32").startswith("native-f32")
    assert not named.tune_products and named.products_probe is None  # named: nothing timed
    auto = tiny_drafter(target)
    chosen = set_products(auto, target, "auto")
    if cpu_native.available():
        assert chosen.split(":")[0] in DRAFTER_MODES and "chosen by" in chosen
        assert set(auto.products_probe) == set(DRAFTER_MODES)
    else:  # nothing to choose between: the drafter keeps its default
        assert auto.products_probe is None
