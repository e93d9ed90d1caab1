"""The target's own decoder loop on a CPU: ``Target.forward_tree`` without transformers' forward.

For a CPU float32 Llama or Qwen3 target whose attention runs in the native kernel
(:func:`lean_qualifies`), :func:`lean_forward` runs the same operations in the same order on the same
weights as transformers' forward — so the logits and feature states are bit-identical (tests) — with
the products called as pre-checked native calls (:func:`lean_plan`) and, where that computes the same,
all layers as one native call (:func:`fused_decoder`, ``kernels/cpu_decoder.py``). The state these
functions keep lives on the :class:`~bastion.target.Target` (``lean``, ``fused``, ``_plan``,
``_fused``), so a target is switched and inspected in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .kernels import cpu_native, cpu_rows
from .kernels.cpu_attention import NATIVE_NAME
from .kernels.cpu_decoder import NativeDecoder
from .kernels.cpu_linear import SkinnyLinear, mode_changes
from .kvcache import GrowingLayer

if TYPE_CHECKING:
    from .target import Target


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Llama/Qwen3 RMSNorm module's output: its native forward when set (:func:`use_native_modules`),
    else ``F.rms_norm`` (one op instead of the module's six; bit-identical in float32, which the
    lean-forward tests check against the module on both families)."""
    own = norm.__dict__.get("forward")
    if own is not None:
        return own(x)
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


LEAN_LAYERS = ("LlamaDecoderLayer", "Qwen3DecoderLayer")  # decoder layers the loop reproduces


def decoder_qualifies(model) -> bool:
    """Whether a loop over ``model``'s own modules reproduces its decoder: a Llama or Qwen3 decoder
    (every layer full attention, SiLU MLP) with its embedding, final norm and rotary embedding
    (:func:`lean_qualifies` here, ``batchgen.qualifies`` for training data)."""
    dec, cfg = model.get_decoder(), model.config
    layers = getattr(dec, "layers", None)
    if (getattr(cfg, "hidden_act", None) != "silu" or layers is None
            or not all(hasattr(dec, a) for a in ("embed_tokens", "norm", "rotary_emb"))
            or any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or []))):
        return False
    return all(type(layer).__name__ in LEAN_LAYERS
               and getattr(layer.self_attn, "sliding_window", None) is None for layer in layers)


def lean_qualifies(target: Target) -> bool:
    """Whether :func:`lean_forward` computes exactly what transformers' forward does here: a CPU
    float32 decoder the loop reproduces (:func:`decoder_qualifies`) whose attention already runs in
    the native kernel (the cache's layers are updated as transformers' attention does)."""
    return (target.device.type == "cpu" and target.dtype == torch.float32 and cpu_native.available()
            and getattr(target.config, "_attn_implementation", None) == NATIVE_NAME
            and decoder_qualifies(target.model))


def lean_plan(target: Target, layers) -> list[tuple] | None:
    """Per decoder layer its seven products (q, k, v, o, gate, up, down) as pre-checked native calls
    (:class:`cpu_native.Product`), or None when any of them is not a float32 native
    :class:`SkinnyLinear` (the loop then calls the modules).

    Made once and remade after :func:`use_skinny_linear` changed any mode, or when a product's
    module left the native mode or its weight object or version changed — checked every forward
    (~60 µs for the embedded target's 210), because the plan holds its own panels and never calls
    the modules that would repack them. The modules themselves are those of the first call: a model
    whose linear modules are replaced after that keeps the old products."""
    got = target._plan
    if got is not None and got[0] is layers and got[1] == mode_changes():
        _, _, mods, weights, versions, plan = got
        if plan is None:  # the modules run, and repack themselves when their weights change
            return None
        if (all(m.__class__ is SkinnyLinear and m.native and not m.low_precision and m._parameters["weight"] is w
                for m, w in zip(mods, weights)) and [w._version for w in weights] == versions):
            return plan
    mods = [m for layer in layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                            layer.self_attn.v_proj, layer.self_attn.o_proj,
                                            layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    weights = [m._parameters["weight"] for m in mods]
    plan = None
    if all(type(m) is SkinnyLinear and m.native and not m.low_precision for m in mods):
        prods = [cpu_native.Product(m.panels(), m.weight.shape[0], m.bias) for m in mods]
        if all(p.panels.dtype in (torch.float32, torch.uint8, torch.int8) for p in prods):  # not bf16
            plan = [tuple(prods[j:j + 7]) for j in range(0, len(prods), 7)]
    target._plan = (layers, mode_changes(), mods, weights, [w._version for w in weights], plan)
    return plan


def fused_decoder(target: Target, layers, plan: list[tuple] | None) -> NativeDecoder | None:
    """The layers as one native call (:class:`NativeDecoder`, made once per plan and checked every
    forward, ~30 µs) when ``fused`` is on, it computes what the loop would
    (:meth:`NativeDecoder.qualifies`) and the cache's layers append in place; else None."""
    if not target.fused or plan is None:
        return None
    if any(type(c) is not GrowingLayer or not c.is_initialized or not (c.in_buffers() or c.keys.dim() == 4)
           for c in target.cache.layers):
        return None
    if target._fused is not None and target._fused.current(layers, plan):
        return target._fused
    target._fused = None
    if NativeDecoder.qualifies(layers, plan):
        attn, cfg = layers[0].self_attn, target.config
        target._fused = NativeDecoder(layers, plan, cfg.hidden_size, cfg.num_attention_heads,
                                    getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                                    attn.head_dim)
    return target._fused


def lean_forward(target: Target, tokens: torch.Tensor, mask: torch.Tensor,
                 position_ids: torch.Tensor) -> torch.Tensor:
    """Logits [n, V] of ``Target.forward_tree`` through the decoder's own modules without transformers'
    forward around them; the feature layers' states go to ``target._captured`` as the hooks would put them.

    The same operations in the same order on the same weights — embedding; per layer RMSNorm, the
    q/k/v projections (Qwen3: per-head q/k RMSNorm), rotary embedding, the cache update, the native
    attention, o_proj and the residual, RMSNorm, the SwiGLU MLP and the residual; the final norm and
    the LM head — so logits and captured features are bit-identical to the full forward (tests).
    What it drops is the machinery around them: module hooks and call dispatch, attention-interface
    and mask bookkeeping, ~3 ms of a 43–45 ms one-row step of the embedded target on a 2-core CPU;
    then (session 22) the products' own wrappers (:func:`lean_plan`, ~5 ms more) and the rotary
    embedding's fourteen torch ops a layer (:func:`cpu_rows.rope`, the same bits); the norms and
    the activation are the modules' own, native in this loop and in transformers' forward alike
    (``kernels/cpu_modules.py``). Feature layers are captured directly (hooks do not fire here).
    Since session 32 the layers run as one native call where that computes the same
    (:func:`fused_decoder`, ``kernels/cpu_layer.c``: ~5 ms of a ~17 ms one-row step on the Zen 3);
    the loop (:func:`_layer_step` per layer) stays for the rest and as its reference (``fused = False``)."""
    dec = target.model.get_decoder()
    x = dec.embed_tokens(tokens[None].to(target.device))
    cos, sin = dec.rotary_emb(x, position_ids)
    rows_cs = (cos[0].contiguous(), sin[0].contiguous()) if cos.dtype == torch.float32 and cos.shape[0] == 1 \
        else None
    wanted = set(target._feature_layers)
    plan = lean_plan(target, dec.layers)
    threads = torch.get_num_threads()
    fused = fused_decoder(target, dec.layers, plan) if rows_cs is not None else None
    if fused is not None:
        capture = dict.fromkeys(wanted)
        x = fused.forward_cache(x.contiguous(), target.cache.layers, *rows_cs, mask,
                                float(dec.layers[0].self_attn.scaling), capture, threads)
        target._captured.update(capture)
    else:
        for i, layer in enumerate(dec.layers):
            x = _layer_step(layer, target.cache.layers[i], x, None if plan is None else plan[i],
                            (cos, sin, rows_cs), mask, threads)
            if i in wanted:
                target._captured[i] = x
    return target.model.get_output_embeddings()(rms_norm(dec.norm, x))[0]


def _layer_step(layer, cache_layer, x: torch.Tensor, products: tuple | None, rotary: tuple, mask: torch.Tensor,
                threads: int) -> torch.Tensor:
    """One decoder layer of :func:`lean_forward` on x [1, n, h]: the layer's seven products from
    :func:`lean_plan` (None: its modules), ``rotary`` = (cos, sin, the one-batch rows for the native
    kernel or None); the keys and values are appended to ``cache_layer``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn, mlp = layer.self_attn, layer.mlp
    n, d = x.shape[1], attn.head_dim
    cos, sin, rows_cs = rotary
    if products is None:
        qp, kp, vp, op, gp, up, dp = (lambda t, _, m=m: m(t) for m in (
            attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    else:
        qp, kp, vp, op, gp, up, dp = products
    h = rms_norm(layer.input_layernorm, x).view(n, -1)
    q = qp(h, threads).view(n, -1, d)
    k = kp(h, threads).view(n, -1, d)
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotary embedding
        q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
    if rows_cs is not None:  # transformers' rotary embedding, bit for bit, in one native call each
        q = cpu_rows.rope(q, *rows_cs)[None].transpose(1, 2)
        k = cpu_rows.rope(k, *rows_cs)[None].transpose(1, 2)
    else:
        q, k = apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2), cos, sin)
    v = vp(h, threads).view(1, n, -1, d).transpose(1, 2)
    k, v = cache_layer.update(k, v)
    a = cpu_native.attention_unchecked(q, k, v, mask, float(attn.scaling))
    x = x + op(a.view(n, -1), threads).view(1, n, -1)
    h = rms_norm(layer.post_attention_layernorm, x).view(n, -1)
    return x + dp(mlp.act_fn(gp(h, threads)) * up(h, threads), threads).view(1, n, -1)
