"""Norms and activations of transformers models through the native kernels, switched per module.

transformers' float32 RMSNorm is six torch ops and its SiLU one more, each dispatched and, at a few
rows, each waking torch's thread pool: on the 2-core Zen 3, nine rows of the embedded target spent
~90 µs a norm and ~20 µs an activation, 61 norms and 30 activations a forward. :func:`use_native_modules`
points such modules' ``forward`` at :func:`cpu_rows.rms_norm` and :func:`cpu_rows.silu` (CPU
float32, no autograd; anything else keeps the module's own forward).
"""

from __future__ import annotations

import types

import torch

from . import cpu_native, cpu_rows

NATIVE_NORMS = ("LlamaRMSNorm", "Qwen3RMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")  # w * (x * rsqrt(mean x² + ε))
NATIVE_ACTS = ("SiLUActivation", "SiLU")


def _native_here(x: torch.Tensor, w: torch.Tensor | None = None) -> bool:
    # CPU float32 without autograd, and the library built: where the native passes apply
    if x.dtype != torch.float32 or not x.is_cpu or (w is not None and (w.dtype != torch.float32 or not w.is_cpu)):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (w is not None and w.requires_grad)):
        return False
    return cpu_native.available()


def _native_norm_forward(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if _native_here(x, norm.weight):
        return cpu_rows.rms_norm(x, norm.weight, norm.variance_epsilon)
    return type(norm).forward(norm, x)


def _native_silu_forward(act: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if _native_here(x):
        return cpu_rows.silu(x)
    return type(act).forward(act, x)


def use_native_modules(model: torch.nn.Module, on: bool = True) -> int:
    """Run every Llama / Qwen-style RMSNorm of ``model`` through :func:`cpu_rows.rms_norm` and every
    SiLU activation through :func:`cpu_rows.silu` (on CPU float32 inputs without autograd; other
    inputs keep the module's own forward), or back; returns how many modules changed.

    Set per instance (``forward``), so parameters, hooks and state-dict keys stay; whether the kernel
    is built is asked per call (a cached flag), so switching compiles nothing. The target's modules
    switch with its native products (``Target.__init__``): the lean loop and transformers' forward
    then run the same norms and activations, so their logits stay bit-identical to each other — and,
    like the native products, differ from stock transformers by float rounding. The drafter's switch
    on at construction (its outputs are proposals; training's autograd keeps the modules' forward).
    Measured on the embedded target (2-core Zen 3, session 22, torch's profiler over nine-row
    forwards): the norms' ~90 µs a call and the activation's ~20 µs leave the profile (~5.5 and
    ~1.2 ms a forward)."""
    n = 0
    for m in model.modules():
        name = type(m).__name__
        if name in NATIVE_NORMS and hasattr(m, "variance_epsilon"):
            forward = _native_norm_forward
        elif name in NATIVE_ACTS:
            forward = _native_silu_forward
        else:
            continue
        if on and "forward" not in m.__dict__:
            m.forward = types.MethodType(forward, m)
            n += 1
        elif not on and "forward" in m.__dict__:
            del m.__dict__["forward"]
            n += 1
    return n
