"""Timing: the per-stage timer of a round, and the latency probe that measures a target's row costs
once per engine (the row-padding table and the anchors of C(n); ``Engine.prepare`` decides when)."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch

from .latency import LatencyModel, RowPadding
from .records import StageTimes
from .target import Target

PROBE_ROWS = 16          # probe_latency times every row count 1..PROBE_ROWS (RowPadding) ...
PROBE_SIZES = (32, 64)   # ... and these larger trees, so C(n)'s slope is measured
# ... after this many context tokens: a decode's typical context (prompt + up to 128 new tokens), not
# a nearly empty cache — at 32 tokens the rows' costs ranked differently (3 rows dearer than 4) than
# at 150, and trees were padded into dearer row counts (bench/NOTES.md, session 12)
PROBE_CONTEXT = 128
PROBE_REPEATS = 5


class Timer:
    """Accumulates wall time per stage; synchronises CUDA so GPU work is counted where it runs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    @contextmanager
    def __call__(self, times: StageTimes, stage: str):
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            setattr(times, stage, getattr(times, stage) + time.perf_counter() - t0)


def _time_forward(target: Target, kernels, timer: Timer, s: int, context: int) -> float:
    """Seconds of one verification of an s-node chain after ``context`` cached tokens (cache kept)."""
    mask, pos = kernels.tree_mask(list(range(-1, s - 1)), context, target.dtype, target.device)
    t = StageTimes()
    with timer(t, "verify"):
        target.forward_tree(torch.arange(s, device=target.device) % target.vocab_size, mask, pos)
    target.commit(context, [])
    return t.verify


def _with_row(mask: int, s: int, wide: bool) -> int:
    """``mask`` with the bit of s rows (bit s − 1) set when ``wide``, cleared otherwise."""
    return mask | (1 << (s - 1)) if wide else mask & ~(1 << (s - 1))


def tune_wide_rows(target: Target, kernels, timer: Timer, max_rows: int = PROBE_ROWS,
                   context: int = PROBE_CONTEXT, repeats: int = 3) -> int | None:
    """Pick, per row count 1..16, the faster of the native kernel's two equivalent paths for exact
    4/8-bit products (512-bit or 256-bit registers, :func:`cpu_native.set_wide_rows`), by timing
    whole verifications both ways (a warm-up pass, then ``repeats`` passes, the two ways alternated;
    each way's median; with two passes a noisy host flipped a row count of 1–7 in 3 of 4 tunes, with
    three in none of 5 — session 36). Which is faster depends on the CPU, not on the model: on the
    2-core Xeon the 512-bit path tied at 1–6 rows and won by ~30% at 7–16; on a 2-core Zen 4, which splits a 512-bit
    operation in two, the 256-bit path won by 5–13% at 1–7 rows and lost by 5–14% at 8–16
    (session 36) — the trees Bastion verifies there. Both give the same bits, so this changes speed
    only. Returns the mask set for the 4-bit products, or None (nothing to choose: no 512-bit path,
    not a CPU target, or no exact panels); the 8-bit ones then get their own (:func:`_tune_q8_rows`,
    kept in ``target.wide_rows_q8``). Measured once per target for the row counts 1..``max_rows``: engines that share one
    (the benchmark's ``engine_b``, the app's engine remade for another drafter) set its mask again
    instead of re-timing, so every engine's row costs are the same path's; a call for more row counts
    than were timed (an AR engine times one, ``Engine.prepare``; a probe all 16) times them all.
    Leaves the cache empty."""
    from .kernels import cpu_linear, cpu_native

    if target.device.type != "cpu" or cpu_native.wide_rows() is None:
        return None
    full, sizes = 0xFFFF, list(range(1, max(1, min(max_rows, 16, target.max_positions - 2)) + 1))
    if target.wide_rows_timed >= len(sizes):  # chosen before (None: nothing to choose on this target)
        if target.wide_rows is not None:
            cpu_native.set_wide_rows(target.wide_rows, target.wide_rows_q8)
        return target.wide_rows
    context = max(1, min(context, target.max_positions - sizes[-1] - 1))  # as probe_latency's
    target.prefill(torch.arange(context, device=target.device) % target.vocab_size)
    if not cpu_linear.exact_products(target.model):  # panels exist once a forward has run
        target.reset()
        target.wide_rows_timed = 16  # and an AR engine's every request must not prefill again to learn it
        return None
    times: dict[tuple[int, int], list[float]] = {}
    for rep in range(repeats + 1):
        for s in sizes:
            for wide in ((1, 0) if (rep + s) % 2 else (0, 1)):
                cpu_native.set_wide_rows(_with_row(full, s, wide))
                dt = _time_forward(target, kernels, timer, s, context)
                if rep > 0:
                    times.setdefault((s, wide), []).append(dt)
    target.reset()
    mask = full  # row counts not timed keep the 512-bit path
    for s in sizes:
        mask = _with_row(mask, s, statistics.median(times[(s, 1)]) <= statistics.median(times[(s, 0)]))
    q8 = _tune_q8_rows(target, sizes, mask)
    cpu_native.set_wide_rows(mask, q8)
    target.wide_rows, target.wide_rows_q8, target.wide_rows_timed = mask, q8, len(sizes)
    return mask


def _tune_q8_rows(target: Target, sizes: list[int], mask: int, repeats: int = 5) -> int:
    """The 8-bit products' own mask, starting from ``mask``: a model's 8-bit matrices (the embedded
    target's LM head, 49,152 × 576) favour the other path than its 4-bit ones at some row counts — on
    the Zen 4 the head took 0.93 ms at one row on 512 bits against 1.17 on 256, while the 4-bit
    matrices ran ~15% faster on 256 (session 37) — and a whole verification hides a 0.2 ms difference
    in its noise. So these products are timed alone, each way per row count (``repeats`` passes after
    a warm-up, the ways alternated, medians)."""
    from .kernels import cpu_linear, cpu_native

    heads = [cpu_native.Product(m.panels(), m.weight.shape[0]) for m in cpu_linear.exact_q8_layers(target.model)]
    if not heads:
        return mask
    threads, g = torch.get_num_threads(), torch.Generator().manual_seed(0)  # not the global stream
    q8 = mask
    for s in sizes:
        xs = [torch.randn(s, p.k, generator=g) for p in heads]
        times: dict[int, list[float]] = {0: [], 1: []}
        for rep in range(repeats + 1):
            for wide in ((1, 0) if (rep + s) % 2 else (0, 1)):
                cpu_native.set_wide_rows(mask, _with_row(q8, s, wide))
                t0 = time.perf_counter()
                for p, x in zip(heads, xs):
                    p(x, threads)
                if rep > 0:
                    times[wide].append(time.perf_counter() - t0)
        q8 = _with_row(q8, s, statistics.median(times[1]) <= statistics.median(times[0]))
    return q8


def probe_latency(target: Target, kernels, timer: Timer, latency: LatencyModel, max_rows: int = PROBE_ROWS,
                  sizes: tuple[int, ...] = PROBE_SIZES, context: int = PROBE_CONTEXT,
                  repeats: int = PROBE_REPEATS) -> RowPadding:
    """Time verifications of 1..max_rows rows and of a few larger trees on a dummy context.

    Two uses of the same forwards. (1) The row-padding table (:class:`RowPadding`): on a CPU a
    forward over 3 rows can cost more than over 5, and the engine then runs small trees padded.
    (2) C(n)'s slope: online calibration fits C(n) from the rounds that ran, but a slope needs
    different n; after AR rounds only (n = 1), or on a fresh engine, C(n) would come from the
    analytic prior alone. The timings fed to the model are also kept as its anchors
    (:attr:`LatencyModel.anchors`), fed in again, scaled to the host's present speed, whenever
    its window alone cannot tell the slope. Sizes are timed in passes (a warm-up pass, then
    ``repeats`` timed ones, each in a rotated order so drift hits every size alike); each size
    keeps its median time. (Its fastest, used until session 14, is an extreme value: on a loaded
    host a lucky pass made 10 rows look cheaper than 8 or 9 and two rows cheaper than one, and the
    table padded trees and AR's steps to row counts that cost more in the run that followed;
    bench/NOTES.md.) The latency model is fed the sizes padding keeps plus ``sizes``. For the
    embedded target on 2 CPU cores a few seconds (~12 s on an AVX2 one). Leaves the cache empty;
    returns the padding table.
    """
    max_rows = max(1, min(max_rows, target.max_positions - 2))
    sizes = [s for s in sizes if max_rows < s and s + 2 <= target.max_positions]
    every = list(range(1, max_rows + 1)) + sizes
    context = max(1, min(context, target.max_positions - max(every) - 1))
    target.prefill(torch.arange(context, device=target.device) % target.vocab_size)
    times: dict[int, list[float]] = {s: [] for s in every}
    for rep in range(repeats + 1):
        shift = (rep * 7) % len(every)
        for s in every[shift:] + every[:shift]:  # chains: the mask's shape does not change the cost
            dt = _time_forward(target, kernels, timer, s, context)
            if rep > 0:
                times[s].append(dt)
    target.reset()
    best = {s: statistics.median(v) for s, v in times.items()}
    padding = RowPadding.from_times([best[m] for m in range(1, max_rows + 1)])
    latency.observe_many([(s, context, best[s]) for s in sorted(set(padding.padded) | set(sizes))], anchor=True)
    return padding


DRAFTER_MODES = ("native-bf16", "native-f32")  # the drafter's default (bf16, half the bytes) and float32
DRAFTER_MARGIN = 0.03  # float32 must be this much faster to be chosen (a noisy near-tie stays bf16)


def set_drafter_products(drafter, mode: str) -> None:
    """Put the drafter's linear layers in ``mode`` (one of ``cpu_linear.MODES``), or with ``"auto"`` in
    its default bf16 panels and leave the choice to :func:`tune_drafter_products` (the engine's probe);
    a named mode is kept there."""
    from .kernels.cpu_linear import use_skinny_linear

    use_skinny_linear(drafter, "native-bf16" if mode == "auto" else mode)
    drafter.tune_products = mode == "auto"


def tune_drafter_products(drafter, target: Target, context: int = PROBE_CONTEXT, repeats: int = 3,
                          drafts: int = 3, fresh: int = 3) -> str | None:
    """Set a CPU drafter's products to the faster of bf16 panels (mode ``native-bf16``, its default:
    half the bytes; AVX512-BF16 pairs where the CPU has them) and float32 panels (``native-f32``),
    timed here; returns the mode set, or None when there is nothing to choose (no drafter, one whose
    mode a caller set — ``drafter.tune_products`` off —, not a CPU float32 drafter, no native kernel).

    Which is faster depends on the host: on the EPYCs bf16 drafts won (session 14); on the 2-core Xeon
    with AVX512-BF16 and AMX float32 won while only it ran all layers in one native call (session 46:
    2.06 against 2.27 ms a draft). Since session 55 the bf16 pairs run in that one call too: on the
    2-core Xeon without AMX, drafts inside a Bastion run went 5.33 → 4.59 ms (medians, all 30 eval
    prompts), the probe now choosing bf16. Both are proposals only — verification decides what is
    kept — so this moves speed and, within bf16 rounding, which tokens are drafted; never the output.

    Timing: drafts of the whole block after ``context`` random context features, each with ``fresh``
    tokens' features queued (a round encodes the last round's accepted tokens inside its draft, as
    :meth:`DrafterCache.defer` does), cropped back after each. ``repeats`` passes after a warm-up, the
    modes alternated, each mode's first draft after a switch (panels repacked) not counted; each mode
    keeps its median, kept in ``drafter.products_probe`` [s]. float32 is kept only when faster by
    :data:`DRAFTER_MARGIN`. Once per drafter: engines that share it keep its choice (~0.2 s)."""
    from .kernels import cpu_native
    from .kernels.cpu_linear import use_skinny_linear

    if drafter is None or not getattr(drafter, "tune_products", False):
        return None
    w = drafter.fc.weight
    if w.device.type != "cpu" or w.dtype != torch.float32 or not cpu_native.available():
        return None
    if drafter.products_probe is not None:  # chosen before, by another engine on this drafter
        return "native-bf16" if drafter.low_precision else "native-f32"
    block = drafter.block_size
    context = max(1, min(context, target.max_positions - block - fresh - 1))
    g = torch.Generator().manual_seed(0)  # not the global stream: sampling runs must not move
    width = len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size
    feats = torch.randn(context + fresh, width, generator=g)
    cache = drafter.new_cache()
    drafter.extend_cache(cache, feats[:context])
    times: dict[str, list[float]] = {m: [] for m in DRAFTER_MODES}
    for rep in range(repeats + 1):
        for mode in DRAFTER_MODES if rep % 2 else DRAFTER_MODES[::-1]:
            use_skinny_linear(drafter, mode)
            for i in range(drafts + 1):
                cache.crop(context)
                cache.defer(feats[context:])
                t0 = time.perf_counter()
                drafter.draft(cache, 1, target.embed, target.lm_head)
                if rep > 0 and i > 0:
                    times[mode].append(time.perf_counter() - t0)
    med = {m: statistics.median(v) for m, v in times.items()}
    best = "native-f32" if med["native-f32"] < (1 - DRAFTER_MARGIN) * med["native-bf16"] else "native-bf16"
    use_skinny_linear(drafter, best)
    drafter.products_probe = med
    return best
