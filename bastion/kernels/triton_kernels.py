"""Triton implementations of the three verification operations (signatures as in :mod:`.reference`).

* :func:`node_choice`: one program per (node, vocabulary chunk) streams the logits in tiles of
  ``BLOCK`` tokens, keeping a running (max, argmax). For T > 0 the Gumbel noise of each token is
  computed in registers from the same counter-based hash as :func:`.reference.uniform_stream`, so
  neither a softmax nor a noise tensor is ever materialised and the sample equals the torch
  reference's for the same (seed, offset). When the vocabulary is split over several programs
  (few nodes on a big GPU), a second tiny kernel combines the per-chunk winners.
* :func:`tree_walk`: a single program computes, for every node, whether its token equals the
  target's choice at its parent, propagates "the whole path matches" with pointer jumping
  (log2 n rounds of register gathers) and scatters the accepted path root-first.
* :func:`tree_mask`: one program per row (a block of rows under the interpreter) computes all
  depths by pointer jumping, lifts the row's node to every column's depth with binary lifting
  (column j is allowed iff it is the row node's ancestor-or-self) and writes the whole row, the
  cached-prefix columns included, and the row's position id.

Exactness notes (the Triton and torch samples must agree bit for bit):

* Tempered logits: the kernel must divide by T exactly as torch's ``logits.float() / T`` does on the
  tensor's device, or a tempered logit equal to its top-k / top-p threshold is kept by one backend
  and dropped by the other. Torch on CUDA multiplies by a float32 reciprocal (torch 2.11 on an
  H200: ``float32(1 / T)`` rounded once from float64; older sources show ``1 / float32(T)``), torch on
  the CPU divides. ``_tempering`` finds out once per device and temperature by running torch's
  division on probe values, then picks the kernel's multiply (by the matching reciprocal) or its
  correctly rounded division; if none reproduces torch bit for bit, torch tempers the logits and the
  kernel multiplies by 1.
* FP contraction is disabled for the sampling kernel (no fused multiply-add), so every float op is
  rounded as in torch's separate element-wise kernels; ``tl.log`` lowers to libdevice's ``logf``
  on NVIDIA GPUs, the function torch's CUDA ``log`` uses. Under the CPU interpreter, numpy's and
  torch's ``log`` may differ in the last bit, which can only flip a sample at a near tie.
* NaN logits are not supported (torch.argmax treats NaN as the maximum; the kernel ignores it).

Triton runs on CPU tensors only under its interpreter, which the *caller* enables by setting
``TRITON_INTERPRET=1`` before triton is imported; this module never touches the environment.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import Kernels

_MASK32 = 0xFFFFFFFF


def _as_i32(value: int) -> int:
    """The low 32 bits of ``value`` as a signed int32, so every call passes the same argument type;
    the kernel reinterprets it as uint32."""
    value &= _MASK32
    return value - (1 << 32) if value >= (1 << 31) else value


# ---------------------------------------------------------------------------------------------
# node_choice
# ---------------------------------------------------------------------------------------------


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (wrap-around multiply, logical shifts), as reference._mix32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


# sizes, seeds and the temperature vary from call to call: never specialise (recompile) on them
@triton.jit(do_not_specialize=["V", "chunk", "split", "temp", "seed_lo", "seed_hi", "offset_lo"])
def _node_choice_kernel(logits_ptr, stride_row, thr_ptr, ctr_ptr, val_ptr, idx_ptr, V, chunk, split, temp,
                        seed_lo, seed_hi, offset_lo,
                        PARTIAL: tl.constexpr, BLOCK: tl.constexpr, SAMPLE: tl.constexpr,
                        HAS_THR: tl.constexpr, RECIPROCAL: tl.constexpr, HAS_CTR: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    start = part * chunk
    end = tl.minimum(start + chunk, V)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lane = tl.arange(0, BLOCK)

    if SAMPLE:
        if HAS_CTR:  # explicit per-row counters (the engine passes each node's position)
            counter = tl.load(ctr_ptr + row).to(tl.uint32)
        else:
            counter = offset_lo.to(tl.uint32) + row.to(tl.uint32)  # (offset + i) mod 2^32
        key = _mix32(_mix32(counter ^ seed_lo.to(tl.uint32)) + seed_hi.to(tl.uint32))
        if HAS_THR:
            thr = tl.load(thr_ptr + row).to(tl.float32)

    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = start  # the first index of the chunk: what argmax returns when everything is -inf
    for s in range(start, end, BLOCK):
        cols = s + lane
        inside = cols < end
        x = tl.load(row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32)
        if SAMPLE:
            if RECIPROCAL:
                x = x * temp  # temp holds a float32 reciprocal of T (see _tempering)
            else:
                x = tl.div_rn(x, temp)  # a correctly rounded float32 division by T
            if HAS_THR:
                x = tl.where(x < thr, float("-inf"), x)
            h = _mix32(key ^ _mix32(cols.to(tl.uint32) + 0x9E3779B9))
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # reference.bits_to_unit: u in (0, 1)
            x = x + (-tl.log(-tl.log(u)))
            x = tl.where(inside, x, float("-inf"))
        tile_max = tl.max(x, axis=0)
        tile_idx = tl.min(tl.where(x == tile_max, cols, 2147483647), axis=0)
        better = tile_max > best_val  # strict: an earlier tile wins ties, as torch.argmax
        best_idx = tl.where(better, tile_idx, best_idx)
        best_val = tl.where(better, tile_max, best_val)

    if PARTIAL:  # one winner per chunk; _combine_kernel picks the row's winner
        tl.store(val_ptr + row * split + part, best_val)
        tl.store(idx_ptr + row * split + part, best_idx)
    else:
        tl.store(idx_ptr + row, best_idx.to(tl.int64))


@triton.jit(do_not_specialize=["split"])
def _combine_kernel(val_ptr, idx_ptr, out_ptr, split, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    p = tl.arange(0, BLOCK_S)
    inside = p < split
    v = tl.load(val_ptr + row * split + p, mask=inside, other=float("-inf"))
    i = tl.load(idx_ptr + row * split + p, mask=inside, other=2147483647)
    best = tl.max(v, axis=0)
    # chunks are in vocabulary order, so the smallest index among the maxima is the first maximum
    tl.store(out_ptr + row, tl.min(tl.where(v == best, i, 2147483647), axis=0).to(tl.int64))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _choose_block_split(n: int, vocab: int, device: torch.device) -> tuple[int, int]:
    if _INTERPRETED or device.type != "cuda":  # the interpreter: few, large numpy steps
        return min(triton.next_power_of_2(vocab), 16384), 1
    block = min(triton.next_power_of_2(vocab), 2048)
    index = device.index if device.index is not None else torch.cuda.current_device()
    target = 4 * _sm_count(index)  # enough programs to fill the GPU when there are few nodes
    split = max(1, min(triton.cdiv(target, max(n, 1)), triton.cdiv(vocab, 2 * block)))
    return block, split


_TEMPERING: dict[tuple[str, int | None, float], str] = {}


def _reciprocals(temperature: float) -> dict[str, float]:
    """The float32 reciprocals torch builds use: 1 / float32(T) in float32, or 1 / T in float64
    rounded once to float32 (they differ for T = 1.1, say)."""
    t32 = torch.tensor(temperature, dtype=torch.float32)
    return {"reciprocal32": float(torch.tensor(1.0, dtype=torch.float32) / t32),
            "reciprocal64": float(torch.tensor(1.0 / temperature, dtype=torch.float32))}


def _tempering(device: torch.device, temperature: float) -> str:
    """How torch computes ``x / temperature`` for float32 x on ``device``: "reciprocal32" or
    "reciprocal64" (x times that float32 reciprocal, see ``_reciprocals``), "divide" (a correctly
    rounded division) or "other"; measured once per device and T."""
    key = (device.type, device.index, temperature)
    if key not in _TEMPERING:
        gen = torch.Generator().manual_seed(12345)
        probe = (torch.randn(8192, generator=gen) * 16).to(device)
        got = probe / temperature  # the expression callers use for the thresholds
        t32 = float(torch.tensor(temperature, dtype=torch.float32))
        mode = next((name for name, inv in _reciprocals(temperature).items() if torch.equal(got, probe * inv)), None)
        if mode is None:  # float64 division rounded once: the correctly rounded float32 quotient
            mode = "divide" if torch.equal(got, (probe.double() / t32).float()) else "other"
        _TEMPERING[key] = mode
    return _TEMPERING[key]


def _node_choice(logits: torch.Tensor, temperature: float, thresholds: torch.Tensor | None = None,
                 seed: int = 0, offset: int = 0, counters: torch.Tensor | None = None, *, block: int | None = None,
                 split: int | None = None) -> torch.Tensor:
    """node_choice with explicit tiling (``block`` tokens per step, vocabulary ``split`` ways)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if vocab == 0:
        raise ValueError("node_choice needs a non-empty vocabulary")
    home = logits.device
    sample = temperature > 0.0
    mode = _tempering(home, temperature) if sample else "reciprocal32"
    if mode == "other":  # torch tempers, the kernel multiplies by 1 (exact)
        logits, temperature, mode = logits.float() / temperature, 1.0, "reciprocal32"
    reciprocal = mode.startswith("reciprocal")
    logits = logits.to(launch_device(home))
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    auto_block, auto_split = _choose_block_split(n, vocab, logits.device)
    block = auto_block if block is None else block
    if block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    split = auto_split if split is None else split
    chunk = triton.cdiv(triton.cdiv(vocab, max(1, split)), block) * block  # whole tiles per chunk
    split = triton.cdiv(vocab, chunk)

    if sample:
        temp = _reciprocals(temperature)[mode] if reciprocal else float(torch.tensor(temperature, dtype=torch.float32))
    else:
        temp = 1.0
    has_thr = sample and thresholds is not None
    thr = thresholds.to(device=logits.device, dtype=torch.float32).contiguous() if has_thr else out
    has_ctr = sample and counters is not None
    # counters are taken mod 2^32, as in the reference; int32 storage keeps the low 32 bits
    ctr = ((counters.to(torch.int64) & 0xFFFFFFFF) - ((counters.to(torch.int64) & 0x80000000) << 1)).to(
        device=logits.device, dtype=torch.int32).contiguous() if has_ctr else out

    if split == 1:
        val, idx = out, out
    else:
        val = torch.empty(n, split, dtype=torch.float32, device=logits.device)
        idx = torch.empty(n, split, dtype=torch.int32, device=logits.device)
    _node_choice_kernel[(n, split)](
        logits, logits.stride(0), thr, ctr, val, idx, vocab, chunk, split, temp,
        _as_i32(seed), _as_i32(seed >> 32), _as_i32(offset),
        PARTIAL=split > 1, BLOCK=block, SAMPLE=sample, HAS_THR=has_thr, RECIPROCAL=reciprocal, HAS_CTR=has_ctr,
        num_warps=8 if block >= 2048 else 4, enable_fp_fusion=False)
    if split > 1:
        _combine_kernel[(n,)](val, idx, out, split, BLOCK_S=max(2, triton.next_power_of_2(split)),
                              num_warps=1, enable_fp_fusion=False)
    return out.to(home)


def node_choice(logits: torch.Tensor, temperature: float, thresholds: torch.Tensor | None = None,
                seed: int = 0, offset: int = 0, counters: torch.Tensor | None = None) -> torch.Tensor:
    """One token per node, int64 [n]: argmax (T = 0) or the Gumbel-max sample of the shared stream.

    Same contract as :func:`.reference.node_choice_torch`; thresholds are tempered-logit
    thresholds from :func:`.reference.filter_thresholds` (computed from ``logits.float() / T``).
    """
    return _node_choice(logits, temperature, thresholds, seed, offset, counters)


# ---------------------------------------------------------------------------------------------
# tree_walk
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tree_walk_kernel(meta_ptr, choices_ptr, out_ptr, n, BLOCK_N: tl.constexpr, LOG_N: tl.constexpr):
    j = tl.arange(0, BLOCK_N)
    valid = j < n
    par = tl.load(meta_ptr + j, mask=valid, other=-1).to(tl.int32)
    tok = tl.load(meta_ptr + n + j, mask=valid, other=0).to(tl.int64)
    has_par = valid & (par >= 0)
    parent_choice = tl.load(choices_ptr + par, mask=has_par, other=0).to(tl.int64)
    ok = tl.where(has_par, (tok == parent_choice).to(tl.int32), 0)
    ok = tl.where(j == 0, 1, ok)  # the root is always accepted
    up = tl.where(has_par, par, j)  # the root and the padding point at themselves
    depth = has_par.to(tl.int32)
    # pointer jumping: after round k, ok[j] = AND of the matches over 2^k path nodes above j
    for _ in tl.static_range(LOG_N):
        ok = ok & tl.gather(ok, up, 0)
        depth = depth + tl.gather(depth, up, 0)
        up = tl.gather(up, up, 0)
    # accepted nodes form one root path (siblings carry distinct tokens): keep the deepest
    d = tl.where(ok != 0, depth, -1)
    deepest_depth = tl.max(d, axis=0)
    deepest = tl.max(tl.where(d == deepest_depth, j, -1), axis=0)
    bonus = tl.load(choices_ptr + deepest).to(tl.int64)
    tl.store(out_ptr, (deepest_depth + 1).to(tl.int64))
    tl.store(out_ptr + 1, bonus)
    tl.store(out_ptr + 2 + depth, j.to(tl.int64), mask=ok != 0)


def launch_device(device) -> torch.device:
    """Where the kernels run for data living on ``device``.

    Compiled Triton needs GPU tensors: CPU data is then processed on the current GPU (and the
    result moved back by the caller). Under the interpreter, any device works as is.
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cpu" and not _INTERPRETED:
        if not torch.cuda.is_available():
            raise RuntimeError("the Triton kernels need a CUDA GPU, or Triton's interpreter "
                               "(TRITON_INTERPRET=1 set before triton is imported) for CPU tensors")
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _pad(n: int) -> tuple[int, int]:
    block = max(16, triton.next_power_of_2(n))
    return block, block.bit_length() - 1


def tree_walk(parents: list[int], tokens: list[int], choices: torch.Tensor | list[int]) -> tuple[list[int], int]:
    """Accepted node indices (root first) and the bonus token; see :func:`.reference.tree_walk_torch`.

    Assumes parents[i] < i, parents[0] = -1 and distinct sibling tokens.
    """
    n = len(parents)
    if n == 0 or len(tokens) != n:
        raise ValueError("tree_walk needs a non-empty tree with one token per node")
    if isinstance(choices, torch.Tensor):
        device = launch_device(choices.device)
        choices = choices.to(device).contiguous()
    else:
        device = launch_device(None)
        choices = torch.tensor(choices, dtype=torch.int64, device=device)
    if choices.numel() < n:
        raise ValueError(f"need one choice per node: {choices.numel()} choices for {n} nodes")
    meta = torch.tensor(list(parents) + list(tokens), dtype=torch.int64).to(device, non_blocking=True)
    out = torch.empty(n + 2, dtype=torch.int64, device=device)
    block, log_n = _pad(n)
    _tree_walk_kernel[(1,)](meta, choices, out, n, BLOCK_N=block, LOG_N=log_n,
                            num_warps=4, enable_fp_fusion=False)
    res = out.tolist()  # the one device-to-host copy: path length, bonus, path
    length = res[0]
    return res[2:2 + length], int(res[1])


# ---------------------------------------------------------------------------------------------
# tree_mask
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tree_mask_kernel(parents_ptr, mask_ptr, pos_ptr, n, prefix_len, row_stride, neg,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, LOG_N: tl.constexpr,
                      BLOCK_P: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # this program's mask rows
    row_ok = rows < n
    j = tl.arange(0, BLOCK_N)  # tree columns
    valid = j < n
    par = tl.load(parents_ptr + j, mask=valid, other=-1).to(tl.int32)
    has_par = valid & (par >= 0)
    parent = tl.where(has_par, par, j)  # the root and the padding point at themselves
    # depths of all nodes by pointer jumping
    depth = has_par.to(tl.int32)
    up = parent
    for _ in tl.static_range(LOG_N):
        depth = depth + tl.gather(depth, up, 0)
        up = tl.gather(up, up, 0)
    row_depth = tl.sum(tl.where(j[None, :] == rows[:, None], depth[None, :], 0), axis=1)
    # binary lifting: lift each row's node by (its depth - depth_j) steps; it lands on column j
    # iff j is an ancestor-or-self of the row's node
    steps = row_depth[:, None] - depth[None, :]
    cur = tl.where(row_ok, rows, 0)[:, None] + tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.int32)
    up = parent
    for b in tl.static_range(LOG_N):
        take = ((steps >> b) & 1) != 0
        table = tl.broadcast_to(up[None, :], [BLOCK_R, BLOCK_N])
        cur = tl.where(take, tl.gather(table, cur, 1), cur)
        up = tl.gather(up, up, 0)
    allowed = (steps >= 0) & (cur == j[None, :])

    row_ptr = mask_ptr + rows.to(tl.int64)[:, None] * row_stride
    zero = tl.zeros([BLOCK_R, BLOCK_P], dtype=tl.float32).to(mask_ptr.dtype.element_ty)
    lane = tl.arange(0, BLOCK_P)[None, :]
    for s in range(0, prefix_len, BLOCK_P):
        tl.store(row_ptr + s + lane, zero, mask=row_ok[:, None] & (s + lane < prefix_len))
    values = tl.where(allowed, 0.0, neg).to(mask_ptr.dtype.element_ty)
    tl.store(row_ptr + prefix_len + j[None, :], values, mask=row_ok[:, None] & valid[None, :])
    tl.store(pos_ptr + rows, (prefix_len + row_depth).to(tl.int64), mask=row_ok)


def tree_mask(parents: list[int], prefix_len: int, dtype: torch.dtype = torch.float32,
              device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive mask [1, 1, n, prefix_len + n] and position ids [1, n]; see
    :func:`.reference.tree_mask_torch`."""
    n = len(parents)
    if n == 0:
        raise ValueError("tree_mask needs a non-empty tree")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    target = torch.device("cpu") if device is None else torch.device(device)
    run_on = launch_device(target)
    # float64's minimum does not fit the kernel's float32 scalar: build it from a float32 mask
    kernel_dtype = dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
    mask = torch.empty(1, 1, n, prefix_len + n, dtype=kernel_dtype, device=run_on)
    pos = torch.empty(1, n, dtype=torch.int64, device=run_on)
    par = torch.tensor(parents, dtype=torch.int32).to(run_on, non_blocking=True)
    block, log_n = _pad(n)
    # one row per program on a GPU; the interpreter prefers few programs with larger numpy steps
    rows = max(1, min(triton.next_power_of_2(n), 16384 // block)) if _INTERPRETED else 1
    _tree_mask_kernel[(triton.cdiv(n, rows),)](
        par, mask, pos, n, prefix_len, prefix_len + n, float(torch.finfo(kernel_dtype).min),
        BLOCK_R=rows, BLOCK_N=block, LOG_N=log_n, BLOCK_P=256 if _INTERPRETED else 1024,
        num_warps=4, enable_fp_fusion=False)
    if kernel_dtype != dtype:
        mask = torch.full_like(mask, torch.finfo(dtype).min, dtype=dtype).masked_fill_(mask == 0, 0)
    return mask.to(target), pos.to(target)


# triton.jit returns an InterpretedFunction when the interpreter is on (TRITON_INTERPRET=1 was set
# before triton was imported): then kernels accept CPU tensors and prefer few, large steps
_INTERPRETED = type(_node_choice_kernel).__name__ == "InterpretedFunction"

KERNELS = Kernels("triton", node_choice, tree_walk, tree_mask)
