"""The drafter's inference layers on a CPU, without torch modules around the native kernels.

What ``target_lean.lean_forward`` is for the target: :meth:`DFlashDrafter.draft` calls
:func:`lean_layers` for a CPU float32 drafter whose products are native (mode ``native-bf16``, its
default) when the kernel library is built. Per layer the same computation as
:meth:`DrafterLayer.step` — RMSNorm, the q/k/v products over [fresh ; block] rows, per-head q/k
RMSNorm, the rotary embedding, attention of the block over [context ; fresh ; block], o_proj and the
residual, RMSNorm, the SwiGLU MLP and the residual — with three differences in how, none in what:

* the products are :class:`cpu_native.Product` calls made once per drafter (~20 µs of module and
  check overhead saved per call, 14 calls a draft of the embedded drafter);
* the rotary embedding is :func:`cpu_rows.rope` (the bits of the module path's torch ops) and the
  attention :func:`cpu_native.attention_unchecked` (float rounding away from torch's SDPA);
* the context keys/values are written into buffers with spare rows (:class:`DrafterCache` ``kbuf`` /
  ``vbuf``) instead of concatenated: the module path copies each layer's whole context every draft.

Where the products allow (float32, widened bf16 or AVX512-BF16's bf16 pairs), :func:`lean_layers`
hands all layers to one native call instead (``kernels/cpu_decoder.py``, ``cpu_layer.c``), bit for bit
this loop.

Measured on the 2-core Zen 3 (session 32, two threads): a draft of the embedded drafter in a Bastion
round 6.3 → 5.0 ms with this loop (its two layers had taken 3.9 ms through the modules); alone, after
300 tokens, 4.0 → 3.5 ms with the one native call (bench/NOTES.md).
"""

from __future__ import annotations

import torch

from .kernels import cpu_native, cpu_rows
from .kernels.cpu_decoder import NativeDecoder
from .kernels.cpu_linear import SkinnyLinear, mode_changes

PRODUCTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIN_ROWS = 256  # the first buffer's rows; it grows by half the rows in use when full


def _modules(layer) -> list:
    a, m = layer.self_attn, layer.mlp
    return [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]


def lean_plan(drafter) -> list[tuple] | None:
    """Per layer its seven products (q, k, v, o, gate, up, down) as :class:`cpu_native.Product`, or
    None when the lean loop does not apply: not a CPU float32 drafter, the library not built, or a
    product not a native :class:`SkinnyLinear`.

    Cached on the drafter and remade when :func:`use_skinny_linear` changed a mode or a weight's
    object or in-place version moved (training steps between drafts): the products hold their own
    panels and never call the modules that would repack them."""
    w0 = drafter.fc.weight
    if w0.device.type != "cpu" or w0.dtype != torch.float32 or not cpu_native.available():
        return None
    mods = [m for layer in drafter.layers for m in _modules(layer)]
    key = (mode_changes(), tuple((id(m.weight), m.weight._version) for m in mods))
    got = drafter.__dict__.get("_lean")
    if got is not None and got[0] == key:
        return got[1]
    plan = None
    if all(type(m) is SkinnyLinear and m.native for m in mods):
        prods = [cpu_native.Product(m.panels(), m.weight.shape[0], m.bias) for m in mods]
        plan = [tuple(prods[j:j + len(PRODUCTS)]) for j in range(0, len(prods), len(PRODUCTS))]
    drafter.__dict__["_lean"] = (key, plan)
    return plan


def _fused(drafter, plan: list[tuple]) -> NativeDecoder | None:
    """The drafter's layers as one native call (kernels/cpu_decoder.py) when ``drafter.fused`` is on
    and it computes what :func:`lean_layers`' loop does (float32, widened-bf16 or AVX512-BF16 pair
    products), made once per plan; else None."""
    if not getattr(drafter, "fused", True):
        return None
    got = drafter.__dict__.get("_fused")
    if got is not None and got.current(drafter.layers, plan):
        return got
    got = None
    if NativeDecoder.qualifies(drafter.layers, plan):
        cfg = drafter.cfg
        got = NativeDecoder(drafter.layers, plan, cfg.hidden_size, cfg.num_attention_heads,
                            cfg.num_key_value_heads, cfg.head_dim)
    drafter.__dict__["_fused"] = got
    return got


def _room(cache, i: int, g: int, d: int, need: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's float32 key/value buffers [1, g, ≥ need, d] whose first ``cache.encoded`` rows are
    its context (adopted into new buffers when the cache's tensors are not views of them at row 0)."""
    n = cache.encoded
    kb, vb = (cache.kbuf[i], cache.vbuf[i]) if i < len(cache.kbuf) else (None, None)
    old_k = cache.keys[i] if cache.keys else None
    if (kb is None or kb.shape[2] < need or kb.shape[1] != g or kb.shape[3] != d
            or (n and old_k.data_ptr() != kb.data_ptr())):
        rows = max(need + need // 2, MIN_ROWS)
        kb = torch.empty(1, g, rows, d)
        vb = torch.empty(1, g, rows, d)
        if n:
            kb[:, :, :n] = old_k
            vb[:, :, :n] = cache.values[i]
        while len(cache.kbuf) <= i:
            cache.kbuf.append(None)
            cache.vbuf.append(None)
        cache.kbuf[i], cache.vbuf[i] = kb, vb
    return kb, vb


def lean_layers(drafter, plan: list[tuple], cache, x: torch.Tensor, fresh: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The final-normed hidden states [q, h] of block embeddings x [q, h] (float32).

    ``fresh`` [m, h]: normalised context features of the m tokens committed since the last draft
    (their keys/values join the context, as in :meth:`DrafterAttention.attend`), or None; cos / sin
    [m + q, d] the rotary tables of [fresh ; block]. On return the cache holds c + m context rows per
    layer (views of its buffers); the block's own rows stay in the buffers as scratch."""
    q_rows, m = x.shape[0], 0 if fresh is None else fresh.shape[0]
    c = cache.encoded
    threads = torch.get_num_threads()
    fused = _fused(drafter, plan)
    if fused is not None:  # every layer in one native call: the loop below, bit for bit
        attn = drafter.layers[0].self_attn
        bufs = [_room(cache, i, attn.n_kv, attn.head_dim, c + m + q_rows) for i in range(len(plan))]
        x = x.contiguous().clone()
        fused.run(x, [b[0] for b in bufs], [b[1] for b in bufs], c, cos, sin, None, attn.head_dim ** -0.5,
                  threads, fresh=None if fresh is None else fresh.contiguous())
        cache.keys = [kb[:, :, :c + m] for kb, _ in bufs]
        cache.values = [vb[:, :, :c + m] for _, vb in bufs]
        return cpu_rows.rms_norm(x, drafter.norm.weight, drafter.norm.variance_epsilon)
    keys, values = [], []
    for i, (layer, (qp, kp, vp, op, gp, up, dp)) in enumerate(zip(drafter.layers, plan)):
        attn = layer.self_attn
        d = attn.head_dim
        ln1 = layer.input_layernorm
        h = cpu_rows.rms_norm(x, ln1.weight, ln1.variance_epsilon)
        kin = h if fresh is None else torch.cat([fresh, h])
        qh = cpu_rows.rms_norm(qp(h, threads).view(q_rows, -1, d), attn.q_norm.weight, attn.q_norm.variance_epsilon)
        qh = cpu_rows.rope(qh, cos[m:], sin[m:])
        k = cpu_rows.rms_norm(kp(kin, threads).view(m + q_rows, -1, d), attn.k_norm.weight,
                                attn.k_norm.variance_epsilon)
        k = cpu_rows.rope(k, cos, sin)
        v = vp(kin, threads).view(m + q_rows, -1, d)
        kb, vb = _room(cache, i, k.shape[1], d, c + m + q_rows)
        kb[0, :, c:c + m + q_rows] = k.transpose(0, 1)
        vb[0, :, c:c + m + q_rows] = v.transpose(0, 1)
        a = cpu_native.attention_unchecked(qh.transpose(0, 1)[None], kb[:, :, :c + m + q_rows],
                                           vb[:, :, :c + m + q_rows], None, d ** -0.5)
        x = x + op(a.view(q_rows, -1), threads)
        ln2 = layer.post_attention_layernorm
        h = cpu_rows.rms_norm(x, ln2.weight, ln2.variance_epsilon)
        x = x + dp(cpu_rows.silu(gp(h, threads)) * up(h, threads), threads)
        keys.append(kb[:, :, :c + m])
        values.append(vb[:, :, :c + m])
    cache.keys, cache.values = keys, values
    return cpu_rows.rms_norm(x, drafter.norm.weight, drafter.norm.variance_epsilon)
