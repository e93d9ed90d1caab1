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

Every path computes the same product in float32; only the rounding of the sums differs (≤ 1e-6
relative), as it already does between row counts inside MKL. Only CPU float32 tensors without
autograd take these paths: everything else is ``F.linear`` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` — x [..., k], weight [n, k], bias [n] → [..., n] — computed by the
    fastest CPU routine for few rows (module docstring); any other input goes to ``F.linear``."""
    if not fast_path(x, weight):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    x2 = x.reshape(rows, x.shape[-1])
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
    """``nn.Linear`` whose forward is :func:`skinny_linear` (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias)


def use_skinny_linear(module: nn.Module, on: bool = True) -> int:
    """Switch every plain ``nn.Linear`` inside `module` to :class:`SkinnyLinear` (``on=False``: back), in place.

    Only the class changes (parameters, tied weights, hooks and state-dict keys stay), and the choice
    of routine is made per call, so it is safe on any device and dtype. Returns the number switched."""
    src, dst = (nn.Linear, SkinnyLinear) if on else (SkinnyLinear, nn.Linear)
    n = 0
    for m in module.modules():
        if type(m) is src:
            m.__class__ = dst
            n += 1
    return n
