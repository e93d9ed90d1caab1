"""Verification latency: a roofline over the target's shape, calibrated online.

With T_comp = FLOPs(s, c) / F and T_mem = Bytes(s, c) / B for s tree tokens at context length c
(the counts and the device's rates: :mod:`bastion.hardware`), the prediction is

    C(s, c) = max(α_c·T_comp + β_c,  α_m·T_mem + β_m),   α, β ≥ 0.

α and β start from the analytic prior (α = 1, β set by the first measurement) and are refitted
after every timed verification. Two lines cannot follow a curve with kinks — on a CPU the matrix
routine changes with the row count (the embedded target, 2 cores: 4 rows 47 ms, 5 rows 60 ms, 9 rows
67 ms) — so each row count s also keeps a running ratio ρ(s) of measured to roofline time
(interpolated between the counts seen, 1 until any is seen), and the prediction is ρ(s)·C(s, c).
On a GPU, where the curve is smooth, ρ stays near 1. Two things keep ρ honest on a shared machine,
where a verification now and then stalls several-fold (another process, a browser drawing the app's
page on the same cores): each sample's ratio to the current ρ(s) is clipped to [1/2, 2] before the
running average of log ρ (a 10× stall raises ρ by ~15%, not ~3×), and every sample pulls the row counts *not* being
measured a little toward the probe's shape at the host's present level,

    ρ(u) ← ρ(u)·(b(u)·ρ(s)/b(s) / ρ(u))^λ,   b(u) = probe time of u rows / C(u, c_probe),

so a count that a stall once made look dear is not avoided — and so never re-measured — for the
rest of the engine's life. Where the measured cost is not monotone in s
(small matrix products on a CPU), :class:`RowPadding` runs a tree as the cheapest row count at or
above its size, so C is fitted and used on the monotone envelope.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .hardware import HardwareSpec, ModelSpec


SLOPE_RATIO = 4.0  # tree sizes this far apart identify C(n)'s slope


def put_newest(table: dict, key, value, limit: int) -> None:
    """``table[key] = value`` as its newest entry (dicts keep insertion order; pop ``key`` first to move
    it), dropping the oldest past ``limit`` entries — a long-lived app sees many settings."""
    table[key] = value
    if len(table) > limit:
        del table[next(iter(table))]


def _running(old: tuple[float, float], draft_s: float | None, overhead_s: float, rate: float) -> tuple[float, float]:
    """(T_d, T_o) moved toward one round's times by ``rate`` (a 0 starts at the first time; None: no draft)."""
    def step(avg: float, x: float) -> float:
        return x if avg == 0.0 else avg + rate * (x - avg)
    return (old[0] if draft_s is None else step(old[0], draft_s)), step(old[1], overhead_s)


def _spans(points: list[tuple[int, int, float]], ratio: float = SLOPE_RATIO) -> bool:
    """Whether the points' tree sizes lie at least ``ratio`` apart (so a fit can tell the slope)."""
    sizes = [s for s, _, _ in points]
    return bool(sizes) and max(sizes) >= ratio * min(sizes)


@dataclass
class _Branch:
    alpha: float = 1.0
    beta: float = 0.0


@dataclass
class LatencyModel:
    """Calibrated roofline C(s, c) plus running averages of draft time T_d and other overhead T_o.

    ``observe(s, c, seconds)`` adds one timed verification and refits both branches by
    non-negative weighted least squares (recent samples weigh more, the α prior acts as a ridge),
    assigning each sample to the branch that currently predicts the larger time. Once the window
    holds ``2·refit_every`` samples the refit runs every ``refit_every``-th sample (a refit walks the
    whole window: ~0.3 ms of Python a round on the 2-core CPU, where one sample moves a 128-sample fit
    little); the per-size ratio ρ(s) follows every sample. The fit is robust to stalls: a sample
    whose log-ratio to the current fit lies more than log ``shape_step`` from the window's median
    log-ratio weighs (log shape_step / |distance|)² as much (one 8× off counts ~1/9), so a burst of
    stalled verifications does not raise every prediction; a lasting change of the host's speed moves
    the median, and ρ(s) carries it meanwhile.
    """

    model: ModelSpec
    hardware: HardwareSpec
    compute: _Branch = field(default_factory=_Branch)
    memory: _Branch = field(default_factory=_Branch)
    draft_s: float = 0.0
    overhead_s: float = 0.0
    window: int = 128
    decay: float = 0.98
    ridge: float = 0.05
    samples: list[tuple[int, int, float]] = field(default_factory=list)
    calibrated: bool = False
    shape: dict[int, float] = field(default_factory=dict)  # ρ(s): running measured / roofline per row count
    shape_rate: float = 0.2
    shape_step: float = 2.0  # one sample moves ρ(s) by at most this factor before the running average
    shape_relax: float = 0.05  # λ: pull of each sample on the other counts' ρ toward the probe's shape
    robust_fit: bool = True  # down-weight stalled samples in the α/β refit (False: plain weighted least squares)
    refit_every: int = 4  # α, β refitted every this many samples (every one while the window is short)
    # The engine's probe timings (observe_many(..., anchor=True)), kept beside the window: once a run
    # of AR steps or of similar trees has pushed them out (sizes left < 4x apart), reanchor() feeds
    # them in again at the host's present speed, so one probe serves an engine's whole life.
    anchors: list[tuple[int, int, float]] = field(default_factory=list)
    # each setting's own (T_d, T_o) (``observe_overheads(..., setting=)``), newest last; not persisted
    per_setting: dict = field(default_factory=dict, repr=False)
    max_settings: int = 64  # a long-lived app sees many; the oldest is dropped past this
    _unfit: int = field(default=0, repr=False)  # samples since the last refit
    _probe_shape: tuple[int, dict[int, float]] | None = field(default=None, repr=False)  # (table size, b(u))

    # ------------------------------------------------------------- prediction
    def t_comp(self, s: int, c: int) -> float:
        return self.model.flops(s, c) / self.hardware.flops

    def t_mem(self, s: int, c: int) -> float:
        return self.model.bytes(s, c) / self.hardware.bandwidth

    def roofline(self, s: int, c: int) -> float:
        """The calibrated two-branch roofline C(s, c) in seconds, before the per-size ratio."""
        return max(self.compute.alpha * self.t_comp(s, c) + self.compute.beta,
                   self.memory.alpha * self.t_mem(s, c) + self.memory.beta)

    def shape_factor(self, s: int) -> float:
        """ρ(s): the learned ratio at s, linear between the nearest sizes seen, the nearest one's beyond."""
        return _interpolate(self.shape, s) if self.shape else 1.0

    def predict(self, s: int, c: int) -> float:
        """Predicted verification seconds of s rows after c context tokens: ρ(s)·C(s, c)."""
        return self.shape_factor(s) * self.roofline(s, c)

    def round_overhead(self) -> float:
        """T_d + T_o: the part of a round that does not grow with the tree."""
        return self.draft_s + self.overhead_s

    def overheads(self, setting=None) -> tuple[float, float]:
        """(T_d, T_o) for ``setting``: its own running averages once it has run a round (with a draft,
        for T_d), else the engine's over every setting. Both depend on the setting, not only on the
        host — the draft's depth, the tree's size and its build — so one setting's rounds must not
        set another's: in a benchmark where ``fixed:64`` ran before Bastion on a GPU, Bastion started
        from ``fixed:64``'s 4-ms host time, grew larger trees, and its own host time then grew with
        them (bench/NOTES.md, session 43)."""
        draft_s, overhead_s = self.per_setting.get(setting, (0.0, 0.0))
        return draft_s or self.draft_s, overhead_s or self.overhead_s

    # ------------------------------------------------------------- calibration
    def observe(self, s: int, c: int, seconds: float) -> None:
        if not seconds > 0.0:  # a timer reading of 0 (or NaN) is no measurement: it would poison the fit
            return
        if not self.calibrated:  # β from the first measurement: both branches predict it exactly
            self.compute.beta = max(0.0, seconds - self.compute.alpha * self.t_comp(s, c))
            self.memory.beta = max(0.0, seconds - self.memory.alpha * self.t_mem(s, c))
            self.calibrated = True
        self.samples.append((int(s), int(c), float(seconds)))
        del self.samples[:-self.window]
        self._unfit += 1
        if self._unfit >= self.refit_every or len(self.samples) < 2 * self.refit_every:
            self._refit()
        self._observe_shape(int(s), seconds / max(self.roofline(s, c), 1e-12))

    def _observe_shape(self, s: int, ratio: float) -> None:
        """ρ(s) after one measured ratio (module docstring): a running average of log ρ whose steps
        are clipped to ±log ``shape_step``, then the other counts relaxed toward the probe's shape."""
        old = self.shape.get(s)
        if old is None or old <= 0.0:
            self.shape[s] = ratio
            return
        bound = math.log(self.shape_step)
        step = max(-bound, min(bound, math.log(ratio / old)))
        self.shape[s] = rho = old * math.exp(self.shape_rate * step)
        base = self._probe_ratios()
        if not base or s not in base or not self.shape_relax:
            return
        level = rho / base[s]
        for u, r in self.shape.items():
            if u != s and u in base and r > 0.0:
                self.shape[u] = r * (base[u] * level / r) ** self.shape_relax

    def _probe_ratios(self) -> dict[int, float]:
        """b(u) = the probe's time for u rows / C(u, c_probe) under the current fit, for every count in
        ρ's table; {} before a probe. Cached until the next refit (α, β change only there) or until ρ's
        table gains a count (counts are only ever added)."""
        cached = self._probe_shape
        if cached is None or cached[0] != len(self.shape):
            base = {}
            if self.anchors:
                times, c_probe = self._anchor_table()
                base = {u: _interpolate(times, u) / max(self.roofline(u, c_probe), 1e-12) for u in self.shape}
            self._probe_shape = cached = (len(self.shape), {u: b for u, b in base.items() if b > 0.0})
        return cached[1]

    def observe_many(self, points: list[tuple[int, int, float]], anchor: bool = False) -> None:
        """Several timings at once (the engine's probe): observed in turn, then every ρ(s) set afresh
        against the final fit (left as observed, the first sizes' ratios would be taken against an
        early fit). ``anchor``: also keep them as :attr:`anchors` (replacing earlier ones), for
        :meth:`reanchor` once the window has moved past them."""
        if anchor:
            self.anchors = [(int(s), int(c), float(t)) for s, c, t in points]
            self._probe_shape = None  # b(u) comes from the anchors
        for s, c, seconds in points:
            self.observe(s, c, seconds)
        self._refit()
        for s, c, seconds in points:
            self.shape[int(s)] = seconds / max(self.roofline(s, c), 1e-12)

    def observe_overheads(self, draft_s: float | None, overhead_s: float, rate: float = 0.2, setting=None) -> None:
        """Exponential running averages of T_d and T_o, the engine's and, with ``setting`` (any hashable:
        the engine passes its generation settings), that setting's own (:meth:`overheads`). ``draft_s``
        None: the round drafted nothing (AR, or a skipped draft), which says nothing about T_d and must
        not pull it toward 0."""
        self.draft_s, self.overhead_s = _running((self.draft_s, self.overhead_s), draft_s, overhead_s, rate)
        if setting is not None:
            own = self.per_setting.pop(setting, (0.0, 0.0))
            put_newest(self.per_setting, setting, _running(own, draft_s, overhead_s, rate), self.max_settings)

    def _refit(self, iterations: int = 3) -> None:
        self._unfit, self._probe_shape = 0, None
        n = len(self.samples)
        weights = [self.decay ** (n - 1 - i) for i in range(n)]
        xs_c = [self.t_comp(s, c) for s, c, _ in self.samples]
        xs_m = [self.t_mem(s, c) for s, c, _ in self.samples]
        ts = [t for _, _, t in self.samples]
        if self.robust_fit and n >= 8:  # robust weights: see the class docstring
            logs = [math.log(max(t, 1e-12) / max(self.compute.alpha * a + self.compute.beta,
                                     self.memory.alpha * b + self.memory.beta, 1e-12))
                    for t, a, b in zip(ts, xs_c, xs_m)]
            mid, cut = sorted(logs)[n // 2], math.log(self.shape_step)
            weights = [w * min(1.0, cut / max(abs(x - mid), 1e-12)) ** 2 for w, x in zip(weights, logs)]
        last = None
        for _ in range(iterations):
            on_comp = [self.compute.alpha * a + self.compute.beta >= self.memory.alpha * b + self.memory.beta
                       for a, b in zip(xs_c, xs_m)]
            if on_comp == last:  # same assignment as the fit just made: refitting would repeat it
                break
            last = on_comp
            for branch, xs, flag in ((self.compute, xs_c, True), (self.memory, xs_m, False)):
                pts = [(x, t, w) for x, t, w, f in zip(xs, ts, weights, on_comp) if f == flag]
                if pts:  # the ridge pulls toward the analytic prior α = 1, not the last fit (no drift)
                    branch.alpha, branch.beta = _fit_line(pts, 1.0, self.ridge)

    def slope_identified(self, ratio: float = SLOPE_RATIO) -> bool:
        """Whether the window holds tree sizes at least ``ratio`` apart: only then does the fit know
        how C(n) grows with n. AR rounds (all n = 1) or a run of equal trees leave the slope to the
        analytic prior, which on a CPU can be off several-fold (a large square matrix product reaches
        a higher rate than a forward pass over a few rows): see Engine.probe_latency and
        :meth:`reanchor`."""
        return _spans(self.samples, ratio)

    def reanchor(self) -> bool:
        """Feed the probe's kept timings (:attr:`anchors`) to the window again, as the probe did, when
        they can tell the slope; False when there are none such (the caller then probes). After a long
        run of AR steps, or of trees of one size, this restores what a new probe would without its
        forwards: the timings keep the probe's shape (how cost grows with rows) and are scaled to the
        host's present speed (:meth:`anchor_scale`) — fed as measured, half an hour after the probe,
        they priced trees of 7–13 rows 10–25% low in the rounds that followed (bench/NOTES.md)."""
        if not _spans(self.anchors):
            return False
        k = self.anchor_scale()
        self.observe_many([(s, c, t * k) for s, c, t in self.anchors])
        return True

    def anchor_scale(self) -> float:
        """k = median over the window of measured / anchored time: the anchors' time at a sample's row
        count (:func:`_interpolate`, as ρ(s)), carried from the probe's context (one for all its
        timings) to the sample's by the roofline's own ratio C(s, c) / C(s, c_probe). 1 with no window."""
        if not self.anchors or not self.samples:
            return 1.0
        table = self._anchor_table()
        ratios = []
        for s, c, t in self.samples:
            anchored = self._carried(table, s, c)
            if anchored:
                ratios.append(t / anchored)
        ratios.sort()
        return ratios[len(ratios) // 2] if ratios else 1.0

    def anchored(self, s: int, c: int) -> float | None:
        """The probe's time for s rows (interpolated between its sizes) carried from the probe's context
        to c by the roofline's ratio C(s, c) / C(s, c_probe): what a verification cost on the host as
        the probe found it — a reference that, unlike :meth:`predict`, does not follow the recent
        rounds (the engine's thread governor compares against it). None before a probe."""
        return self._carried(self._anchor_table(), s, c) if self.anchors else None

    def _anchor_table(self) -> tuple[dict[int, float], int]:
        """The probe's times by row count, and the probe's context (one for all its timings)."""
        return {n: t for n, _, t in self.anchors}, self.anchors[0][1]

    def _carried(self, table: tuple[dict[int, float], int], s: int, c: int) -> float:
        times, c_probe = table
        return _interpolate(times, s) * self.roofline(s, c) / max(self.roofline(s, c_probe), 1e-12)

    def relative_error(self) -> float | None:
        """Median |predicted − measured| / measured over the current window (None if empty)."""
        if not self.samples:
            return None
        errs = sorted(abs(self.predict(s, c) - t) / t for s, c, t in self.samples)
        return errs[len(errs) // 2]

    # ------------------------------------------------------------- persistence
    def to_dict(self) -> dict:
        return {"model": asdict(self.model), "hardware": asdict(self.hardware),
                "compute": asdict(self.compute), "memory": asdict(self.memory),
                "draft_s": self.draft_s, "overhead_s": self.overhead_s,
                "samples": self.samples, "anchors": self.anchors, "calibrated": self.calibrated,
                "shape": {str(s): r for s, r in sorted(self.shape.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> "LatencyModel":
        lm = cls(ModelSpec(**d["model"]), HardwareSpec(**d["hardware"]), _Branch(**d["compute"]),
                 _Branch(**d["memory"]), float(d.get("draft_s", 0.0)), float(d.get("overhead_s", 0.0)))
        lm.samples = [tuple(x) for x in d.get("samples", [])]
        lm.anchors = [tuple(x) for x in d.get("anchors", [])]
        lm.calibrated = bool(d.get("calibrated", bool(lm.samples)))
        lm.shape = {int(s): float(r) for s, r in d.get("shape", {}).items()}  # JSON keys are strings
        return lm

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "LatencyModel":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def curve(self, sizes: list[int], c: int) -> list[float]:
        return [self.predict(s, c) for s in sizes]


def _interpolate(table: dict[int, float], s: int) -> float:
    """table's value at size s: linear between the nearest sizes around it, the nearest one's beyond."""
    if s in table:
        return table[s]
    lo = max((k for k in table if k < s), default=None)
    hi = min((k for k in table if k > s), default=None)
    if lo is None or hi is None:
        return table[hi if lo is None else lo]
    w = (s - lo) / (hi - lo)
    return (1.0 - w) * table[lo] + w * table[hi]


def _fit_line(points: list[tuple[float, float, float]], alpha_prior: float, ridge: float) -> tuple[float, float]:
    """Weighted least squares t ≈ α·x + β with α, β ≥ 0 and a ridge pulling α toward its prior.

    With a single distinct x the slope is not identifiable: α keeps its prior, β absorbs the rest.
    """
    sw = sum(w for _, _, w in points)
    mx = sum(w * x for x, _, w in points) / sw
    mt = sum(w * t for _, t, w in points) / sw
    sxx = sum(w * (x - mx) ** 2 for x, _, w in points)
    sxt = sum(w * (x - mx) * (t - mt) for x, t, w in points)
    # Ridge relative to the data's own x² mass: when the sizes seen barely differ (an AR-only run,
    # where x moves only with the context length) the slope stays near its prior instead of
    # fitting noise and extrapolating to absurd C(n); with varied tree sizes the data dominates.
    lam = ridge * sw * mx * mx
    if sxx + lam <= 0 or sxx < 1e-12 * max(sw * mx * mx, 1e-30):
        alpha = alpha_prior
    else:
        alpha = (sxt + lam * alpha_prior) / (sxx + lam)
    alpha = max(alpha, 0.0)
    beta = mt - alpha * mx
    if beta < 0.0:  # clip β at zero and refit the slope through the origin
        beta = 0.0
        sxx0 = sum(w * x * x for x, _, w in points)
        alpha = max(sum(w * x * t for x, t, w in points) / sxx0, 0.0) if sxx0 > 0 else alpha
    return alpha, beta


@dataclass
class RowPadding:
    """Which row count to run a verification of n nodes as: the cheapest measured count m ≥ n.

    A forward over m rows is not monotone in m on every device. On a 2-core CPU with torch's own
    ``F.linear``, MKL's fp32 products over 2–3 rows were slower than over 4+: the embedded target
    verified 3 rows in 117 ms and 5 in 75 ms (bench/NOTES.md). ``kernels.cpu_linear`` removed most of
    that shape effect; what is left (and any other device's) is measured, not assumed. Padding the
    tree with dummy rows up to the cheapest count at or above it turns the measured curve t(m) into
    its monotone lower envelope

        t_eff(n) = min_{m ≥ n} t(m),   padded(n) = the m that attains it,

    which is what the roofline C(n) can fit and what the budget rule should price. Measurements are
    noisy, so two guards: padded(n) is the *smallest* m within ``margin`` of the cheapest candidate,
    t(m) ≤ (1 + margin)·min t, so rows are added only for a real saving; and candidates lie within
    ``max_extra`` rows of n (the shape effects seen are one to three rows wide), so a count timed
    during a burst of other work cannot make small trees pay for many dummy rows. Without the second
    guard t_eff rises with n up to the margin; with it, nearly so. ``padded[n − 1]`` is the row count
    for n nodes, n ≤ len(padded); larger trees run as they are.
    """

    padded: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # the measured t(m), m = 1..len

    @classmethod
    def from_times(cls, seconds: list[float], margin: float = 0.03, max_extra: int = 3) -> "RowPadding":
        """seconds[m − 1] = measured verify time of m rows, m = 1..M."""
        M = len(seconds)
        padded = []
        for n in range(1, M + 1):
            window = range(n, min(M, n + max_extra) + 1)
            best = min(seconds[m - 1] for m in window)
            padded.append(next(m for m in window if seconds[m - 1] <= (1.0 + margin) * best))
        return cls(padded, [float(s) for s in seconds])

    def rows(self, n: int) -> int:
        return self.padded[n - 1] if 1 <= n <= len(self.padded) else n

    def to_dict(self) -> dict:
        return {"padded": list(self.padded), "seconds": [round(s, 6) for s in self.seconds]}
