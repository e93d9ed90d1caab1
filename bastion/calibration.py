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

import numpy as np
import torch

from .tree import DraftTree


def isotonic_fit(y: list[float], w: list[float]) -> list[float]:
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

    The counts are flat Python lists of G·bins cells (cell = group·bins + bin) and the fit a table of
    log g on a q grid held as lists: a round touches a few dozen numbers, where tensor ops cost ~5 µs
    each (the tensor version of ``observe`` and the draft's lookup took ~0.9 ms a round on the 2-core
    CPU, ~4% of a Bastion round; bench/NOTES.md).

    Attributes:
        depth_groups: first depth of each group, ascending from 1 (default: 1, 2, 3–4, 5–8, 9+).
        bins: equal-width bins of q on [0, 1].
        prior: pseudo-observations per bin pulling ĝ toward the identity.
        decay: factor applied to all counts after each observed round.
        grid: resolution of the lookup table used by :meth:`log_g`.
        refresh: the table is rebuilt when the counts added since it was built exceed this share of
            the (decayed) total: a 5% change in the evidence — every ~10 rounds once the counts have
            settled (a rebuild cost ~0.5 ms inside a round on the 2-core CPU; at 2% it came every
            third round), every round while few are known.
    """

    depth_groups: tuple[int, ...] = (1, 2, 3, 5, 9)
    bins: int = 10
    prior: float = 4.0
    decay: float = 0.995
    grid: int = 512
    path_prior: float = 4.0
    path_hits: float = 0.0    # decayed Σ accepted drafter nodes per tree
    path_pred: float = 0.0    # decayed Σ of their P(v) = Π g along the path (per-node fit, no scale)
    refresh: float = 0.05     # rebuild the log g table when new counts exceed this share of all
    _hits: list[float] = field(default_factory=list, repr=False)   # [G·bins] decayed accepted counts
    _tries: list[float] = field(default_factory=list, repr=False)  # [G·bins] decayed tested counts
    _qsum: list[float] = field(default_factory=list, repr=False)   # [G·bins] decayed Σ q of tested nodes
    _table: np.ndarray | None = field(default=None, repr=False)  # [G, grid] float32 log g on the q grid
    _lists: list[list[float]] | None = field(default=None, repr=False)  # the same as lists, for scalar()
    _tensor: torch.Tensor | None = field(default=None, repr=False)  # the same as a tensor, for log_g()
    _since: float = field(default=0.0, repr=False)  # counts observed since the table was built
    _groups: list[int] = field(default_factory=list, repr=False)  # group of depth d at index d

    def __post_init__(self) -> None:
        if list(self.depth_groups) != sorted(set(self.depth_groups)) or self.depth_groups[0] != 1:
            raise ValueError(f"depth_groups must ascend from 1, got {self.depth_groups}")
        cells = len(self.depth_groups) * self.bins
        for name in ("_hits", "_tries", "_qsum"):
            if not getattr(self, name):
                setattr(self, name, [0.0] * cells)

    # ------------------------------------------------------------- counts
    def _counts(self, cells: list[float]) -> torch.Tensor:
        return torch.tensor(cells, dtype=torch.float64).view(len(self.depth_groups), self.bins)

    @property
    def hits(self) -> torch.Tensor:
        """[G, bins] decayed accepted counts (a copy)."""
        return self._counts(self._hits)

    @property
    def tries(self) -> torch.Tensor:
        """[G, bins] decayed tested counts (a copy)."""
        return self._counts(self._tries)

    @property
    def qsum(self) -> torch.Tensor:
        """[G, bins] decayed Σ q of the tested nodes (a copy)."""
        return self._counts(self._qsum)

    # ------------------------------------------------------------- learning
    def group(self, depth: int) -> int:
        groups = self._groups
        while len(groups) <= depth:
            d = len(groups)
            groups.append(sum(1 for g in self.depth_groups if d >= g) - 1)
        return groups[depth]

    def observe(self, tree: DraftTree, raw_marginals: list[float], accepted: list[int]) -> int:
        """Count every *tested* drafter node of one verified tree: a node whose parent was accepted
        (prompt-lookup nodes, rank −1, have their own statistics in lookup.py).

        ``raw_marginals[i]`` is node i's drafter marginal q (uncalibrated); ``accepted`` the walked
        node indices, root first. Returns the number of nodes counted.
        """
        on_path, decay = set(accepted), self.decay
        parents, ranks, depths = tree.parents, tree.ranks, tree.depths
        if decay != 1.0:
            self._hits = [v * decay for v in self._hits]
            self._tries = [v * decay for v in self._tries]
            self._qsum = [v * decay for v in self._qsum]
        # the path scale, from this tree's path products under the per-node fit before this update
        # (whatever surrogate built the tree)
        mine = [i for i in range(1, len(tree)) if ranks[i] >= 0]
        if mine:
            table, top = self._rows(), self.grid - 1
            logp, pred = [0.0] * len(tree), 0.0
            for i in mine:  # parents come before children; a drafter node's parent is one or the root
                q = raw_marginals[i]
                logp[i] = logp[parents[i]] + table[self.group(depths[i])][round(min(max(q, 0.0), 1.0) * top)]
                pred += math.exp(logp[i])
            self.path_pred = decay * self.path_pred + pred
            self.path_hits = decay * self.path_hits + sum(1 for i in mine if i in on_path)
        # tested drafter nodes (a node whose parent was accepted; lookup nodes have their own rates)
        tested = [i for i in range(1, len(tree)) if parents[i] in on_path and ranks[i] >= 0]
        bins = self.bins
        for i in tested:
            q = min(max(raw_marginals[i], 0.0), 1.0)
            cell = self.group(depths[i]) * bins + min(int(q * bins), bins - 1)
            self._tries[cell] += 1.0
            self._qsum[cell] += q
            if i in on_path:
                self._hits[cell] += 1.0
        # the log g table is rebuilt once the counts since it was built reach ``refresh`` of the
        # decayed total (each round while few are known; every few rounds once thousands are)
        self._since += len(tested)
        if self._since > self.refresh * self.observed:
            self._table, self._since = None, 0.0
        return len(tested)

    def knots(self, g: int) -> tuple[list[float], list[float]]:
        """(q̄_b, ĝ_b) per bin of depth group g, ĝ made non-decreasing."""
        cells = slice(g * self.bins, (g + 1) * self.bins)
        tries, hits, qsum = self._tries[cells], self._hits[cells], self._qsum[cells]
        mids = [(b + 0.5) / self.bins for b in range(self.bins)]
        xs = [qs / t if t > 1e-9 else m for qs, t, m in zip(qsum, tries, mids)]
        ys = [(h + self.prior * x) / (t + self.prior) for h, t, x in zip(hits, tries, xs)]
        return xs, isotonic_fit(ys, [t + self.prior for t in tries])

    def _build_table(self) -> np.ndarray:
        """[G, grid] float32 log g: each group's knots, through the origin and flat beyond the last
        one, interpolated linearly on the q grid (NumPy's interp, one call a group: ~0.15 ms a rebuild
        warm, several times that inside a round)."""
        grid = np.linspace(0.0, 1.0, self.grid)
        rows = []
        for g in range(len(self.depth_groups)):
            kx, ky = self.knots(g)
            pts = sorted(zip([0.0] + kx + [1.0], [0.0] + ky + [ky[-1]]), key=lambda p: p[0])  # stable
            ys, top = [], 0.0
            for _, y in pts:  # non-decreasing (the knots are; the end points keep them so)
                top = max(top, y)
                ys.append(top)
            rows.append(np.interp(grid, [x for x, _ in pts], ys))
        return np.log(np.clip(np.stack(rows), 1e-9, 1.0)).astype(np.float32)

    def _array(self) -> np.ndarray:
        """The table [G, grid], rebuilt if new evidence invalidated it."""
        if self._table is None:
            self._table, self._lists, self._tensor = self._build_table(), None, None
        return self._table

    def _rows(self) -> list[list[float]]:
        """The table as lists (scalar lookups)."""
        table = self._array()
        if self._lists is None:
            self._lists = table.tolist()
        return self._lists

    # ------------------------------------------------------------- applying
    @property
    def observed(self) -> float:
        return math.fsum(self._tries)

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
        leaves every strategy exactly as without it. (The engine's per-round form is
        :meth:`log_g_rows`.)
        """
        if self.observed == 0.0:
            return logq
        table = self._array()
        if self._tensor is None:
            self._tensor = torch.from_numpy(table)
        D = logq.shape[0]
        rows = torch.tensor([self.group(d + 1) for d in range(D)], dtype=torch.long)
        q = logq.detach().float().cpu().exp()
        out = self._tensor[rows[:, None], (q.clamp(0.0, 1.0) * (self.grid - 1)).round().long()]
        if D and path_scale and self.path_scale < 1.0:
            out[0] += math.log(self.path_scale)
        return out.to(logq.device, logq.dtype)

    def log_g_rows(self, logq: torch.Tensor) -> list[list[float]] | None:
        """:meth:`log_g` (path scale included) of a draft's [D, k] top-k log q on the CPU, as lists
        (the engine's per-round form: ~40 µs warm for a [9, 16] draft against ~75 µs for log_g's tensor
        ops and a ``tolist``); None while nothing is observed (g = q: use ``logq`` itself). The grid
        rounding is :meth:`scalar`'s."""
        if self.observed == 0.0:
            return None
        q = np.exp(logq.detach().numpy().astype(np.float64))
        cols = np.rint(np.clip(q, 0.0, 1.0) * (self.grid - 1)).astype(np.int64)
        groups = np.array([self.group(d + 1) for d in range(q.shape[0])], dtype=np.int64)
        out = self._array()[groups[:, None], cols].astype(np.float64)
        if q.shape[0] and self.path_scale < 1.0:
            out[0] += math.log(self.path_scale)
        return out.tolist()

    def scalar(self) -> Callable[[int, list[float]], list[float]] | None:
        """log g as a Python function of (depth, [q, ...]) — :meth:`log_g` for a few probabilities
        at a time, for per-node lookups while a tree grows (expansion.Rerank); None while nothing is
        observed (g = q). Same table, same grid rounding, same path scale at depth 1."""
        if self.observed == 0.0:
            return None
        table, top, group = self._rows(), self.grid - 1, self.group
        scale = math.log(self.path_scale) if self.path_scale < 1.0 else 0.0

        def log_g(depth: int, qs: list[float]) -> list[float]:
            row = table[group(depth)]
            if depth == 1 and scale:
                return [row[round(min(max(x, 0.0), 1.0) * top)] + scale for x in qs]
            return [row[round(min(max(x, 0.0), 1.0) * top)] for x in qs]
        return log_g

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
                c = g * self.bins + b
                t = self._tries[c]
                if t >= 1.0:
                    out.append({"depths_from": first, "q": self._qsum[c] / t, "rate": self._hits[c] / t,
                                "count": t})
        return out
