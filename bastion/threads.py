"""Thread count under contention: fewer CPU threads when another process takes a core.

A CPU forward of the target runs ~200 OpenMP parallel regions (the native products, norms and
attention, torch's own ops). Each region ends at a barrier, so when another process takes one of the
cores the region waits for the descheduled thread's next time slice — every region, every forward.
Measured in session 24 (2-core Xeon, the embedded target, one busy-looping process beside it, 64
tokens of a code prompt): AR 10.5–11.3 tok/s on two threads against 51.7–52.3 on one, and 81.7–87.2
on two with the machine idle; Bastion 9.5–13.4 against 62.6–65.2 (97.9–98.9 idle). A laptop running
the app beside a browser is that machine.

:class:`ThreadGovernor` notices the stall from what the engine already measures — each round's
verification time against what the engine's probe measured for that many rows on the idle host
(:meth:`LatencyModel.anchored`; not the model's prediction, which follows the recent rounds and so
the stall itself) — and halves the thread count; it tries the full count again now and then, so the
run speeds up again when the other process leaves. The engine applies its decision with
``torch.set_num_threads`` between rounds (the result does not change: the native products sum each
output in the same order on any number of threads).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ThreadGovernor:
    """Chooses the next round's thread count from r = measured / reference verification time (the
    reference: the probe's time on the idle host, taken on ``full`` threads).

    - ``patience`` rounds in a row with r > ``stall`` · full / current at the current count: halve
      it (down to 1). On fewer threads a forward may take up to full / current times as long without
      any contention; idle-machine noise is ±30% a round; a stalled forward is 5–70× its reference.
    - after ``retry`` rounds at a reduced count, ``trial`` rounds at the full count: kept if every
      trial round has r ≤ ``stall``, else back to the reduced count with the retry interval doubled
      (up to ``max_retry``), so a lasting contention costs a trial round rarely.

    """

    full: int
    stall: float = 2.0
    patience: int = 3
    trial: int = 1
    retry: int = 32
    max_retry: int = 512
    current: int = field(init=False)
    changes: int = field(default=0, init=False)  # how many times the count moved (for reports)
    _streak: int = field(default=0, init=False, repr=False)
    _since: int = field(default=0, init=False, repr=False)
    _interval: int = field(default=0, init=False, repr=False)
    _trial_left: int = field(default=0, init=False, repr=False)
    _trial_bad: bool = field(default=False, init=False, repr=False)
    _reduced: int = field(default=0, init=False, repr=False)

    def __post_init__(self):
        if self.full < 1:
            raise ValueError(f"full thread count must be ≥ 1, got {self.full}")
        if self.stall <= 1 or self.patience < 1 or self.trial < 1 or not 1 <= self.retry <= self.max_retry:
            raise ValueError("ThreadGovernor needs stall > 1, patience ≥ 1, trial ≥ 1, 1 ≤ retry ≤ max_retry")
        self.current = self.full
        self._interval = self.retry

    @property
    def reduced(self) -> bool:
        """Whether the next round runs on fewer threads than ``full``."""
        return self.current < self.full

    def observe(self, measured_s: float, reference_s: float | None) -> int:
        """Record one round (its verification, measured, and the idle host's time for it) → the next
        round's thread count."""
        if not reference_s or not reference_s > 0 or not measured_s >= 0:  # no reference: no evidence
            return self.current
        stalled = measured_s > self.stall * reference_s * self.full / self.current
        if self._trial_left:  # a trial at the full count
            self._trial_bad |= stalled
            self._trial_left -= 1
            if self._trial_left == 0:
                if self._trial_bad:
                    self._set(self._reduced)
                    self._interval = min(2 * self._interval, self.max_retry)
                else:
                    self._interval = self.retry
                self._since = self._streak = 0
            return self.current
        self._streak = self._streak + 1 if stalled else 0
        if self._streak >= self.patience and self.current > 1:
            self._set(max(1, self.current // 2))
            self._streak = self._since = 0
            return self.current
        if self.reduced:
            self._since += 1
            if self._since >= self._interval:
                self._reduced, self._trial_left, self._trial_bad = self.current, self.trial, False
                self._set(self.full)
        return self.current

    def _set(self, n: int) -> None:
        if n != self.current:
            self.current = n
            self.changes += 1
