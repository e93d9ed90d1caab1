"""Native few-row CPU kernels: ``cpu_gemm.c`` (and ``cpu_layer.c``) compiled on first use, called
through ctypes.

Three kernels: float32 products over packed weights (:func:`linear`, the target's and the default;
over exact 4- / 8-bit panels where the weights are losslessly Q4_1 / Q8_0, :func:`pack_exact`),
bf16 products for drafters (:func:`linear_bf16`, where the CPU has AVX512-BF16) and the attention of
a few queries over the KV cache (:func:`attention`). The first and the last compute each row on its
own, so a tree verification and plain decoding get bit-identical logits (tests/test_cpu_attention.py).
The same library's row-wise helpers (RMSNorm, rotary embedding, SiLU, the sampler's uniform rows,
cache row moves) are in ``kernels/cpu_rows.py``; ``cpu_layer.c`` chains them and the products into a
target's decoder layers in one call (``kernels/cpu_decoder.py``).

Why a kernel of our own: decoding multiplies 1–64 rows by every weight matrix, and the BLAS gemm
kernels behind torch are tuned for many rows. Measured on the development machine (2-core AMD EPYC,
2 threads, fp32, every weight matrix of SmolLM2-135M once — 538 MB; ms, best of 5; reading the
weights alone, ``w.sum()``, takes 12 ms):

    rows                       1      2      4      8     12     16     24     32
    (W xᵀ)ᵀ  (MKL gemm)      16.4   16.2   25.6   41.5   71.7   55.5   72.6   76.7
    oneDNN linear            26.0   32.1   35.7   40.8   46.3   51.3   62.2   72.1
    packed panels (this)     13.0   12.7   14.3   17.1   23.1   30.1   38.6   48.0

The kernel reads each weight once per call from a panel layout made once per matrix (``pack``), so
a tree of up to 8 nodes costs little more than one token — the regime speculative decoding lives in.
The packed copy doubles the weights' memory (540 MB more for SmolLM2-135M) — unless the weights are
exactly Q4_1 / Q8_0, as the embedded model's are (dequantised from its GGUF file): then
:func:`pack_exact` keeps 4- or 8-bit codes with per-block scales (120 MB for all of SmolLM2-135M),
which the product decodes on the fly into the very float32 weights and multiplies in the float32
kernel's order — the same bits from a fifth of the bytes. On the Zen 3 without AVX-512 (session 23,
all 211 matrices, 2 threads, noisy medians) one row 36–45 → 15–19 ms, 4–6 rows ~40 → 14–19, 9 rows
~48 → 27, 16 rows ~55 → 39: a decoding step stops waiting on memory. Where the CPU has AVX-512
(session 24, a 2-core Xeon) up to 16 rows decode into 512-bit registers: 7–16 rows 30% faster than
the 256-bit paths (9 rows 20.9 → 14.2 ms, 16 rows 31.0 → 23.2).

Each output is summed in the same order whatever the number of rows (cpu_gemm.c), so a row's result
does not depend on the other rows in the call: batch-invariant logits.

The library is built with the system C compiler (``cc``, ``gcc`` or ``clang``; ``-O3 -march=native
-fopenmp``; ``cpu_build.py``) into the per-user cache, keyed by the sources, the flags and the CPU's
features, and loaded with ctypes after torch, so it shares torch's OpenMP runtime. Without a compiler, or where
the build fails, :func:`available` is False and callers keep torch's routines (``cpu_linear``).
Nothing is compiled at import time.
"""

from __future__ import annotations

import ctypes
import platform
import subprocess
from pathlib import Path

import torch

from .cpu_build import build, declare

_lib: ctypes.CDLL | None = None
_tried = False
_why = ""


def library(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The loaded kernel library, built on the first call; None when it cannot be built here."""
    global _lib, _tried, _why
    if _tried:
        return _lib
    _tried = True
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        _why = f"not built on {platform.system()}/{platform.machine()}"
        return None
    try:
        lib = declare(ctypes.CDLL(str(build(cache_dir))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _why = str(e)
        return None
    _lib = lib
    if lib.bastion_gemm_panel() != 16:
        _lib, _why = None, "the compiled kernel's panel width is not 16"
    elif not _self_test():
        _lib, _why = None, "the compiled kernel disagrees with torch on a test product"
    return _lib


def _self_test() -> bool:
    """One small product against torch: a miscompiled library is refused, not used."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 29, generator=g)
    b = torch.randn(37, generator=g)
    x = torch.randn(5, 29, generator=g)
    got = linear(x, pack(w), 37, b)
    if not torch.allclose(got, torch.addmm(b, x, w.t()), rtol=1e-4, atol=1e-4):
        return False
    # attention: 4 heads on 2 KV heads, 3 queries, the last key hidden from the first query
    q, k, v = torch.randn(1, 4, 3, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g)
    mask = torch.zeros(1, 1, 3, 5)
    mask[0, 0, 0, 4] = torch.finfo(torch.float32).min
    want = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(2, 3) * 0.25 + mask, -1) @ v.repeat_interleave(2, 1)
    got = attention_unchecked(q, k, v, mask, 0.25)
    return bool(torch.allclose(got, want.transpose(1, 2), rtol=1e-4, atol=1e-5))


def _bf16_self_test(lib: ctypes.CDLL) -> bool:
    """One small bf16 product against torch's product of the rounded operands: a miscompiled or
    misreported instruction set is refused (the drafter then keeps float32)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(37, 30, generator=g)
    x = torch.randn(5, 30, generator=g)
    want = x.bfloat16().float() @ w.bfloat16().float().t()
    got = torch.empty(5, 37)
    panels, xb = pack_bf16(w), x.bfloat16().contiguous()  # held: ctypes gets bare pointers
    lib.bastion_gemm_bf16(xb.data_ptr(), 5, panels.data_ptr(), 37, 15, None, got.data_ptr(), 1)
    return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4))


_bf16: bool | None = None


def bf16_available() -> bool:
    """Whether :func:`linear_bf16` runs here: the kernel is built and the CPU has AVX512-BF16."""
    global _bf16
    if _bf16 is None:
        lib = library()
        _bf16 = bool(lib is not None and lib.bastion_gemm_bf16_available() and _bf16_self_test(lib))
    return _bf16


def available() -> bool:
    """Whether the native kernel is built and usable in this process (builds it on first call)."""
    return library() is not None


def wide_rows(q8: bool = False) -> int | None:
    """Which row counts' exact 4-bit (``q8``: 8-bit) products take the 512-bit path: bit r−1 of the
    mask for r rows (1–16; all by default), or None where the library has no such path (no AVX-512,
    no library)."""
    lib = library()
    mask = -1 if lib is None else lib.bastion_wide_rows(int(q8), -1)
    return None if mask < 0 else mask


def set_wide_rows(mask: int, q8_mask: int | None = None) -> None:
    """Send r-row exact 4-bit products down the 512-bit path iff bit r−1 of ``mask`` is set, the
    others down the 256-bit one; 8-bit products by ``q8_mask`` (default: ``mask``). Both paths return
    the same bits (cpu_gemm.c), so this changes speed only; ``probe.tune_wide_rows`` picks the masks
    by timing both. A no-op where :func:`wide_rows` is None."""
    if wide_rows() is not None:
        _lib.bastion_wide_rows(0, mask & 0xFFFF)
        _lib.bastion_wide_rows(1, (mask if q8_mask is None else q8_mask) & 0xFFFF)


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True or was never asked)."""
    return _why


def _library_for_weight(weight: torch.Tensor, who: str) -> ctypes.CDLL:
    """The loaded library, after checking `weight` is what the float32 packers read (2-D, CPU, float32)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"native CPU kernel unavailable: {_why}")
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"{who} wants a 2-D CPU float32 weight, got {tuple(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    return lib


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] float32 → panels [ceil(N/16), K, 16] (zero padded): the layout ``linear`` reads."""
    lib = _library_for_weight(weight, "pack")
    w = weight.detach().contiguous()
    n, k = w.shape
    out = torch.empty((n + 15) // 16, k, 16, dtype=torch.float32)
    lib.bastion_pack_f32(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + b`` for x [R, K] (R ≥ 1) from W's panels → [R, n] float32: float32 panels
    (:func:`pack`) or exact compressed ones (:func:`pack_exact`), which give the same bits."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"native CPU kernel unavailable: {_why}")
    r, k = x.shape
    if panels.dtype == torch.bfloat16:
        raise ValueError("bf16 panels are read by linear_h16 / linear_bf16, not linear")
    fn = _product_fn(panels, n, k)
    x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty(r, n, dtype=torch.float32)
    fn(x.data_ptr(), r, panels.data_ptr(), n, k, None if bias is None else bias.data_ptr(), y.data_ptr(),
       torch.get_num_threads())
    return y


# Exact compressed panels (cpu_gemm.c): per 16 outputs and 32 inputs, Q4 = 16 scales, 16 minima
# (float32) and 512 4-bit codes; Q8 = 16 scales and 512 int8 codes. Told apart by dtype.
QBLOCK, Q4_BYTES, Q8_BYTES = 32, 384, 576
_EXACT = {torch.uint8: ("bastion_gemm_q4", Q4_BYTES), torch.int8: ("bastion_gemm_q8", Q8_BYTES)}


def _product_fn(panels: torch.Tensor, n: int, k: int):
    """The C product that reads `panels`, after checking they hold an [n, k] weight."""
    if panels.dtype == torch.float32:
        if panels.dim() != 3 or panels.shape[1] != k or panels.shape[2] != 16 or panels.shape[0] * 16 < n:
            raise ValueError(f"panels {tuple(panels.shape)} do not hold a [{n}, {k}] weight")
        return _lib.bastion_gemm_f32
    if panels.dtype in _EXACT:
        name, nbytes = _EXACT[panels.dtype]
        if panels.dim() != 3 or panels.shape[1] * QBLOCK != k or panels.shape[2] != nbytes \
                or panels.shape[0] * 16 < n:
            raise ValueError(f"compressed panels {tuple(panels.shape)} {panels.dtype} do not hold a [{n}, {k}] weight")
        return getattr(_lib, name)
    if panels.dtype == torch.bfloat16 and panels.dim() == 3:  # bf16 weights widened in registers (pack_h16)
        if panels.shape[1] != k or panels.shape[2] != 16 or panels.shape[0] * 16 < n:
            raise ValueError(f"bf16 panels {tuple(panels.shape)} do not hold a [{n}, {k}] weight")
        return _lib.bastion_gemm_h16
    if panels.dtype == torch.bfloat16 and panels.dim() == 4:  # bf16 pairs (pack_bf16): x rounded too
        if not bf16_available():
            raise RuntimeError("bf16 pair panels need AVX512-BF16, which this CPU lacks")
        if panels.shape[1] * 2 != k or panels.shape[2:] != (16, 2) or panels.shape[0] * 16 < n:
            raise ValueError(f"bf16 pair panels {tuple(panels.shape)} do not hold a [{n}, {k}] weight")
        return _lib.bastion_gemm_bf16
    raise ValueError(f"panels of dtype {panels.dtype} are not float32, exact compressed or bf16 panels")


def pack_exact(weight: torch.Tensor) -> torch.Tensor | None:
    """W [N, K] float32 → exact compressed panels, or None when W is not exactly representable.

    Weights dequantised from llama.cpp's Q4_1 or Q8_0 blocks (the embedded SmolLM2's matrices and its
    LM head) take at most 16 or 256 values per 32 inputs of an output: their scales, minima and codes
    are recovered per block and kept only if decoding gives back every weight bit for bit (Q4_1 is
    tried first, then Q8_0) — uint8 panels [ceil(N/16), K/32, 384] (0.75 bytes a weight) or int8
    [ceil(N/16), K/32, 576] (1.125). :func:`linear` over them returns the bits of the float32 product,
    reading 5.3× or 3.6× fewer bytes. None for any other weight (random, trained, K % 32 ≠ 0)."""
    lib = _library_for_weight(weight, "pack_exact")
    n, k = weight.shape
    if n == 0 or k == 0 or k % QBLOCK:
        return None
    w = weight.detach().contiguous()
    shape = ((n + 15) // 16, k // QBLOCK)
    for dtype, (_, nbytes) in _EXACT.items():
        out = torch.empty(*shape, nbytes, dtype=dtype)
        fit = lib.bastion_pack_q4 if dtype == torch.uint8 else lib.bastion_pack_q8
        if fit(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads()) == 0:  # 0: every weight exact
            return out
    return None


class Product:
    """One weight's product (:func:`linear`, :func:`linear_h16`, :func:`linear_bf16`) with its checks
    made once, for a hot loop.

    ``Product(panels, n, bias)(x, threads)`` = ``linear(x, panels, n, bias)`` for x [R, K] float32 on
    the CPU with K = the weight's inputs — the caller's promise (only contiguity is checked). The same
    kernel and arguments, so the same bits; what it drops is ~20 µs of Python a call (module dispatch,
    the fast-path and panel checks, reshapes): ~5 ms of a 40 ms one-row step of the embedded target,
    whose 210 products it runs (``target_lean.lean_forward``). Float32 or exact compressed panels
    (:func:`pack_exact`), or a drafter's bf16 panels (:func:`pack_h16`; :func:`pack_bf16`, whose
    inputs are rounded to bf16 as :func:`linear_bf16` rounds them). Holds its panels (and bias), so
    they outlive the module's own cache of them until the caller drops the product."""

    __slots__ = ("panels", "bias", "n", "k", "_pp", "_bp", "_fn", "_kc", "_cast")

    def __init__(self, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None):
        if library() is None:
            raise RuntimeError(f"native CPU kernel unavailable: {_why}")
        pairs = panels.dtype == torch.bfloat16 and panels.dim() == 4
        k = (panels.shape[1] * 2 if pairs else
             panels.shape[1] * (QBLOCK if panels.dtype in _EXACT else 1) if panels.dim() == 3 else -1)
        self._fn = _product_fn(panels, n, k)
        # the pair kernel counts inputs in pairs and reads them as bf16
        self._kc, self._cast = (k // 2, torch.bfloat16) if pairs else (k, None)
        if bias is not None and (bias.dtype != torch.float32 or bias.numel() != n):
            raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} is not {n} float32 values")
        self.panels, self.n, self.k = panels.contiguous(), n, k
        self.bias = None if bias is None else bias.detach().contiguous()
        self._pp = self.panels.data_ptr()
        self._bp = None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        if self._cast is not None:
            x = x.to(self._cast)
        if not x.is_contiguous():  # the one check kept: a strided view would be read as rows of K
            x = x.contiguous()
        r = x.shape[0]
        y = torch.empty(r, self.n, dtype=torch.float32)
        self._fn(x.data_ptr(), r, self._pp, self.n, self._kc, self._bp, y.data_ptr(), threads)
        return y


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (K even) → bf16 panels [ceil(N/16), K/2, 16, 2], rounded to nearest even: the layout
    :func:`linear_bf16` reads (for each pair of inputs, 16 outputs' two weights side by side)."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.shape[1] % 2:
        raise ValueError(f"pack_bf16 wants a 2-D CPU weight with an even number of columns, got "
                         f"{tuple(weight.shape)} on {weight.device}")
    k = weight.shape[1]
    return _bf16_padded(weight).view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def _bf16_padded(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] rounded to bf16 (nearest even) with zero rows up to a multiple of 16: what both bf16
    panel layouts are cut from."""
    n, k = weight.shape
    w = weight.detach().to(torch.bfloat16)
    pad = (-n) % 16
    return torch.cat([w, w.new_zeros(pad, k)]) if pad else w


def linear_bf16(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + b`` with x and W rounded to bf16 and float32 sums, x [R, K] → [R, n] float32.

    For drafters only: the result differs from the float32 product by ~3e-3 relative (bf16's 8-bit
    mantissa), which changes proposals at most, never what verification accepts."""
    lib = library()
    if lib is None or not bf16_available():
        raise RuntimeError(f"bf16 native kernel unavailable: {_why or 'the CPU lacks AVX512-BF16'}")
    r, k = x.shape
    if panels.dtype != torch.bfloat16 or panels.shape[1] * 2 != k or panels.shape[0] * 16 < n:
        raise ValueError(f"bf16 panels {tuple(panels.shape)} do not hold a [{n}, {k}] weight")
    xb = x.to(torch.bfloat16).contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty(r, n, dtype=torch.float32)
    lib.bastion_gemm_bf16(xb.data_ptr(), r, panels.data_ptr(), n, k // 2,
                          None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y


def pack_h16(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] → bf16 panels [ceil(N/16), K, 16] (torch's rounding to nearest even, zero padded): the
    float32 panel layout with each weight in two bytes, which :func:`linear_h16` widens in registers."""
    if weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"pack_h16 wants a 2-D CPU weight, got {tuple(weight.shape)} on {weight.device}")
    k = weight.shape[1]
    return _bf16_padded(weight).view(-1, 16, k).transpose(1, 2).contiguous()


def linear_h16(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + b`` with W rounded to bf16 (:func:`pack_h16`), x and the sums float32, x [R, K] → [R, n].

    For drafters on CPUs without AVX512-BF16 (AVX2 laptops, the Zen 3): half the bytes of the float32
    panels, each weight widened exactly, the FMAs and their order those of :func:`linear` — so the
    result is, bit for bit, the float32 kernel's product with the bf16-rounded weight (test)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"native CPU kernel unavailable: {_why}")
    r, k = x.shape
    if panels.dtype != torch.bfloat16 or panels.dim() != 3 or panels.shape[1] != k or panels.shape[2] != 16 \
            or panels.shape[0] * 16 < n:
        raise ValueError(f"bf16 panels {tuple(panels.shape)} do not hold a [{n}, {k}] weight")
    x = x.to(torch.float32).contiguous()
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    y = torch.empty(r, n, dtype=torch.float32)
    lib.bastion_gemm_h16(x.data_ptr(), r, panels.data_ptr(), n, k, None if bias is None else bias.data_ptr(),
                         y.data_ptr(), torch.get_num_threads())
    return y


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """Attention of a few queries over the cache, each (head, query) pair on its own (cpu_gemm.c).

    query [1, H, n, d], key / value [1, G, L, d] (G divides H: grouped-query heads read KV head
    h // (H / G)), mask [1, 1, n, L] additive float32 (entries ≤ −1e30 hide a key) or None (every query
    sees every key: a decoding step's one query, a drafter's block) → [1, n, H, d] float32 (the layout
    transformers' attention functions return). A
    row's output depends only on its query and on the sequence of keys and values its mask row leaves
    visible: not on the other rows of the call, nor on where the hidden keys sit."""
    b, heads, n, d = query.shape
    tensors = (query, key, value) + (() if mask is None else (mask,))
    if (b != 1 or key.shape != value.shape or key.shape[0] != 1 or key.shape[3] != d or heads % key.shape[1]
            or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors)
            or (mask is not None and (mask.dim() != 4 or tuple(mask.shape[:3]) != (1, 1, n)
                                      or mask.shape[3] != key.shape[2]))):
        raise ValueError(f"attention wants CPU float32 query [1, H, n, d], key/value [1, G, L, d] and mask "
                         f"[1, 1, n, L] or None; got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}, {None if mask is None else tuple(mask.shape)}")
    if library() is None:
        raise RuntimeError(f"native CPU kernel unavailable: {_why}")
    return attention_unchecked(query, key, value, mask, scale)


def attention_unchecked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    """:func:`attention` for callers that checked its conditions (the per-layer hot path: ~30 calls a
    forward, where the checks cost a third of a small call)."""
    # the kernel reads rows of d contiguous floats; any other strides are passed through
    if query.stride(3) != 1:
        query = query.contiguous()
    if key.stride(3) != 1:
        key = key.contiguous()
    if value.stride(3) != 1:
        value = value.contiguous()
    if mask is not None and mask.stride(3) != 1:
        mask = mask.contiguous()
    _, heads, n, d = query.shape
    qs, ks, vs = query.stride(), key.stride(), value.stride()
    out = torch.empty(1, n, heads, d, dtype=torch.float32)
    rc = _lib.bastion_attn_f32(query.data_ptr(), qs[1], qs[2], key.data_ptr(), ks[1], ks[2], value.data_ptr(),
                               vs[1], vs[2], None if mask is None else mask.data_ptr(),
                               0 if mask is None else mask.stride(2), out.data_ptr(), heads, key.shape[1], n,
                               key.shape[2], d, scale, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("native attention: no memory for its scratch rows")
    return out
