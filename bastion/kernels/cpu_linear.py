"""Few-row matrix products on the CPU: ``y = x Wᵀ + b`` for x with 1–64 rows.

Decoding multiplies a handful of rows (one token for plain decoding, 2–64 tree nodes for a
verification, a 16-token block for a draft) by every weight matrix of the model. torch's CPU
``linear`` sends these shapes to MKL routines that are slow on the AMD EPYC machines this project
is developed on. Measured there (2 threads, fp32, SmolLM2-135M's LM head W [49152, 576], median of 15):

    rows                    1      2      4      8     16     32   (ms)
    F.linear(x, W)        10.0   23.2   16.8   16.3   19.2   25.3
    (W @ xᵀ)ᵀ             10.0    3.3    5.2    7.7   14.4   19.0
    oneDNN linear          5.1    5.6    6.2    7.6    9.8   12.8
    skinny_linear          4.2    3.7    5.9    8.0    9.0   13.5   (another run)

One row goes to sgemv, which streams W at ~10 GB/s; the same product as a two-column gemm streams it
at ~30 GB/s. So: 1–4 rows as (W xᵀ)ᵀ (one row duplicated into two columns), 5–64 rows through
oneDNN's linear on the plain weight, more rows (prefill, training batches) through ``F.linear``.
A whole SmolLM2-135M forward after 300 tokens: 1 row 59 → 33 ms, 12 rows 86 → 67 ms, 16 rows
95 → 72 ms (bench/NOTES.md).

Where a C compiler is available, :class:`SkinnyLinear` goes one step further (mode ``native``): its
weight is re-laid out once in panels and multiplied by ``kernels.cpu_native`` (a kernel of our own,
compiled on first use), which reads the weights once per call whatever the row count up to 64 —
a 16-row product over every matrix of the model 51 → 30 ms. ``skinny_linear`` itself stays torch-only unless
the caller passes the panels.

Every path computes the same product in float32; only the rounding of the sums differs (≤ 1e-6
relative), as it already does between row counts inside MKL. Only CPU float32 tensors without
autograd take these paths: everything else is ``F.linear`` unchanged.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_native

# packed native kernel (exact 4/8-bit panels where lossless) · the same on float32 panels only · the
# same with bf16 weights (drafters only) · torch's few-row routines · plain F.linear
MODES = ("native", "native-f32", "native-bf16", "fast", "stock")
MAX_ROWS = 64  # above this MKL's gemm is as fast (prefill, training batches)
GEMM_ROWS = 4  # up to this many rows (W xᵀ)ᵀ beats oneDNN

_onednn_ok: bool | None = None  # probed once, on first use (never at import)


def _onednn_linear_available() -> bool:
    """Whether torch's private oneDNN linear op exists and runs here (it may vanish in a torch release)."""
    global _onednn_ok
    if _onednn_ok is None:
        try:
            x, w = torch.ones(2, 3), torch.ones(4, 3)
            y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            _onednn_ok = bool(torch.equal(y, torch.full((2, 4), 3.0)))
        except (AttributeError, RuntimeError, NotImplementedError):
            _onednn_ok = False
    return _onednn_ok


def fast_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``skinny_linear`` would not simply call ``F.linear``."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False  # the oneDNN op has no backward; training keeps autograd's linear
    return x.dim() >= 1 and x.shape[-1] > 0 and x.numel() // x.shape[-1] <= MAX_ROWS


def _native(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., k] times the packed weight of `n` outputs → [..., n] (callers checked ``fast_path``);
    bf16 panels run a low-precision kernel (:func:`cpu_native.pack_bf16` / :func:`cpu_native.pack_h16`)."""
    if panels.dtype != torch.bfloat16:  # float32 or exact compressed panels
        mul = cpu_native.linear
    else:  # [np, K/2, 16, 2]: AVX512-BF16 pairs; [np, K, 16]: bf16 weights widened (AVX2)
        mul = cpu_native.linear_bf16 if panels.dim() == 4 else cpu_native.linear_h16
    return mul(x.reshape(-1, x.shape[-1]), panels, n, bias).reshape(*x.shape[:-1], n)


def pack_for(weight: torch.Tensor, low_precision: bool, compress: bool = True) -> torch.Tensor:
    """The panels the native kernel reads for `weight`: with `low_precision`, bf16 pairs where
    AVX512-BF16 runs them (an even number of inputs; inputs rounded too) and bf16 weights widened in
    registers elsewhere (inputs and sums float32); otherwise, with `compress`, exact 4- or 8-bit panels
    when the weight is losslessly Q4_1 / Q8_0 (:func:`cpu_native.pack_exact`: weights dequantised from
    a llama.cpp file, the embedded target's; the same product bits from a fifth to a quarter of the
    bytes), else float32 panels."""
    if low_precision and weight.shape[1] % 2 == 0 and cpu_native.bf16_available():
        return cpu_native.pack_bf16(weight)
    if low_precision:
        return cpu_native.pack_h16(weight)
    exact = cpu_native.pack_exact(weight) if compress else None
    return exact if exact is not None else cpu_native.pack(weight)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  panels: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` — x [..., k], weight [n, k], bias [n] → [..., n] — computed by the
    fastest CPU routine for few rows (module docstring); any other input goes to ``F.linear``.

    `panels`: ``cpu_native.pack(weight)``; when given (and the native kernel is built) few-row
    products read them instead of `weight`."""
    if not fast_path(x, weight):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    x2 = x.reshape(rows, x.shape[-1])
    if panels is not None and cpu_native.available():
        return _native(x, panels, weight.shape[0], bias)
    if rows <= GEMM_ROWS or not _onednn_linear_available():
        # x2ᵀ as a transposed view: MKL then runs the tall-times-thin gemm kernel. A single column
        # would be dispatched to sgemv (3× slower), so one row is duplicated into two columns.
        cols = torch.cat((x2, x2)) if rows == 1 else x2  # a real copy: a stride-0 expand is slow again
        y = (weight @ cols.t()).t()[:rows]
        if bias is not None:
            y = y + bias
        y = y.contiguous()
    else:
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), weight, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`skinny_linear` (same parameters, same state dict).

    With ``native`` (set by :func:`use_skinny_linear`) and the native kernel built, few-row CPU
    float32 products read a panel copy of the weight, made on first use and remade whenever the
    weight changes (its storage or its in-place version counter). With ``low_precision`` too (mode
    ``native-bf16``) the copy is in bf16, for a drafter, whose outputs are proposals: with
    AVX512-BF16 the inputs are rounded to bf16 too (float32 sums; half the bytes and twice the
    multiply-adds per instruction), elsewhere the weights are widened to float32 in registers (half
    the bytes; a draft of the embedded drafter 9.5 → 6.2 ms on the Zen 3, session 22)."""

    native = False
    low_precision = False
    compress = True  # mode "native": exact 4/8-bit panels where lossless; "native-f32": float32 panels

    def panels(self) -> torch.Tensor:
        """``pack_for(self.weight, self.low_precision, self.compress)``, cached on the module (not a
        buffer: never saved or moved)."""
        w = self.weight
        key = (w.data_ptr(), w._version, tuple(w.shape), self.low_precision, self.compress)
        got = self.__dict__.get("_panels")
        if got is None or got[0] != key:
            got = (key, pack_for(w, self.low_precision, self.compress))
            self.__dict__["_panels"] = got
        return got[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ~230 calls per decoding step: the native path is checked once, inline
        if self.native and fast_path(x, self.weight) and cpu_native.available():
            return _native(x, self.panels(), self.weight.shape[0], self.bias)
        return skinny_linear(x, self.weight, self.bias)


_mode_changes = 0  # how many use_skinny_linear calls changed something (see mode_changes)


def _packed_dtype(m: SkinnyLinear) -> torch.dtype | None:
    """The dtype of a native compressing layer's packed panels (None: not packed yet, or not such a layer)."""
    panels = m.__dict__.get("_panels", (None, None))[1] if m.native and m.compress else None
    return None if panels is None else panels.dtype


def exact_products(module: nn.Module) -> int:
    """How many of ``module``'s native linear layers hold exact 4/8-bit panels now (packed ones only:
    panels are made on a layer's first product or by :func:`prepack`)."""
    return sum(_packed_dtype(m) in (torch.uint8, torch.int8) for m in _native_layers(module))


def exact_q8_layers(module: nn.Module) -> list[SkinnyLinear]:
    """``module``'s native linear layers whose panels are exact 8-bit ones (packed ones only)."""
    return [m for m in _native_layers(module) if _packed_dtype(m) == torch.int8]


def mode_changes() -> int:
    """A counter that :func:`use_skinny_linear` advances whenever it changes a module's mode: callers
    that cache a decision about modes (``target_lean.lean_plan``) compare it instead of re-reading
    every module."""
    return _mode_changes


def _mode_of(m: nn.Module) -> tuple:
    return type(m), getattr(m, "native", None), getattr(m, "low_precision", None), getattr(m, "compress", None)


def use_skinny_linear(module: nn.Module, on: bool | str = True) -> int:
    """Set how every linear layer inside `module` multiplies, in place; returns the number changed.

    `on`: a mode of :data:`MODES` — ``"native"`` (:class:`SkinnyLinear` on the packed native kernel,
    torch's routines where it cannot be built; weights that are exactly Q4_1 / Q8_0 packed in 4 / 8
    bits, the same product bits), ``"native-f32"`` (the same on float32 panels only: the kernel before
    exact compression, for comparisons), ``"native-bf16"`` (the same on bf16 panels: drafters
    only), ``"fast"`` (:class:`SkinnyLinear` on torch's few-row
    routines), ``"stock"`` (plain ``nn.Linear``) — or True / False for ``"fast"`` / ``"stock"``.
    Only the class changes (parameters, tied weights, hooks and state-dict keys stay), and the choice
    of routine is made per call, so it is safe on any device and dtype."""
    mode = ("fast" if on else "stock") if isinstance(on, bool) else on
    if mode not in MODES:
        raise ValueError(f"unknown linear mode {on!r}; choose from {', '.join(MODES)}")
    n = 0
    for m in module.modules():
        if type(m) not in (nn.Linear, SkinnyLinear):
            continue
        before = _mode_of(m)
        if mode == "stock":
            m.__class__ = nn.Linear
            for attr in ("_panels", "native", "low_precision", "compress"):
                m.__dict__.pop(attr, None)
        else:
            m.__class__ = SkinnyLinear
            m.native = mode.startswith("native")
            m.low_precision = mode == "native-bf16"
            m.compress = mode == "native"
            if not m.native:
                m.__dict__.pop("_panels", None)
        n += before != _mode_of(m)
    if n:
        global _mode_changes
        _mode_changes += 1
    return n


def _native_layers(module: nn.Module) -> list[SkinnyLinear]:
    return [m for m in module.modules() if isinstance(m, SkinnyLinear) and m.native
            and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]


def prepack(module: nn.Module, memory_fraction: float = 0.5) -> int:
    """Make the panel copies of every native :class:`SkinnyLinear` with a CPU float32 weight now (at
    model load) rather than inside the first decoding step; returns how many. No-op without the kernel.

    The copies double those weights in memory. When they would take more than `memory_fraction` of
    the memory available now (a 4B-parameter target in fp32 wants 16 GB more), the layers are set
    back to torch's few-row routines (mode ``fast``) with a warning instead."""
    layers = _native_layers(module)
    if not layers or not cpu_native.available():  # a GPU model never builds the CPU kernel
        return 0
    need = sum(m.weight.numel() * (2 if m.low_precision else 4) for m in layers)
    try:
        import psutil

        free = psutil.virtual_memory().available
    except (ImportError, OSError):
        free = None
    if free is not None and need > memory_fraction * free:
        warnings.warn(f"native CPU kernel off: its packed weights need {need / 2**30:.1f} GiB, "
                      f"{free / 2**30:.1f} GiB is available; using torch's few-row routines", stacklevel=2)
        for m in layers:
            m.native = False
        return 0
    for m in layers:
        m.panels()
    return len(layers)
