"""The target's KV cache: rows appended in place (kvcache.GrowingLayer) instead of transformers' cat."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from bastion import target_lean
from bastion.kernels import get_kernels
from bastion.kvcache import GrowingLayer
from tiny import tiny_target


def _decode(target, steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """Logits of a fixed script: prefill, a 5-node tree whose accepted nodes are not a prefix of the
    pop order (rows moved), a chain accepted in part (rows cropped), then one-token steps. Also the
    storage of layer 0's keys after each forward (held, so that no address is reused)."""
    kernels = get_kernels("torch")
    target.prefill(torch.arange(3, 23))
    out, ptrs = [], []

    def forward(parents, tokens):
        mask, pos = kernels.tree_mask(parents, target.cache_len, target.dtype, "cpu")
        out.append(target.forward_tree(torch.tensor(tokens), mask, pos).logits)
        ptrs.append(target.cache.layers[0].keys.untyped_storage())

    prefix = target.cache_len
    forward([-1, 0, 0, 1, 2], [30, 31, 32, 33, 34])
    target.commit(prefix, [0, 2, 4])   # root, its second child, that child's child
    prefix = target.cache_len
    forward([-1, 0, 1], [40, 41, 42])
    target.commit(prefix, [0, 1])      # the last node dropped
    for i in range(steps):
        prefix = target.cache_len
        forward([-1], [50 + i])
        target.commit(prefix, [0])
    return out, ptrs


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_growing_cache_gives_the_logits_of_transformers_cache(family, monkeypatch):
    """Bit for bit the logits of transformers' DynamicCache, across row moves, crops and several
    regrowths of the buffers (a small first allocation forces them); and appending does not copy the
    cache on every forward: between regrowths the keys stay views of one buffer."""
    monkeypatch.setattr(GrowingLayer, "min_rows", 8)
    target = tiny_target(family, dtype=torch.float32)
    grown, storages = _decode(target, steps=40)
    ptrs = [s.data_ptr() for s in storages]
    assert all(type(layer) is GrowingLayer for layer in target.cache.layers)
    assert target.cache_len == 20 + 3 + 2 + 40  # the rows each commit kept
    # 8 rows, then ×1.5 as needed: a handful of buffers for 64 rows, not one per forward
    assert 2 <= len(set(ptrs)) <= 8, ptrs
    layer = target.cache.layers[0]
    assert layer.keys.data_ptr() == layer._kbuf.data_ptr() and layer._kbuf.shape[2] >= layer.keys.shape[2]

    monkeypatch.setattr(target, "reset", lambda: setattr(target, "cache", DynamicCache(config=target.config)))
    stock, storages = _decode(target, steps=40)
    assert len({s.data_ptr() for s in storages}) == len(storages)  # the stock layer: a new tensor every forward
    assert len(grown) == len(stock)
    for i, (a, b) in enumerate(zip(grown, stock)):
        assert torch.equal(a, b), i


def test_growing_layer_adopts_keys_set_from_outside():
    """A layer whose keys were replaced (not views of its buffer) copies them in before appending."""
    layer = GrowingLayer()
    k = torch.randn(1, 2, 3, 4)
    layer.update(k, k + 1)
    layer.keys, layer.values = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    before = layer.keys.clone()
    new = torch.randn(1, 2, 1, 4)
    keys, values = layer.update(new, new)
    assert torch.equal(keys[:, :, :5], before) and torch.equal(keys[:, :, 5:], new)
    assert keys.shape[2] == values.shape[2] == 6


def test_growing_layer_counts_rows_without_views_and_slices_them_when_read():
    """reserve / advance / crop move only the row count; keys and values, when read, are the buffers'
    first rows; a value assigned from outside replaces both views consistently."""
    layer = GrowingLayer()
    k = torch.randn(1, 2, 3, 4)
    layer.update(k, -k)
    kb, vb = layer.reserve(2)
    assert layer.in_buffers() and kb.shape[2] >= 5
    kb[:, :, 3:5], vb[:, :, 3:5] = 7.0, -7.0
    layer.advance(2)
    assert layer._pending == 5 and layer.rows() == layer.get_seq_length() == 5  # no views made yet
    assert torch.equal(layer.keys[:, :, :3], k) and torch.equal(layer.values[:, :, 3:], torch.full((1, 2, 2, 4), -7.0))
    assert layer.keys.data_ptr() == kb.data_ptr() and layer._pending is None
    layer.crop(-4)
    assert layer.rows() == 1 and layer._pending == 1
    assert torch.equal(layer.keys, k[:, :, :1]) and torch.equal(layer.values, -k[:, :, :1])
    layer.advance(1)  # stale again; then a value set from outside: keys must not be rebuilt from the count
    layer.values = torch.zeros(1, 2, 2, 4)
    assert layer.keys.shape[2] == 2 and torch.equal(layer.keys[:, :, :1], k[:, :, :1])
    layer.keys, layer.values = torch.ones(1, 2, 6, 4), torch.ones(1, 2, 6, 4)
    assert not layer.in_buffers() and layer.rows() == 6
    keys, values = layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))  # adopted, then appended
    assert keys.shape[2] == values.shape[2] == 7 and torch.equal(keys[:, :, :6], torch.ones(1, 2, 6, 4))
    layer.reset()
    assert layer.rows() == 0 and layer.keys is None


@pytest.mark.skipif("not __import__('bastion.kernels.cpu_native', fromlist=['x']).available()",
                    reason="native kernel not built here")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lean_forward_is_bit_identical_to_transformers_forward(family, monkeypatch):
    """forward_tree's own decoder loop (CPU float32, native attention) gives the very logits and
    feature-layer states of transformers' forward, for one row and for a tree; it steps aside for
    more rows than the native attention takes, and models that do not qualify never use it."""
    target = tiny_target(family, dtype=torch.float32)
    target.set_feature_layers([1, 3])
    kernels = get_kernels("torch")
    assert target_lean.lean_qualifies(target)
    calls = []
    real = target_lean.lean_forward
    monkeypatch.setattr(target_lean, "lean_forward", lambda *a: (calls.append(1), real(*a))[1])
    for parents in ([-1], [-1, 0, 0, 1, 2], [-1] + list(range(69))):
        outs = {}
        for lean in (True, False):
            target.lean = lean
            target.prefill(torch.arange(5, 45) % 90)
            mask, pos = kernels.tree_mask(parents, target.cache_len, target.dtype, "cpu")
            outs[lean] = target.forward_tree((torch.arange(len(parents)) * 7 + 3) % 90, mask, pos)
            target.commit(target.cache_len - len(parents), [])
        assert torch.equal(outs[True].logits, outs[False].logits), parents
        assert torch.equal(outs[True].features, outs[False].features), parents
    assert len(calls) == 2  # the 70-row tree went through transformers' forward
    assert not target_lean.lean_qualifies(tiny_target(family, dtype=torch.float64))  # not float32


@pytest.mark.skipif("not __import__('bastion.kernels.cpu_native', fromlist=['x']).available()",
                    reason="native kernel not built here")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_decoder_gives_the_python_loops_bits_step_after_step(family):
    """The lean loop's layers as one native call (kernels/cpu_decoder.py, cpu_layer.c) give the Python
    loop's logits, feature-layer states and cache rows bit for bit, over 60 rounds of trees with
    hidden keys and one-row steps, commits that move rows, and cache buffers growing past their
    first 256 rows; without native norms it steps aside."""
    from bastion.kernels.cpu_modules import use_native_modules

    kernels = get_kernels("torch")
    runs = {}
    for fused in (True, False):
        target = tiny_target(family, dtype=torch.float32)
        target.set_feature_layers([0, 2])
        target.fused = fused
        target.prefill(torch.arange(220) % 90)
        g = torch.Generator().manual_seed(0)
        outs = []
        for step in range(60):
            parents = [-1, 0, 0, 1, 2, 2] if step % 3 == 0 else [-1]
            mask, pos = kernels.tree_mask(parents, target.cache_len, torch.float32, "cpu")
            out = target.forward_tree(torch.randint(0, 90, (len(parents),), generator=g), mask, pos)
            outs.append((out.logits, out.features))
            target.commit(target.cache_len - len(parents), [0, 2, 4] if len(parents) > 1 else [0])
        assert (target._fused is not None) == fused  # the native decoder ran, or the loop did
        runs[fused] = (outs, [(c.keys.clone(), c.values.clone()) for c in target.cache.layers], target.cache_len)
    (a, ca, na), (b, cb, nb) = runs[True], runs[False]
    assert na == nb == 220 + 20 * 3 + 40 and na > 256  # the buffers grew
    for (la, fa), (lb, fb) in zip(a, b):
        assert torch.equal(la, lb) and torch.equal(fa, fb)
    for (ka, va), (kb, vb) in zip(ca, cb):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    # a norm weight replaced (a new tensor) must reach the native decoder's next call
    def step():
        target.prefill(torch.arange(30) % 90)
        mask, pos = kernels.tree_mask([-1, 0], target.cache_len, torch.float32, "cpu")
        return target.forward_tree(torch.tensor([3, 4]), mask, pos).logits

    target.fused = True
    before = step()
    assert target._fused is not None
    norm = target.model.get_decoder().layers[1].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 1.5)
    outs = []
    for fused in (True, False):
        target.fused = fused
        outs.append(step())
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], before)
    use_native_modules(target.model, False)
    target.fused = True
    plan = target_lean.lean_plan(target, target.model.get_decoder().layers)
    assert plan is not None and target_lean.fused_decoder(target, target.model.get_decoder().layers, plan) is None


@pytest.mark.skipif("not __import__('bastion.kernels.cpu_native', fromlist=['x']).available()",
                    reason="native kernel not built here")
def test_lean_products_follow_weight_and_mode_changes():
    """The lean loop calls the native products directly (``target_lean.lean_plan``), holding their panels; so a
    weight edited in place, a replaced weight and a changed linear mode must each reach its next
    forward. After each change, its logits equal transformers' forward through the modules."""
    from bastion.kernels.cpu_linear import use_skinny_linear

    target = tiny_target("llama", dtype=torch.float32)
    kernels = get_kernels("torch")
    layers = target.model.get_decoder().layers
    parents = [-1, 0, 0, 1]

    def both():
        outs = []
        for lean in (True, False):
            target.lean = lean
            target.prefill(torch.arange(5, 35) % 90)
            mask, pos = kernels.tree_mask(parents, target.cache_len, target.dtype, "cpu")
            outs.append(target.forward_tree(torch.tensor([3, 10, 17, 24]), mask, pos).logits)
        assert torch.equal(outs[0], outs[1])
        return outs[0]

    first = both()
    assert target._plan is not None and target._plan[-1] is not None  # the products ran, not the modules
    plan = target._plan[-1]
    with torch.no_grad():
        layers[1].mlp.down_proj.weight.mul_(1.5)           # in place: the version counter moves
    edited = both()
    assert not torch.equal(first, edited) and target._plan[-1] is not plan
    plan = target._plan[-1]
    q = layers[2].self_attn.q_proj
    q.weight = torch.nn.Parameter(q.weight.detach() * 0.5)  # a new weight object
    replaced = both()
    assert not torch.equal(edited, replaced) and target._plan[-1] is not plan
    use_skinny_linear(target.model, "fast")                 # products through torch's routines: no plan
    both()                                                  # (other sums, so other bits than the kernel's)
    assert target._plan[-1] is None
    use_skinny_linear(target.model, "native")
    assert torch.equal(both(), replaced) and target._plan[-1] is not None
