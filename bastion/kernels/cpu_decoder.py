"""Decoder layers as one native call (``cpu_layer.c``): a target's in ``target_lean.lean_forward``, a
DFlash drafter's in ``drafter_lean.lean_layers``.

The Python loops run each layer as ~25 calls (seven products, norms, rotary, the cache update, the
attention, residual adds, the SwiGLU product), each a few microseconds of dispatch and a tensor
allocation: on the 2-core Zen 3 ~5 ms of the embedded target's ~17 ms one-row step (session 32,
bench/NOTES.md). :class:`NativeDecoder` hands all layers to ``bastion_decoder_f32`` at once: the same
kernels in the same order on the same inputs, so logits, captured features and cache rows are
bit-identical to the loop's (tests/test_target.py, tests/test_drafter.py). It applies where the
loop's plan does (float32, exact compressed, widened-bf16 or — a drafter's on AVX512-BF16 —
bf16-pair products, since session 55) and the layers' norms and activations run natively
(``cpu_modules.use_native_modules``, the default of both models); callers keep their loops
otherwise. For the embedded drafter the one call saves ~0.6 ms of Python a draft either way.
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_native


def _kind(panels: torch.Tensor) -> int | None:
    """The C product for these panels (cpu_layer.c ``product``), or None: float32, exact 4- / 8-bit,
    bf16 weights widened ([np, K, 16]) or bf16 pairs ([np, K/2, 16, 2], AVX512-BF16: the C side
    rounds the inputs to bf16 as :class:`cpu_native.Product` casts them)."""
    if panels.dtype == torch.bfloat16:
        return {3: 3, 4: 4}.get(panels.dim())
    return {torch.float32: 0, torch.uint8: 1, torch.int8: 2}.get(panels.dtype)


def _native_forward(module: torch.nn.Module) -> bool:
    return "forward" in module.__dict__  # set per instance by cpu_modules.use_native_modules


def _norms(layer) -> tuple:
    """A layer's norms in cpu_layer.c's order: ln1, ln2, q_norm, k_norm (None where absent: Llama)."""
    attn = layer.self_attn
    return (layer.input_layernorm, layer.post_attention_layernorm, getattr(attn, "q_norm", None),
            getattr(attn, "k_norm", None))


class NativeDecoder:
    """Per-layer constants (panel and bias pointers, norm weights and epsilons) of a lean plan, made once;
    :meth:`run` runs every layer over a few rows.

    Holds the plan (its products hold their panels) and the norm weights, so the pointers stay valid
    while it lives."""

    def __init__(self, layers, plan: list[tuple], hidden: int, heads: int, kv_heads: int, head_dim: int):
        prods = [p for layer_plan in plan for p in layer_plan]
        self.plan, self.layers = plan, len(plan)
        self.dims = (hidden, heads, kv_heads, head_dim, plan[0][4].n)
        n7 = 7 * self.layers
        self._kinds = (ctypes.c_int * n7)(*[_kind(p.panels) for p in prods])
        self._panels = (ctypes.c_void_p * n7)(*[p._pp for p in prods])
        self._bias = (ctypes.c_void_p * n7)(*[p._bp for p in prods])
        mods = [m for layer in layers for m in _norms(layer)]
        if any(m is not None and not m.weight.is_contiguous() for m in mods):
            raise ValueError("norm weights must be contiguous")
        self._norms = (ctypes.c_void_p * len(mods))(*[None if m is None else m.weight.data_ptr() for m in mods])
        # what current() compares: each norm module with its weight and the weight's address, then
        # every module whose forward must stay native (norms and activations)
        self._watch = [(m, m._parameters["weight"], m.weight.data_ptr()) for m in mods if m is not None]
        self._native = [m for m, _, _ in self._watch] + [layer.mlp.act_fn for layer in layers]
        self._eps = (ctypes.c_float * len(mods))(*[0.0 if m is None else float(m.variance_epsilon) for m in mods])
        self._bufs: tuple | None = None  # (buffer pointers, their ctypes arrays)

    @staticmethod
    def qualifies(layers, plan: list[tuple] | None) -> bool:
        """Whether the native decoder computes what the lean loop computes for these layers: products
        it can run (the plan's), native norms and activation in every layer, contiguous norm weights."""
        if plan is None or not cpu_native.available() or any(_kind(p.panels) is None for lp in plan for p in lp):
            return False
        return all(_native_forward(m) and m.weight.is_contiguous() for layer in layers for m in _norms(layer)
                   if m is not None) and all(_native_forward(layer.mlp.act_fn) for layer in layers)

    def current(self, layers, plan: list[tuple]) -> bool:
        """Whether this decoder still stands for these layers: made from this plan, the norms and
        activations still native, the norm weights the same tensors at the same addresses (~25 µs
        for 30 layers; the caller checks every forward, as a training step or a switch may have
        changed them). The layers must be those it was made for (the plan is theirs)."""
        if plan is not self.plan or len(layers) != self.layers:
            return False
        return (all(m._parameters["weight"] is w and w.data_ptr() == p for m, w, p in self._watch)
                and all("forward" in m.__dict__ for m in self._native))

    def _pointers(self, kbufs: list[torch.Tensor], vbufs: list[torch.Tensor]) -> tuple:
        """The per-layer key/value buffers [1, G, capacity, d] as pointer arrays and capacities (remade
        only when a buffer moved)."""
        key = ([k.data_ptr() for k in kbufs], [v.data_ptr() for v in vbufs], [k.shape[2] for k in kbufs])
        if self._bufs is None or self._bufs[0] != key:
            L = self.layers
            self._bufs = (key, ((ctypes.c_void_p * L)(*key[0]), (ctypes.c_void_p * L)(*key[1]),
                                (ctypes.c_int64 * L)(*key[2])))
        return self._bufs[1]

    def run(self, x: torch.Tensor, kbufs: list[torch.Tensor], vbufs: list[torch.Tensor], past: int,
            cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, scale: float, threads: int,
            capture: dict[int, torch.Tensor] | None = None, fresh: torch.Tensor | None = None) -> None:
        """Every layer on x [n, h] (or [1, n, h]; contiguous float32, updated in place).

        kbufs / vbufs: per layer [1, G, ≥ past + m + n, d] buffers whose first ``past`` rows are the
        cache; rows [past, past + m + n) are written. cos / sin [m + n, d] contiguous; mask [1, 1, n,
        past + m + n] additive or None (all visible); ``capture`` maps layer ids to new tensors shaped
        like x that receive those layers' outputs; ``fresh`` [m, h] rows whose keys and values precede
        x's (a drafter's newly committed context, cpu_layer.c)."""
        n = x.shape[-2]
        m = 0 if fresh is None else fresh.shape[0]
        if mask is not None and mask.stride(3) != 1:
            mask = mask.contiguous()
        kb, vb, caps = self._pointers(kbufs, vbufs)
        caught = None
        if capture:
            for i in capture:
                capture[i] = torch.empty_like(x)
            caught = [capture[i].data_ptr() if i in capture else None for i in range(self.layers)]
        caught = (ctypes.c_void_p * self.layers)(*(caught or [None] * self.layers))
        h, heads, kv, d, inter = self.dims
        dims = (ctypes.c_int64 * 9)(n, h, heads, kv, d, inter, past, 0 if mask is None else mask.stride(2), m)
        rc = cpu_native.library().bastion_decoder_f32(
            x.data_ptr(), self.layers, dims, self._kinds, self._panels, self._bias, self._norms, self._eps,
            kb, vb, caps, caught, cos.data_ptr(), sin.data_ptr(), None if mask is None else mask.data_ptr(),
            None if fresh is None else fresh.data_ptr(), scale, threads)
        if rc != 0:
            raise MemoryError("native decoder: no memory for its scratch rows")

    def forward_cache(self, x: torch.Tensor, cache_layers, cos: torch.Tensor, sin: torch.Tensor,
                      mask: torch.Tensor, scale: float, capture: dict[int, torch.Tensor], threads: int) -> torch.Tensor:
        """A target's layers on x [1, n, h] appending n rows to every cache layer
        (``kvcache.GrowingLayer``: reserve, write, advance); returns x."""
        n = x.shape[1]
        past = cache_layers[0].rows()
        bufs = [c.reserve(n) for c in cache_layers]
        self.run(x, [b[0] for b in bufs], [b[1] for b in bufs], past, cos, sin, mask, scale, threads, capture)
        for c in cache_layers:
            c.advance(n)
        return x
