"""Row-wise native helpers of the kernel library (``cpu_gemm.c``, ``cpu_noise.c``; built and loaded by
:mod:`cpu_native`): :func:`rms_norm`, the RMSNorm of a few rows in one pass instead of six torch ops;
:func:`rope`, the rotary embedding bit for bit as transformers computes it, one call instead of
fourteen ops; :func:`silu`, the MLP's activation; :func:`uniform_rows` and :func:`uniform_cells`, the sampler's uniform
variates; :func:`move_rows`, a verified tree's accepted cache rows moved in every layer at once.
Each computes a row on its own, so results do not depend on how many rows a call holds.
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_native


def _library() -> ctypes.CDLL:
    """The loaded library, or RuntimeError saying why it is unavailable."""
    lib = cpu_native.library()
    if lib is None:
        raise RuntimeError(f"native CPU kernel unavailable: {cpu_native.unavailable_reason()}")
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x², -1) + eps))`` for CPU float32 x [..., n] and weight [n], one
    native pass per row (cpu_gemm.c ``bastion_rms_norm_f32``): transformers' Llama / Qwen RMSNorm to
    float rounding, each row on its own (batch-invariant)."""
    lib = _library()
    n = x.shape[-1]
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or not x.is_cpu or not weight.is_cpu
            or weight.shape != (n,)):
        raise ValueError(f"rms_norm wants CPU float32 x [..., n] and weight [n]; got {tuple(x.shape)} {x.dtype}, "
                         f"{tuple(weight.shape)} {weight.dtype}")
    x = x.contiguous()
    w = weight.contiguous()
    y = torch.empty_like(x)
    lib.bastion_rms_norm_f32(x.data_ptr(), x.numel() // n if n else 0, n, w.data_ptr(), float(eps), y.data_ptr())
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [n, H, d] by cos / sin [n, d] (CPU float32): ``x * cos + rotate_half(x) *
    sin`` per head with each op rounded as torch rounds it, so the bits of transformers'
    ``apply_rotary_pos_emb`` → [n, H, d]. The caller's layout promise: all three contiguous (checked
    cheaply, made so otherwise)."""
    lib = _library()
    n, heads, d = x.shape
    if (x.dtype != torch.float32 or cos.dtype != torch.float32 or sin.dtype != torch.float32 or not x.is_cpu
            or cos.shape != (n, d) or sin.shape != (n, d) or d % 2):
        raise ValueError(f"rope wants CPU float32 x [n, H, d] (d even) and cos / sin [n, d]; got {tuple(x.shape)} "
                         f"{x.dtype}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x)
    lib.bastion_rope_f32(x.data_ptr(), n, heads, d, cos.data_ptr(), sin.data_ptr(), out.data_ptr())
    return out


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` for CPU float32 x [..., n], natively, row by row (an element's result does not
    depend on the row count); within a few ulp of torch's silu."""
    lib = _library()
    if x.dtype != torch.float32 or not x.is_cpu or x.dim() == 0:
        raise ValueError(f"silu wants a CPU float32 tensor [..., n]; got {tuple(x.shape)} {x.dtype} on {x.device}")
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    if x.numel():
        lib.bastion_silu_f32(x.data_ptr(), x.numel() // n, n, y.data_ptr())
    return y


def uniform_rows(keys: list[int], vocab: int) -> torch.Tensor:
    """The uniform variates float32 [len(keys), vocab] of ``reference.uniform_stream`` for rows whose
    32-bit keys (the mixed row counter and seed, :func:`reference.row_keys`) are given: the same bits,
    natively (cpu_noise.c)."""
    lib = _library()
    k = torch.tensor([key & 0xFFFFFFFF for key in keys], dtype=torch.int64).to(torch.int32)
    out = torch.empty(len(keys), vocab, dtype=torch.float32)
    if len(keys) and vocab:
        lib.bastion_uniform_rows(k.data_ptr(), len(keys), vocab, out.data_ptr())
    return out


def uniform_cells(keys: list[int], col_keys: torch.Tensor) -> torch.Tensor:
    """:func:`reference.uniform_cells` natively: float32 [len(keys), m] for rows with these 32-bit
    keys at the tokens whose :func:`reference.column_keys` are ``col_keys`` (int64 [m])."""
    lib = _library()
    k = torch.tensor([key & 0xFFFFFFFF for key in keys], dtype=torch.int64).to(torch.int32)
    c = col_keys.to(torch.int64).to(torch.int32).contiguous()  # the low 32 bits, as the C side reads them
    out = torch.empty(len(keys), len(c), dtype=torch.float32)
    if len(keys) and len(c):
        lib.bastion_uniform_cells(k.data_ptr(), len(keys), c.data_ptr(), len(c), out.data_ptr())
    return out


def move_rows(tensors: list[torch.Tensor], src: list[int], dst: list[int]) -> bool:
    """Move rows src[j] → dst[j] (dim 2) in every tensor [1, heads, rows, d] of ``tensors``, in
    place, in one native call (a KV cache's accepted rows after a tree verification). Returns False,
    touching nothing, when a tensor is not CPU float32 with unit stride in d, the tensors differ in
    heads or d, or the library is unavailable: the caller then uses torch. src must increase and
    dst[j] ≤ src[j] (rows are read before they are overwritten). The checks are a few tuple reads per
    tensor: this runs once a round over ~60 tensors."""
    lib = cpu_native.library()
    if not tensors or not src or lib is None:
        return False
    if len(dst) != len(src) or any(b > a for a, b in zip(src, dst)) or any(b <= a for a, b in zip(src, src[1:])) \
            or dst[0] < 0:
        raise ValueError(f"move_rows wants increasing rows src with 0 <= dst[j] <= src[j]; got {src}, {dst}")
    heads, d = tensors[0].shape[1], tensors[0].shape[3]
    ptrs, hs, rs = [], [], []
    for t in tensors:
        sh, st = t.shape, t.stride()
        if t.dtype != torch.float32 or not t.is_cpu or st[3] != 1 or sh[0] != 1 or sh[1] != heads \
                or sh[3] != d or sh[2] <= src[-1]:
            return False
        ptrs.append(t.data_ptr())
        hs.append(st[1])
        rs.append(st[2])
    m, n = len(src), len(tensors)
    lib.bastion_move_rows((ctypes.c_void_p * n)(*ptrs), (ctypes.c_int64 * n)(*hs), (ctypes.c_int64 * n)(*rs), n,
                           heads, d, (ctypes.c_int64 * m)(*src), (ctypes.c_int64 * m)(*dst), m)
    return True
