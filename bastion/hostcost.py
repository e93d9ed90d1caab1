"""The host's work of a round as a line in the tree's size: T_o(n) = a + b·n.

The throughput rule S_n / (T_d + T_o + C(n)) takes T_o — building the tree and committing what was
accepted — as one running number a round. Where the verification C(n) grows with n (a CPU: ~1.3 ms a
row on the 2-core Zen 4) that is harmless. Where it does not (a 135M model on a GPU: one to 64 rows
in ~18 ms, session 43's H100 run), the rule grows the tree until the host's own per-node work eats the
gain: Bastion's 95-node trees spent 10.5 ms building and 3.4 committing of a 35.8-ms round, and ran
1.45× AR against `fixed:64`'s 1.91× (bench/NOTES.md). :class:`HostCost` fits that work, one line per
kind of tree (:class:`HostCosts`, keyed by ``GenerationConfig.builder()``: strategies and their options
cost differently per node — re-weighted children, copy branches, sampled commits), so the rule can
price it: S_n / (T_d + a + b·n + C(n)) (``GenerationConfig.node_cost``; off by default until a GPU has
measured it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .latency import put_newest


@dataclass
class HostCost:
    """Exponentially weighted least squares of host seconds o on tree size n (root included).

    Each observation decays the earlier ones by (1 − ``rate``). The slope b is trusted only once the
    sizes seen spread by ``min_spread`` nodes (standard deviation) — a run of equal trees says nothing
    about it — and is never negative (a tree does not get cheaper to build as it grows); the intercept
    a puts the line through the weighted means (a + b·n̄ is the running mean of o), and is never negative.
    """

    rate: float = 0.05
    min_spread: float = 1.0
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # Σw, Σw·n, Σw·n², Σw·o, Σw·n·o

    def observe(self, nodes: int, seconds: float) -> None:
        if not seconds >= 0.0 or nodes < 1:  # NaN or nonsense: no measurement
            return
        keep = 1.0 - self.rate
        n = float(nodes)
        for i, v in enumerate((1.0, n, n * n, seconds, n * seconds)):
            self.sums[i] = keep * self.sums[i] + v

    def line(self) -> tuple[float, float]:
        """(a, b) in seconds and seconds per node; (0, 0) before any observation."""
        w, sn, snn, so, sno = self.sums
        if w <= 0.0:
            return 0.0, 0.0
        mean_n, mean_o = sn / w, so / w
        var = snn / w - mean_n * mean_n
        slope = 0.0
        if var >= self.min_spread ** 2:
            slope = max(0.0, (sno / w - mean_n * mean_o) / var)
        return max(0.0, mean_o - slope * mean_n), slope


@dataclass
class HostCosts:
    """One :class:`HostCost` per kind of tree, the newest ``max_kinds`` kept (a long-lived app sees many)."""

    max_kinds: int = 64
    lines: dict = field(default_factory=dict)

    def observe(self, kind, nodes: int, seconds: float) -> None:
        cost = self.lines.pop(kind, None) or HostCost()
        cost.observe(nodes, seconds)
        put_newest(self.lines, kind, cost, self.max_kinds)

    def line(self, kind) -> tuple[float, float] | None:
        """(a, b) of this kind of tree, or None before its first round."""
        cost = self.lines.get(kind)
        return cost.line() if cost is not None else None
