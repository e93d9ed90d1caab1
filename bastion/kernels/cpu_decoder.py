"""A target's decoder layers as one native call (``cpu_layer.c``), for ``Target._lean_forward``.

The Python lean loop runs each layer as ~25 calls (seven products, norms, rotary, the cache update,
the attention, residual adds, the SwiGLU product), each a few microseconds of dispatch and a tensor
allocation. :class:`NativeDecoder` hands all layers to ``bastion_decoder_f32`` at once: the same
kernels in the same order on the same inputs, so logits, captured features and cache rows are
bit-identical to the loop's (tests/test_target.py). It applies where the loop's plan does (float32
or exact compressed products, ``Target._lean_plan``) and the layers' norms and activations run
natively (``cpu_modules.use_native_modules``, the target's default); the caller keeps the loop
otherwise.
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_native

KINDS = {torch.float32: 0, torch.uint8: 1, torch.int8: 2}  # panels' dtype → the C product (cpu_layer.c)


def _native_forward(module: torch.nn.Module) -> bool:
    return "forward" in module.__dict__  # set per instance by cpu_modules.use_native_modules


class NativeDecoder:
    """Per-layer constants (panel and bias pointers, norm weights and epsilons) of a lean plan, made once;
    :meth:`__call__` runs every layer over a few rows.

    Holds the plan (its products hold their panels), so the pointers stay valid while it lives."""

    def __init__(self, layers, plan: list[tuple], hidden: int, heads: int, kv_heads: int, head_dim: int):
        prods = [p for layer_plan in plan for p in layer_plan]
        self.plan, self.layers = plan, len(plan)
        self.dims = (hidden, heads, kv_heads, head_dim, plan[0][4].n)
        n7 = 7 * self.layers
        self._kinds = (ctypes.c_int * n7)(*[KINDS[p.panels.dtype] for p in prods])
        self._panels = (ctypes.c_void_p * n7)(*[p._pp for p in prods])
        self._bias = (ctypes.c_void_p * n7)(*[p._bp for p in prods])
        norms, eps = [], []
        for layer in layers:
            attn = layer.self_attn
            mods = [layer.input_layernorm, layer.post_attention_layernorm,
                    getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
            norms += [None if m is None else m.weight.data_ptr() for m in mods]
            eps += [0.0 if m is None else float(m.variance_epsilon) for m in mods]
        self._norm_weights = [m.weight for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
        self._norms = (ctypes.c_void_p * (4 * self.layers))(*norms)
        self._eps = (ctypes.c_float * (4 * self.layers))(*eps)
        self._bufs: tuple | None = None  # (buffer pointers, their ctypes arrays)

    @staticmethod
    def qualifies(layers, plan: list[tuple] | None) -> bool:
        """Whether the native decoder computes what the lean loop computes for these layers: products
        it can run, native norms and activation in every layer."""
        if plan is None or not cpu_native.available():
            return False
        if any(p.panels.dtype not in KINDS for lp in plan for p in lp):
            return False
        for layer in layers:
            attn = layer.self_attn
            mods = [layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.act_fn]
            mods += [m for m in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if m is not None]
            if not all(_native_forward(m) for m in mods):
                return False
        return True

    def _buffers(self, cache_layers, n: int) -> tuple:
        """The caches' key/value buffers with room for n more rows, as pointer arrays (remade only when
        a buffer moved) and the capacity of each."""
        ks, vs, caps = [], [], []
        for layer in cache_layers:
            kb, vb = layer.reserve(n)
            ks.append(kb.data_ptr())
            vs.append(vb.data_ptr())
            caps.append(kb.shape[2])
        key = (ks, vs, caps)
        if self._bufs is None or self._bufs[0] != key:
            L = self.layers
            self._bufs = (key, ((ctypes.c_void_p * L)(*ks), (ctypes.c_void_p * L)(*vs), (ctypes.c_int64 * L)(*caps)))
        return self._bufs[1]

    def __call__(self, x: torch.Tensor, cache_layers, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                 scale: float, capture: dict[int, torch.Tensor], threads: int) -> torch.Tensor:
        """Run every layer on x [1, n, h] (float32, updated in place and returned) with the rotary tables
        cos / sin [n, d] and the additive mask [1, 1, n, past + n]; appends n rows to every cache layer
        (``kvcache.GrowingLayer``); ``capture`` maps layer ids to where their outputs go (filled with
        new [1, n, h] tensors)."""
        n = x.shape[1]
        past = cache_layers[0].keys.shape[-2]
        if mask.stride(3) != 1:
            mask = mask.contiguous()
        kb, vb, caps = self._buffers(cache_layers, n)
        for i in capture:
            capture[i] = torch.empty_like(x)
        caught = (ctypes.c_void_p * self.layers)(*[capture[i].data_ptr() if i in capture else None
                                                   for i in range(self.layers)])
        h, heads, kv, d, inter = self.dims
        dims = (ctypes.c_int64 * 8)(n, h, heads, kv, d, inter, past, mask.stride(2))
        rc = cpu_native.library().bastion_decoder_f32(
            x.data_ptr(), self.layers, dims, self._kinds, self._panels, self._bias, self._norms, self._eps,
            kb, vb, caps, caught, cos.data_ptr(), sin.data_ptr(), mask.data_ptr(), scale, threads)
        if rc != 0:
            raise MemoryError("native decoder: no memory for its scratch rows")
        for layer in cache_layers:
            layer.advance(n)
        return x
