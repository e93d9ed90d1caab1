"""Online calibration of the drafter's confidences into acceptance probabilities.

Best-first expansion ranks candidates by a surrogate of their acceptance probability. The plain
surrogate uses the drafter's marginal q at each depth as P(accepted | parent accepted), which is
right only if the drafter is calibrated for the acceptance rule in use. At T = 0 a node is accepted
iff it is the target's argmax, and a drafter trained on greedy continuations is close to calibrated
for that. At T > 0 a node is accepted iff the target's *sample* at its parent equals it, which
happens with the target's probability p(y) — usually well below a sharp drafter's q(y) — so the
plain surrogate overstates S_n, grows trees too large and never lets the draft gate fire.

This module learns, from the verifications the engine runs anyway,

    g(q, d) ≈ P(node accepted | its parent accepted, drafter marginal q, depth group of d)

with a monotone piecewise-linear fit per depth group: the q axis is cut into bins; bin b's knot
sits at (q̄_b, ĝ_b) with ĝ_b = (hits_b + k·q̄_b) / (tries_b + k), a prior of k pseudo-observations
at the identity, so an empty calibrator is exactly g(q) = q; pool-adjacent-violators makes the
knots non-decreasing and counts decay geometrically so the fit follows the current request.

Per-node calibration is not the whole story: a tree's S_n sums *products* of g along paths, and
acceptances along a path are not independent given q alone. At T = 1 the embedded drafter's trees
predicted 0.78 accepted draft tokens a round and accepted 0.54 (at T = 0: 1.46 and 1.34). So the
calibrator also learns one path scale κ = (accepted drafter nodes + k) / (Σ_v P(v) + k) over the
drafter's nodes of recent trees, where P(v) = Π g(q_u, d_u) along v's path under the current per-node
fit (decayed like the counts; k = ``path_prior``), and multiplies depth 1's g by κ (at most 1).
Every path passes through exactly one depth-1 node, so this scales every P(v), hence S_n − 1, by κ
and leaves the order of candidates unchanged.

g is non-decreasing in q and ≤ 1, so sibling order (descending q) and "a child never beats its
parent" both survive: best-first expansion stays exact under the calibrated surrogate
P(v) = Π g(q_i, d_i). Calibration only changes which tree is verified, never what is accepted,
so decoding stays lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .tree import DraftTree


def _pav(y: list[float], w: list[float]) -> list[float]:
    """Weighted isotonic (non-decreasing) regression by pool-adjacent-violators."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for yi, wi in zip(y, w):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return [m for m, _, c in blocks for _ in range(c)]


@dataclass
class AcceptanceCalibrator:
    """g(q, d): monotone in q per depth group, learned online from verified trees.

    Attributes:
        depth_groups: first depth of each group, ascending from 1 (default: 1, 2, 3–4, 5–8, 9+).
        bins: equal-width bins of q on [0, 1].
        prior: pseudo-observations per bin pulling ĝ toward the identity.
        decay: factor applied to all counts after each observed round.
        grid: resolution of the lookup table used by :meth:`log_g`.
        refresh: the table is rebuilt when the counts added since it was built exceed this share of
            the (decayed) total: a 2% change in the evidence, not every round (a rebuild is ~0.5 ms
            of a ~40 ms round on the 2-core CPU).
    """

    depth_groups: tuple[int, ...] = (1, 2, 3, 5, 9)
    bins: int = 10
    prior: float = 4.0
    decay: float = 0.995
    grid: int = 512
    path_prior: float = 4.0
    path_hits: float = 0.0    # decayed Σ accepted drafter nodes per tree
    path_pred: float = 0.0    # decayed Σ of their P(v) = Π g along the path (per-node fit, no scale)
    hits: torch.Tensor = field(default=None)   # [G, bins] decayed accepted counts
    tries: torch.Tensor = field(default=None)  # [G, bins] decayed tested counts
    qsum: torch.Tensor = field(default=None)   # [G, bins] decayed Σ q of tested nodes
    refresh: float = 0.02     # rebuild the log g table when new counts exceed this share of all
    _table: torch.Tensor | None = field(default=None, repr=False)  # [G, grid] log g on the q grid
    _since: float = field(default=0.0, repr=False)  # counts observed since the table was built
    _rows: tuple | None = field(default=None, repr=False)  # (the table, its rows as lists) for scalar()

    def __post_init__(self) -> None:
        if list(self.depth_groups) != sorted(set(self.depth_groups)) or self.depth_groups[0] != 1:
            raise ValueError(f"depth_groups must ascend from 1, got {self.depth_groups}")
        shape = (len(self.depth_groups), self.bins)
        for name in ("hits", "tries", "qsum"):
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros(shape, dtype=torch.float64))

    # ------------------------------------------------------------- learning
    def group(self, depth: int) -> int:
        return sum(1 for g in self.depth_groups if depth >= g) - 1

    def observe(self, tree: DraftTree, raw_marginals: list[float], accepted: list[int]) -> int:
        """Count every *tested* drafter node of one verified tree: a node whose parent was accepted
        (prompt-lookup nodes, rank −1, have their own statistics in lookup.py).

        ``raw_marginals[i]`` is node i's drafter marginal q (uncalibrated); ``accepted`` the walked
        node indices, root first. Returns the number of nodes counted.
        """
        on_path = set(accepted)
        self.hits.mul_(self.decay)
        self.tries.mul_(self.decay)
        self.qsum.mul_(self.decay)
        # the path scale, from this tree's path products under the per-node fit before this update
        # (whatever surrogate built the tree)
        mine = [i for i in range(1, len(tree)) if tree.ranks[i] >= 0]
        if mine:
            if self._table is None:
                self._table = self._build_table()
            rows = torch.tensor([self.group(tree.depths[i]) for i in mine], dtype=torch.long)
            qs = torch.tensor([raw_marginals[i] for i in mine], dtype=torch.float32)
            cells = self._table[rows, self._grid_index(qs)].tolist()  # the same lookup as log_g
            logp = [0.0] * len(tree)
            for i, cell in zip(mine, cells):  # parents come before children; a drafter node's parent is one or the root
                logp[i] = logp[tree.parents[i]] + cell
            self.path_pred = self.decay * self.path_pred + sum(math.exp(logp[i]) for i in mine)
            self.path_hits = self.decay * self.path_hits + sum(1 for i in mine if i in on_path)
        # tested drafter nodes (a node whose parent was accepted; lookup nodes have their own rates)
        tested = [i for i in range(1, len(tree)) if tree.parents[i] in on_path and tree.ranks[i] >= 0]
        if tested:  # one scatter-add per count (element-wise tensor updates cost ~5 µs each)
            qs = [min(max(raw_marginals[i], 0.0), 1.0) for i in tested]
            cell = torch.tensor([self.group(tree.depths[i]) * self.bins + min(int(q * self.bins), self.bins - 1)
                                 for i, q in zip(tested, qs)])
            for counts, add in ((self.tries, [1.0] * len(tested)), (self.qsum, qs),
                                (self.hits, [1.0 if i in on_path else 0.0 for i in tested])):
                counts.view(-1).index_add_(0, cell, torch.tensor(add, dtype=counts.dtype))
        # the log g table is rebuilt once the counts since it was built reach ``refresh`` of the
        # decayed total (each round while few are known; every few rounds once thousands are)
        self._since += len(tested)
        if self._since > self.refresh * self.observed:
            self._table, self._since = None, 0.0
        return len(tested)

    def knots(self, g: int) -> tuple[list[float], list[float]]:
        """(q̄_b, ĝ_b) per bin of depth group g, ĝ made non-decreasing."""
        mids = [(b + 0.5) / self.bins for b in range(self.bins)]
        tries, hits, qsum = self.tries[g].tolist(), self.hits[g].tolist(), self.qsum[g].tolist()
        xs = [qs / t if t > 1e-9 else m for qs, t, m in zip(qsum, tries, mids)]
        ys = [(h + self.prior * x) / (t + self.prior) for h, t, x in zip(hits, tries, xs)]
        return xs, _pav(ys, [t + self.prior for t in tries])

    def _build_table(self) -> torch.Tensor:
        """[G, grid] log g: each group's knots, through the origin and flat beyond the last one,
        interpolated linearly on the q grid. Rebuilt whenever ``refresh`` new evidence has come in
        (every round at first), so all groups are interpolated in one batch of tensor ops (a loop per
        group cost ~1 ms a round)."""
        xs, ys = [], []
        for g in range(len(self.depth_groups)):
            kx, ky = self.knots(g)
            xs.append([0.0] + kx + [1.0])
            ys.append([0.0] + ky + [ky[-1]])
        x = torch.tensor(xs, dtype=torch.float64)  # [G, bins + 2]
        y = torch.tensor(ys, dtype=torch.float64)
        x, order = torch.sort(x, dim=1, stable=True)
        y = torch.cummax(y.gather(1, order), 1).values
        q = torch.linspace(0.0, 1.0, self.grid, dtype=torch.float64).expand(x.shape[0], -1).contiguous()
        j = torch.searchsorted(x, q, right=True).clamp(1, x.shape[1] - 1)
        x0, x1, y0, y1 = x.gather(1, j - 1), x.gather(1, j), y.gather(1, j - 1), y.gather(1, j)
        w = torch.where(x1 > x0, (q - x0) / (x1 - x0).clamp(min=1e-12), torch.zeros_like(q))
        return (y0 + w * (y1 - y0)).clamp(1e-9, 1.0).log().float()

    # ------------------------------------------------------------- applying
    @property
    def observed(self) -> float:
        return float(self.tries.sum())

    @property
    def path_scale(self) -> float:
        """κ ∈ (0, 1]: accepted drafter nodes over their predicted sum, with ``path_prior`` trees' worth
        of pseudo-counts at 1 (see the module docstring)."""
        k = self.path_prior
        return min(1.0, max((self.path_hits + k) / (self.path_pred + k), 1e-3))

    def log_g(self, logq: torch.Tensor, path_scale: bool = True) -> torch.Tensor:
        """log g for a [D, k] tensor of log q whose row d−1 holds depth d. Same shape and device.
        Depth 1 includes the path scale κ unless ``path_scale`` is False (the per-node fit alone).

        With no observations this returns logq itself (the identity), so an untouched calibrator
        leaves every strategy exactly as without it.
        """
        if self.observed == 0.0:
            return logq
        if self._table is None:
            self._table = self._build_table()
        D = logq.shape[0]
        rows = torch.tensor([self.group(d + 1) for d in range(D)], dtype=torch.long)
        out = self._table[rows[:, None], self._grid_index(logq.detach().float().cpu().exp())]
        if D and path_scale and self.path_scale < 1.0:
            out[0] += math.log(self.path_scale)
        return out.to(logq.device, logq.dtype)

    def scalar(self) -> Callable[[int, list[float]], list[float]] | None:
        """log g as a Python function of (depth, [q, ...]) — :meth:`log_g` for a few probabilities
        at a time, for per-node lookups while a tree grows (expansion.Rerank); None while nothing is
        observed (g = q). Same table, same grid rounding, same path scale at depth 1."""
        if self.observed == 0.0:
            return None
        if self._table is None:
            self._table = self._build_table()
        if self._rows is None or self._rows[0] is not self._table:  # the table as lists, once per build
            self._rows = (self._table, self._table.tolist())
        rows, top = self._rows[1], self.grid - 1
        scale = math.log(self.path_scale) if self.path_scale < 1.0 else 0.0
        by_depth: dict[int, list[float]] = {}

        def log_g(depth: int, qs: list[float]) -> list[float]:
            row = by_depth.get(depth)
            if row is None:
                row = by_depth[depth] = rows[self.group(depth)]
                if depth == 1 and scale:
                    row = by_depth[depth] = [v + scale for v in row]
            return [row[round(min(max(x, 0.0), 1.0) * top)] for x in qs]
        return log_g

    def _grid_index(self, q: torch.Tensor) -> torch.Tensor:
        """The nearest point of the q grid (a column of the table) for each q, clamped into [0, 1]."""
        return (q.clamp(0.0, 1.0) * (self.grid - 1)).round().long()

    def curve(self, depth: int, qs: list[float], path_scale: bool = False) -> list[float]:
        """g(q, depth) at the given q values (for plots): the per-node fit, or with ``path_scale`` what
        the tree builder uses (at depth 1 times κ)."""
        rows = torch.zeros(depth, len(qs))
        rows[depth - 1] = torch.tensor(qs, dtype=torch.float32).clamp(min=1e-9).log()
        return self.log_g(rows, path_scale)[depth - 1].exp().tolist()

    def to_dict(self) -> dict:
        return {"depth_groups": list(self.depth_groups), "bins": self.bins, "prior": self.prior,
                "decay": self.decay, "path_scale": self.path_scale, "hits": self.hits.tolist(),
                "tries": self.tries.tolist(), "qsum": self.qsum.tolist()}

    def reliability(self) -> list[dict]:
        """Per depth group and bin with data: mean q, observed acceptance rate, count."""
        out = []
        for g, first in enumerate(self.depth_groups):
            for b in range(self.bins):
                t = float(self.tries[g, b])
                if t >= 1.0:
                    out.append({"depths_from": first, "q": float(self.qsum[g, b]) / t,
                                "rate": float(self.hits[g, b]) / t, "count": t})
        return out
