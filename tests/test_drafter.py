"""Drafter: DFlash-layout save/load, compatibility errors, and a short training run."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from bastion.drafter_io import load_drafter, save_drafter
from bastion.engine import Engine, GenerationConfig
from bastion.distill import make_batch, train_step
from bastion.drafter_ops import new_drafter, request_vocab
from tiny import tiny_drafter, tiny_target


def load_for(target, folder, **kw):
    return load_drafter(folder, target.hidden_size, target.vocab_size, target.num_layers, dtype=target.dtype, **kw)


def test_save_load_round_trip_is_exact(tmp_path):
    target = tiny_target("qwen3", dtype=torch.float32)
    d = tiny_drafter(target, layers=2)
    save_drafter(d, tmp_path / "d")
    back = load_for(target, tmp_path / "d")
    for (k, v), (k2, v2) in zip(d.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    cache_a, cache_b = d.new_cache(), back.new_cache()
    feats = torch.randn(5, 2 * target.hidden_size)
    d.extend_cache(cache_a, feats)
    back.extend_cache(cache_b, feats)
    assert torch.equal(d.draft(cache_a, 3, target.embed, target.lm_head), back.draft(cache_b, 3, target.embed, target.lm_head))
    # the refinement passes a drafter ships with (a Bastion key; absent, as in published checkpoints: 0)
    assert "refine_passes" not in json.loads((tmp_path / "d" / "config.json").read_text())
    assert back.cfg.refine_passes == 0
    d.cfg.refine_passes = 2
    save_drafter(d, tmp_path / "d2")
    assert json.loads((tmp_path / "d2" / "config.json").read_text())["refine_passes"] == 2
    assert load_for(target, tmp_path / "d2").cfg.refine_passes == 2


def test_a_failed_save_leaves_the_old_folder_and_no_leftovers(tmp_path, monkeypatch):
    """save_drafter writes into a temporary sibling (bastion.files.staged_folder) and renames it into
    place: a save that fails half-way leaves the folder it would have replaced as it was."""
    import safetensors.torch

    target = tiny_target("qwen3", dtype=torch.float32)
    old, new = tiny_drafter(target, seed=1), tiny_drafter(target, seed=2)
    save_drafter(old, tmp_path / "d")
    before = load_file(str(tmp_path / "d" / "model.safetensors"))

    def broken(state, path, metadata=None):
        open(path, "wb").write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_drafter(new, tmp_path / "d")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temporary folder left
    after = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    save_drafter(new, tmp_path / "d")  # a save that completes replaces it
    assert not torch.equal(load_file(str(tmp_path / "d" / "model.safetensors"))["fc.weight"], before["fc.weight"])


def test_published_layout_names_and_config(tmp_path):
    target = tiny_target("qwen3", dtype=torch.float32)
    save_drafter(tiny_drafter(target, layers=2), tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["block_size"] == 6 and cfg["num_target_layers"] == target.num_layers
    assert set(cfg["dflash_config"]) == {"target_layer_ids", "mask_token_id"}
    names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    for n in ("fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_proj.weight",
              "layers.0.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight", "layers.0.post_attention_layernorm.weight"):
        assert n in names


def test_dflash_checkpoint_layout_runs_all_strategies(tmp_path):
    """A folder written the way z-lab's checkpoints are (model. prefix tolerated, extra config keys)."""
    target = tiny_target("qwen3", dtype=torch.float32)
    d = tiny_drafter(target, layers=2, block_size=8)
    folder = tmp_path / "z-lab-style"
    folder.mkdir()
    cfg = d.cfg.to_hf_dict()
    cfg.update(torch_dtype="bfloat16", transformers_version="4.57.0", auto_map={"AutoModel": "dflash.DFlashDraftModel"})
    (folder / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in d.state_dict().items() if not k.startswith("rotary.")},
              str(folder / "model.safetensors"))
    loaded = load_for(target, folder)
    engine = Engine(target, loaded, kernels="torch", stop_ids=set())
    ref = engine.run([5, 6, 7], GenerationConfig(strategy="ar", max_new_tokens=12)).token_ids
    for s in ("chain", "fixed", "bastion"):
        assert engine.run([5, 6, 7], GenerationConfig(strategy=s, max_new_tokens=12)).token_ids == ref


@pytest.mark.parametrize("field,value,msg", [
    ("hidden_size", 48, "hidden_size"), ("vocab_size", 1000, "vocab"), ("target_layer_ids", [0, 99], "out of range"),
    ("mask_token_id", 10**6, "mask_token_id"), ("refine_passes", 99, "refine_passes")])
def test_mismatched_config_is_named(tmp_path, field, value, msg):
    target = tiny_target("qwen3", dtype=torch.float32)
    save_drafter(tiny_drafter(target), tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    if field in ("target_layer_ids", "mask_token_id"):
        cfg["dflash_config"][field] = value
    else:
        cfg[field] = value
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=msg):
        load_for(target, tmp_path / "d")


def test_missing_and_corrupt_files(tmp_path):
    target = tiny_target("qwen3", dtype=torch.float32)
    with pytest.raises(FileNotFoundError):
        load_for(target, tmp_path / "nothing-here", local_files_only=True)
    save_drafter(tiny_drafter(target), tmp_path / "d")
    (tmp_path / "d" / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="safetensors"):
        load_for(target, tmp_path / "d")
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_for(target, tmp_path / "d")


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_short_training_run_lowers_loss(draft_vocab):
    torch.manual_seed(0)
    target = tiny_target("llama", vocab=50, dtype=torch.float32, layers=4)
    target.set_feature_layers([1, 2])
    rng = random.Random(0)
    seqs = []
    for _ in range(16):  # the target's own greedy continuations
        prompt = [rng.randrange(49) for _ in range(4)]
        out = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        seqs.append((out[0].tolist(), len(prompt)))
    records = []
    for ids, plen in seqs:
        t = torch.tensor([ids])
        feats = target.batch_features(t, torch.ones_like(t))[0]
        records.append({"ids": torch.tensor(ids, dtype=torch.int32), "prompt_len": plen, "feats": feats.clone()})
    for p in target.model.parameters():
        p.requires_grad_(False)
    drafter = new_drafter(target, layers=1, layer_ids=[1, 2], block_size=4, mask_token_id=49)
    if draft_vocab:  # the 40 most frequent ids: labels outside it give no loss and count as misses
        from bastion.drafter_ops import build_draft_vocab
        drafter.set_draft_vocab(build_draft_vocab(records, 40, target.vocab_size))
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for step in range(60):
        batch = make_batch(records, 4, 4, 4, 49, rng)
        loss, acc, _ = train_step(drafter, target, batch, gamma=5.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:5]) / 5, losses[:5] + losses[-10:]


def test_grow_drafter_adds_layers_that_change_nothing_until_trained():
    """fit --init D --layers N: the grown drafter computes exactly what D computed (the new layers'
    o_proj and down_proj start at zero), keeps D's weights and draft vocabulary, and its new layers
    receive gradients; it is never shrunk."""
    from bastion.drafter_ops import grow_drafter

    target = tiny_target("qwen3", dtype=torch.float32)
    d = new_drafter(target, layers=1, layer_ids=[1, 2], block_size=4, mask_token_id=49)
    torch.manual_seed(0)
    with torch.no_grad():  # not the target's layers any more: a trained drafter
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    d.set_draft_vocab(torch.arange(0, target.vocab_size, 3))
    g = grow_drafter(d, target, 3)
    assert g.cfg.num_hidden_layers == 3 and d.cfg.num_hidden_layers == 1 and len(g.layers) == 3
    assert torch.equal(g.draft_vocab, d.draft_vocab)
    for k, v in d.state_dict().items():
        assert torch.equal(g.state_dict()[k], v), k
    feats, ctx_pos = torch.randn(1, 5, 2 * target.hidden_size), torch.arange(5)[None]
    block, pos = torch.randn(1, 4, target.hidden_size), torch.arange(5, 9)[None]
    want = d.blocks(block, pos, d.context_kv(feats, ctx_pos))
    got = g.blocks(block, pos, g.context_kv(feats, ctx_pos))
    assert torch.equal(got, want)
    got.square().sum().backward()
    for layer in g.layers[1:]:
        assert layer.self_attn.o_proj.weight.grad.abs().sum() > 0
        assert layer.mlp.down_proj.weight.grad.abs().sum() > 0
    assert grow_drafter(d, target, 1) is d
    with pytest.raises(ValueError, match="already has 3 layers"):
        grow_drafter(g, target, 2)
    with pytest.raises(ValueError, match="to start them from"):
        grow_drafter(d, target, 2 + target.num_layers)


# --------------------------------------------------------------------------- draft vocabulary
def test_draft_vocabulary_round_trip_and_lossless(tmp_path):
    """A drafter restricted to a subset of the vocabulary saves and loads exactly, proposes only ids
    of that subset, and every strategy still reproduces AR's greedy output."""
    target = tiny_target("qwen3", dtype=torch.float64)
    d = tiny_drafter(target, layers=2, dtype=torch.float64)
    vocab = torch.arange(3, target.vocab_size, 2)  # odd ids only
    d.set_draft_vocab(vocab)
    save_drafter(d, tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["draft_vocab_size"] == len(vocab)
    back = load_for(target, tmp_path / "d")
    assert torch.equal(back.draft_vocab, vocab) and back.draft_vocab.dtype == torch.long
    cache = back.new_cache()
    back.extend_cache(cache, torch.randn(4, 2 * target.hidden_size, dtype=torch.float64))
    logq = back.draft(cache, 3, target.embed, target.lm_head)
    assert logq.shape == (back.block_size - 1, len(vocab))
    # the columns are the head's rows of those ids, renormalised
    engine = Engine(target, back, kernels="torch", stop_ids=set())
    ref = engine.run([5, 6, 7], GenerationConfig(strategy="ar", max_new_tokens=16)).token_ids
    for s in ("chain", "fixed", "bastion"):
        steps = list(engine.generate([5, 6, 7], GenerationConfig(strategy=s, max_new_tokens=16)))
        assert [t for st in steps for t in st.tokens] == ref
        # drafts come from the draft vocabulary, widened by the prompt and by tokens already generated
        allowed = set(vocab.tolist()) | {5, 6, 7}
        for st in steps:
            assert set(st.tree.tokens[1:]) <= allowed
            allowed |= set(st.tokens)
    widened = request_vocab(engine.drafter.draft_vocab, [5, 6, 7, 9])[0]
    assert widened.tolist() == vocab.tolist() + [6]  # odd ids are already there


def test_draft_vocabulary_logits_are_the_head_rows():
    target = tiny_target("llama", dtype=torch.float64)
    h = torch.randn(3, target.hidden_size, dtype=torch.float64)
    rows = torch.tensor([7, 1, 40])
    assert torch.allclose(target.lm_head(h, rows), target.lm_head(h)[:, rows])
    rows2 = torch.tensor([2, 3])  # a new rows tensor is not served from the cached slice of the first
    assert torch.allclose(target.lm_head(h, rows2), target.lm_head(h)[:, rows2])


@pytest.mark.parametrize("bad,msg", [([1, 1, 2], "repeated"), ([0, 10**6], "outside"), ([], "non-empty")])
def test_bad_draft_vocabulary_is_refused(tmp_path, bad, msg):
    target = tiny_target("qwen3", dtype=torch.float32)
    d = tiny_drafter(target)
    with pytest.raises(ValueError, match=msg):
        d.set_draft_vocab(torch.tensor(bad, dtype=torch.long))
    d.set_draft_vocab(torch.tensor([1, 2, 3]))
    save_drafter(d, tmp_path / "d")
    from safetensors.torch import save_file
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    state["draft_vocab"] = torch.tensor([1, 2, 10**6])
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="draft vocabulary has ids outside"):
        load_for(target, tmp_path / "d")


def test_build_draft_vocab_prefers_forced_then_frequent_then_low_ids():
    from bastion.drafter_ops import build_draft_vocab
    recs = [{"ids": torch.tensor([50, 50, 50, 60, 60, 70], dtype=torch.int32), "prompt_len": 1}]
    v = build_draft_vocab(recs, 5, 97, always={96})
    assert v.tolist() == sorted([96, 50, 60, 70, 0])
    with pytest.raises(ValueError, match="draft-vocab"):
        build_draft_vocab(recs, 0, 97)


def test_live_features_equal_stored_ones_and_batch_layout():
    """A batch built from ids-only records gets the same features from the target as the stored
    ones; blocks, positions and labels follow the anchors."""
    from bastion.distill import live_features

    torch.manual_seed(0)
    target = tiny_target("llama", vocab=50, dtype=torch.float32, layers=4)
    target.set_feature_layers([1, 2])
    rng = random.Random(1)
    records = []
    for n, plen in ((9, 3), (14, 5), (6, 2)):
        ids = torch.tensor([rng.randrange(50) for _ in range(n)])
        feats = target.batch_features(ids[None], torch.ones(1, n, dtype=torch.long))[0]
        records.append({"ids": ids.to(torch.int32), "prompt_len": plen, "feats": feats.clone()})
    stored = make_batch(records, 5, 3, 4, 49, random.Random(7))
    bare = make_batch([{k: v for k, v in r.items() if k != "feats"} for r in records], 5, 3, 4, 49, random.Random(7))
    assert bare.feats is None
    live = live_features(target, bare)
    ok = stored.valid[..., None].expand_as(stored.feats)
    torch.testing.assert_close(live.feats[ok], stored.feats[ok], rtol=1e-4, atol=1e-4)
    for name in ("valid", "block_ids", "block_pos", "labels", "anchor_pos", "ids"):
        assert torch.equal(getattr(live, name), getattr(stored, name)), name
    for i in range(5):
        n = int(stored.valid[i].sum())
        seq = stored.ids[i, :n]
        for j, a in enumerate(stored.anchor_pos[i].tolist()):
            assert stored.block_ids[i, 4 * j] == seq[a] and (stored.block_ids[i, 4 * j + 1:4 * j + 4] == 49).all()
            assert stored.block_pos[i, 4 * j:4 * j + 4].tolist() == [a, a + 1, a + 2, a + 3]
            want = seq[a + 1:a + 4].tolist()
            assert stored.labels[i, 3 * j:3 * j + 3].tolist() == want + [-100] * (3 - len(want))


def _reference_draft(d, target, feats, root, revealed=()):
    """What a draft must return: the training-time forward (context_kv + blocks) over all features,
    of the block [root, *revealed, MASK, ...]."""
    n = feats.shape[0]
    ctx_kv = d.context_kv(feats[None], torch.arange(n)[None])
    ids = torch.full((1, d.block_size), d.cfg.mask_token_id)
    ids[0, :1 + len(revealed)] = torch.tensor([root, *revealed])
    hidden = d.blocks(target.embed(ids), torch.arange(n, n + d.block_size)[None], ctx_kv)[0, 1:]
    return torch.log_softmax(target.lm_head(hidden).float(), dim=-1)  # a draft's log q is float32


@pytest.mark.parametrize("split", [(0, 7), (4, 3), (7, 0), (2, 1, 4)])
def test_deferred_context_equals_eager_and_training_forward(split):
    """Features queued with DrafterCache.defer and encoded inside the next draft give the draft (and
    the cache) that encoding them at once gives, which is the training forward's."""
    target = tiny_target("qwen3", dtype=torch.float64)
    d = tiny_drafter(target, layers=2)
    feats = torch.randn(sum(split), 2 * target.hidden_size, dtype=torch.float64)
    eager, lazy = d.new_cache(), d.new_cache()
    d.extend_cache(eager, feats)
    if split[0]:
        d.extend_cache(lazy, feats[:split[0]])
    start = split[0]
    for m in split[1:]:
        lazy.defer(feats[start:start + m])
        start += m
    assert lazy.length == eager.length == feats.shape[0]
    ref = _reference_draft(d, target, feats, 3)
    a = d.draft(eager, 3, target.embed, target.lm_head)
    b = d.draft(lazy, 3, target.embed, target.lm_head)
    assert torch.allclose(a, ref, atol=1e-5) and torch.allclose(b, ref, atol=1e-5)
    assert lazy.pending == [] and lazy.encoded == eager.encoded == feats.shape[0]
    for k1, k2, v1, v2 in zip(eager.keys, lazy.keys, eager.values, lazy.values):
        assert torch.allclose(k1, k2, atol=1e-12) and torch.allclose(v1, v2, atol=1e-12)
    # the next round: more features, and the cache stays consistent with the training forward
    more = torch.randn(2, 2 * target.hidden_size, dtype=torch.float64)
    lazy.defer(more)
    assert torch.allclose(d.draft(lazy, 5, target.embed, target.lm_head),
                          _reference_draft(d, target, torch.cat([feats, more]), 5), atol=1e-5)


@pytest.mark.parametrize("refine,vocab", [(1, False), (2, False), (1, True)])
def test_a_refined_draft_redrafts_the_depths_after_the_revealed_argmax(refine, vocab):
    """draft(refine=r): pass i + 1 is the training forward over the block with the argmax of depths
    1..i so far in place of their masks, and gives depths i+1..; the context is encoded once
    (pending features enter in the first pass, the cache ends as a plain draft leaves it)."""
    target = tiny_target("qwen3", dtype=torch.float64)
    d = tiny_drafter(target, layers=2)
    if vocab:
        d.set_draft_vocab(torch.arange(3, 60, 2))
    feats = torch.randn(6, 2 * target.hidden_size, dtype=torch.float64)
    plain, refined = d.new_cache(), d.new_cache()
    for c in (plain, refined):
        d.extend_cache(c, feats[:4])
        c.defer(feats[4:])
    first = d.draft(plain, 3, target.embed, target.lm_head)
    out = d.draft(refined, 3, target.embed, target.lm_head, refine=refine)
    rows = d.draft_vocab if vocab else torch.arange(target.vocab_size)
    ref = first
    for i in range(1, refine + 1):
        nxt = _reference_draft(d, target, feats, 3, rows[ref[:i].argmax(-1)].tolist())
        if vocab:
            nxt = torch.log_softmax(nxt[:, rows], -1)  # the draft vocabulary's columns, renormalised
        ref = torch.cat([ref[:i], nxt[i:]])
    assert torch.allclose(out[:1], first[:1], atol=1e-9)
    assert torch.allclose(out, ref, atol=1e-5)
    assert not torch.allclose(out[1:], first[1:], atol=1e-3)  # the revealed tokens mattered
    assert refined.pending == [] and refined.encoded == plain.encoded == 6
    for k1, k2 in zip(plain.keys, refined.keys):
        assert torch.allclose(k1, k2, atol=1e-12)
    with pytest.raises(ValueError, match="refine must be in"):
        d.draft(refined, 3, target.embed, target.lm_head, depth=2, refine=2)


def test_cache_crop_covers_pending():
    target = tiny_target("qwen3", dtype=torch.float64)
    d = tiny_drafter(target)
    feats = torch.randn(6, 2 * target.hidden_size, dtype=torch.float64)
    cache = d.new_cache()
    d.extend_cache(cache, feats[:3])
    cache.defer(feats[3:5])
    cache.defer(feats[5:])
    cache.crop(4)
    assert cache.encoded == 3 and cache.length == 4 and torch.equal(cache.pending[0], feats[3:4])
    cache.crop(2)
    assert cache.encoded == 2 and cache.length == 2 and cache.pending == []
    assert torch.allclose(d.draft(cache, 1, target.embed, target.lm_head),
                          _reference_draft(d, target, feats[:2], 1), atol=1e-5)


def test_drafts_run_in_bf16_where_the_cpu_can_and_stay_close_to_float32():
    """A drafter multiplies with bf16 weights (kernels.cpu_linear mode native-bf16: AVX512-BF16 where the
    CPU has it, widened in registers elsewhere), the draft vocabulary's head slice included; its log q
    stays within bf16 rounding of float32's."""
    from bastion.kernels import cpu_native
    from bastion.kernels.cpu_linear import use_skinny_linear

    target = tiny_target("qwen3", dtype=torch.float32)
    d = tiny_drafter(target, layers=2)
    d.set_draft_vocab(torch.arange(0, target.vocab_size, 2))
    assert d.low_precision  # the default mode of a drafter
    feats = torch.randn(6, 2 * target.hidden_size)
    runs = {}
    for mode in ("native-bf16", "native"):
        use_skinny_linear(d, mode)
        cache = d.new_cache()
        d.extend_cache(cache, feats)
        runs[mode] = d.draft(cache, 3, target.embed, target.lm_head)
        head_panels = list(target._head_slices.values())[-1][3]  # the newest slice: this draft's
        if cpu_native.available():
            want = torch.bfloat16 if mode == "native-bf16" else torch.float32  # AVX512-BF16 pairs or widened
            assert head_panels.dtype == want and d.fc.panels().dtype == want
    assert not d.low_precision
    torch.testing.assert_close(runs["native-bf16"], runs["native"], rtol=0, atol=5e-2)
    assert torch.equal(runs["native-bf16"].argmax(-1), runs["native"].argmax(-1))


def test_a_widened_vocabulary_reuses_the_drafters_head_slice_and_drafts_the_same_bits(monkeypatch):
    """The engine widens the draft vocabulary per request (the prompt's tokens, then new ones as the
    reply brings them): the drafter asks the head for [its vocabulary ; the extra rows] as two slices,
    so the big one is gathered and packed once per drafter, not per request and widening — with
    log q bit-identical to one slice over the widened rows (each column is the same dot product)."""
    import bastion.target as target_mod
    from bastion.kernels import cpu_native

    target = tiny_target("qwen3", dtype=torch.float32)
    d = tiny_drafter(target, layers=2)
    packed = []
    real_pack = target_mod.pack_for
    monkeypatch.setattr(target_mod, "pack_for", lambda w, *a: packed.append(w.shape[0]) or real_pack(w, *a))
    base = torch.arange(0, target.vocab_size - 1, 2)
    feats = torch.randn(6, 2 * target.hidden_size)

    def draft(vocab, own_vocab):
        d.set_draft_vocab(own_vocab)
        cache = d.new_cache()
        d.extend_cache(cache, feats)
        return d.draft(cache, 3, target.embed, target.lm_head, vocab)

    first = torch.cat([base, torch.tensor([5, 11, 1])])     # a request: its prompt's extra tokens
    second = torch.cat([base, torch.tensor([7, 9])])        # the next request
    wider = torch.cat([second, torch.tensor([13])])         # ... widened by a generated token
    split = [draft(v, base) for v in (first, second, wider)]
    assert [x.shape[-1] for x in split] == [len(first), len(second), len(wider)]
    if cpu_native.available():  # native panels: each slice is packed once, the vocabulary's only once
        assert packed == [len(base), 3, 2, 3], packed
    # a drafter without a vocabulary of its own asks for the same rows as one slice: the same bits
    assert all(torch.equal(draft(v, None), x) for v, x in zip((first, second, wider), split))
    reordered = torch.cat([base.flip(0), torch.tensor([5])])  # not an extension: one slice, still right
    assert torch.equal(draft(reordered, base), draft(reordered, None))


def test_the_lean_cpu_draft_equals_the_module_draft_over_rounds(monkeypatch):
    """A CPU float32 drafter with native products drafts through drafter_lean.lean_layers (pre-checked
    products, native rotary and attention, the context in buffers with spare rows; all layers in one
    native call, its inputs rounded to bf16 in C where AVX512-BF16 pairs run). Over rounds of deferred features, a crop and a buffer that
    must grow, its log q and its context keys/values are the module path's to float rounding (the
    attention kernels differ), the Python loop's bit for bit, and the buffers are reused."""
    import bastion.drafter as drafter_module
    from bastion.drafter_lean import MIN_ROWS, lean_plan
    from bastion.kernels import cpu_native

    if not cpu_native.available():
        pytest.skip(f"native kernel unavailable: {cpu_native.unavailable_reason()}")
    target = tiny_target("qwen3", dtype=torch.float32)
    d = tiny_drafter(target, layers=2)
    assert lean_plan(d) is not None and lean_plan(d) is lean_plan(d)  # made once
    assert lean_plan(tiny_drafter(tiny_target("qwen3", dtype=torch.float64), layers=2)) is None
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(MIN_ROWS + 60, 2 * target.hidden_size, generator=g)
    lean, mods, loop = d.new_cache(), d.new_cache(), d.new_cache()
    for c in (lean, mods, loop):
        d.extend_cache(c, feats[:40])
    pos, buffers = 40, []
    # (≤ 64 new rows a round, as in decoding: past that the modules' products run in float32)
    for r, step in enumerate([0, 1, 3, 2, -3, 1] + [50] * 5 + [2, 4]):
        a = d.draft(lean, r % 7, target.embed, target.lm_head, depth=4)
        with monkeypatch.context() as m:
            m.setattr(drafter_module, "lean_plan", lambda drafter: None)
            b = d.draft(mods, r % 7, target.embed, target.lm_head, depth=4)
        d.fused = False  # the lean loop in Python: the one native call's bits exactly
        assert torch.equal(d.draft(loop, r % 7, target.embed, target.lm_head, depth=4), a)
        d.fused = True
        assert d.__dict__.get("_fused") is not None  # float32, widened-bf16 and bf16-pair products alike
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert lean.encoded == mods.encoded == pos
        for k1, k2, v1, v2 in zip(lean.keys, mods.keys, lean.values, mods.values):
            torch.testing.assert_close(k1, k2, rtol=0, atol=1e-5)
            torch.testing.assert_close(v1, v2, rtol=0, atol=1e-5)
        assert all(k.data_ptr() == buf.data_ptr() for k, buf in zip(lean.keys, lean.kbuf))  # views, no copies
        buffers.append((lean.kbuf[0].data_ptr(), lean.kbuf[0].shape[2]))
        for k1, k2 in zip(lean.keys + lean.values, loop.keys + loop.values):
            assert torch.equal(k1, k2)
        if step < 0:  # a crop (the context shrinks), then the next round re-encodes nothing
            pos += step
            for c in (lean, mods, loop):
                c.crop(pos)
        elif step:
            for c in (lean, mods, loop):
                c.defer(feats[pos:pos + step])
            pos += step
    assert buffers[0] == buffers[5] and buffers[0][1] == MIN_ROWS  # one buffer until it had to grow
    assert buffers[-1][1] > MIN_ROWS and buffers[-1][0] != buffers[0][0]


def test_the_probe_keeps_the_faster_drafter_products_once_per_drafter(monkeypatch):
    """probe.tune_drafter_products times drafts in bf16 and in float32 panels and keeps the faster
    (bf16 unless float32 wins by a margin), once per drafter, without touching torch's random stream;
    a drafter whose mode a caller set is left alone. Here one mode's drafts are made 4 ms slower."""
    import time

    from bastion.kernels import cpu_native
    from bastion.kernels.cpu_linear import use_skinny_linear
    from bastion.probe import tune_drafter_products

    if not cpu_native.available():
        pytest.skip("no native kernel: nothing to choose")
    target = tiny_target("qwen3", dtype=torch.float32)
    for slow_bf16, want in ((True, "native-f32"), (False, "native-bf16")):
        d = tiny_drafter(target, layers=2)
        calls, real = [], d.draft

        def draft(*args, d=d, real=real, slow_bf16=slow_bf16, **kw):
            calls.append(d.low_precision)
            if d.low_precision == slow_bf16:
                time.sleep(4e-3)
            return real(*args, **kw)

        monkeypatch.setattr(d, "draft", draft)
        rng = torch.get_rng_state()
        assert tune_drafter_products(d, target, context=8) == want
        assert torch.equal(torch.get_rng_state(), rng)
        assert d.low_precision == (want == "native-bf16") and set(calls) == {True, False}
        slow, fast = sorted(d.products_probe.values(), reverse=True)
        assert d.products_probe[want] == fast and slow > fast + 3e-3
        n = len(calls)  # another engine on this drafter keeps the choice without timing again
        assert tune_drafter_products(d, target) == want and len(calls) == n
    d = tiny_drafter(target, layers=2)
    use_skinny_linear(d, "native-f32")
    d.tune_products = False  # as bench --drafter-linear native-f32 sets it
    monkeypatch.setattr(d, "draft", lambda *a, **k: pytest.fail("a set mode is not timed"))
    assert tune_drafter_products(d, target) is None and not d.low_precision and d.products_probe is None


def test_a_drafting_engine_chooses_its_drafters_products_and_stays_lossless():
    """Engine.prepare's probe includes the drafter's products (probe.tune_drafter_products): after a
    Bastion run the drafter holds the probe's medians and one of the two modes, and every strategy's
    greedy output is AR's."""
    from bastion.kernels import cpu_native

    target = tiny_target("qwen3", dtype=torch.float32)
    d = tiny_drafter(target, layers=2)
    engine = Engine(target, d, kernels="torch")
    prompt = [5, 17, 33, 2, 9]
    ar = engine.run(prompt, GenerationConfig(strategy="ar", max_new_tokens=20)).token_ids
    assert d.products_probe is None  # AR probes nothing
    got = engine.run(prompt, GenerationConfig(strategy="bastion", max_new_tokens=20)).token_ids
    assert got == ar
    if cpu_native.available():
        assert set(d.products_probe) == {"native-bf16", "native-f32"}
        assert all(t > 0 for t in d.products_probe.values())
        for strategy in ("chain", "fixed"):
            assert engine.run(prompt, GenerationConfig(strategy=strategy, max_new_tokens=20)).token_ids == ar
