"""Another host's measured round costs, to size trees as that host would: a what-if run on this one.

Bastion's throughput rule grows the tree that maximises S_n / (T_d + T_o(n) + C(n)). The expected
tokens S_n are the drafter's and the target's — at T = 0 the same on every host — but the times are
the host's own: on a 2-core CPU each verified row adds ~1.4 ms, so the rule stops at ~4–5 nodes; on
an H100 one to 128 rows of the embedded target cost 15–18 ms (session 43), so it grows trees ten
times larger. A :class:`CostProfile` holds one host's measured costs,

    C(n) = v(n)                 piecewise linear through the measured medians of n verified rows,
                                made non-decreasing (a larger forward does not get cheaper),
    T_o(n) = a + b·n            the host's build + commit time of an n-node Bastion tree (root included),
    T_d = d                     one draft, paid by rounds that draft,

and with ``GenerationConfig.cost_profile`` set the engine sizes every tree, prices every copy branch
and judges every draft with them instead of its own online calibration. Everything else is real: the
trees are verified by the target here, so the accepted tokens and τ are what that host's rule would
accept (at T = 0 the rounds depend only on the costs the rule sees, not on how long anything took
here). Only the time is not: :meth:`CostProfile.modeled_s` prices the recorded rounds with the
profile — the decode time the model predicts on that host, reported apart from what was measured. The
other strategies' trees cost that host differently per node (a best-first tree without the per-parent
re-weighting builds in less than half of Bastion's time a node on session 43's H100), so the profile
keeps each strategy's own host line for pricing its rounds (``lines``); the rule sizes with Bastion's.

A profile is measured by a benchmark run on its host (:func:`profile_from_bench`, ``python -m
bastion profile BENCH_FOLDER``); the ones under ``bastion/profiles/`` are named by :func:`load_profile`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from .calibration import isotonic_fit
from .report import _open_text, read_rounds

PROFILES_DIR = Path(__file__).parent / "profiles"
MIN_ROUNDS = 5  # rounds of one row count before its median becomes a point of v(n)


@dataclass(frozen=True)
class CostProfile:
    """One host's round costs in seconds (module docstring): v(n) through ``(rows[i], verify_s[i])``,
    T_o(n) = ``host_s`` + ``node_s``·n and T_d = ``draft_s``. Frozen and hashable: it is part of a
    :class:`~bastion.config.GenerationConfig`, which keys the engine's per-setting tables."""

    name: str
    rows: tuple[int, ...]        # verified row counts, increasing
    verify_s: tuple[float, ...]  # v at each, non-decreasing
    draft_s: float               # T_d
    host_s: float                # a
    node_s: float = 0.0          # b, per tree node
    source: str = ""             # where it was measured
    lines: tuple[tuple[str, float, float], ...] = ()  # (strategy, a, b) of the others, for modeled time

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", tuple(int(r) for r in self.rows))
        object.__setattr__(self, "verify_s", tuple(float(v) for v in self.verify_s))
        if not self.rows or len(self.rows) != len(self.verify_s):
            raise ValueError(f"cost profile {self.name!r}: rows and verify_s must be non-empty and of one length, "
                             f"got {len(self.rows)} and {len(self.verify_s)}")
        if self.rows[0] < 1 or any(b <= a for a, b in zip(self.rows, self.rows[1:])):
            raise ValueError(f"cost profile {self.name!r}: rows must be positive and increasing, got {list(self.rows)}")
        if any(not v > 0 for v in self.verify_s) or any(b < a for a, b in zip(self.verify_s, self.verify_s[1:])):
            raise ValueError(f"cost profile {self.name!r}: verify_s must be positive and non-decreasing, "
                             f"got {list(self.verify_s)}")
        object.__setattr__(self, "lines", tuple((str(n), a, b) for n, a, b in self.lines))
        values = [("draft_s", self.draft_s), ("host_s", self.host_s), ("node_s", self.node_s)]
        values += [(f"lines[{n}]", x) for n, a, b in self.lines for x in (a, b)]
        for field_name, value in values:
            if not (isinstance(value, (int, float)) and value >= 0 and value < 60):
                raise ValueError(f"cost profile {self.name!r}: {field_name} must be seconds in [0, 60), got {value!r}")

    def verify(self, rows: int) -> float:
        """v(rows): linear between the measured counts, flat below the first, and past the last along
        the last segment's slope (a single point: flat)."""
        xs, ys = self.rows, self.verify_s
        if rows <= xs[0] or len(xs) == 1:
            return ys[0]
        i = next((j for j in range(1, len(xs)) if rows <= xs[j]), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    def cost(self, n: int) -> float:
        """The part of a round that grows with the tree: v(n) + b·n (the engine's ``cost``)."""
        return self.verify(n) + self.node_s * n

    def overhead(self, drafting: bool = True) -> float:
        """The rest: T_d (when the round drafts) + a (the engine's ``overhead``)."""
        return (self.draft_s if drafting else 0.0) + self.host_s

    def host_line(self, strategy: str) -> tuple[float, float]:
        """(a, b) of ``strategy``'s trees on that host: its own line where measured, else Bastion's."""
        return next(((a, b) for name, a, b in self.lines if name == strategy), (self.host_s, self.node_s))

    def round_s(self, nodes: int, drafted: bool, strategy: str = "bastion") -> float:
        """One round of ``strategy`` on that host: T_d if it drafted, its host line, and v(nodes)."""
        a, b = self.host_line(strategy)
        return (self.draft_s if drafted else 0.0) + a + b * nodes + self.verify(nodes)

    def modeled_s(self, steps) -> float:
        """Σ over recorded rounds (:class:`~bastion.records.Step`) of the profile's time for that round:
        its tree's nodes verified as as many rows (the profile's host does not pad), its draft if it drafted."""
        return sum(self.round_s(len(s.tree), s.times.draft > 0, s.strategy) for s in steps)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rows"], d["verify_s"] = list(self.rows), [round(v, 7) for v in self.verify_s]
        d["lines"] = [[n, round(a, 9), round(b, 9)] for n, a, b in self.lines]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        known = {"name", "rows", "verify_s", "draft_s", "host_s", "node_s", "source", "lines"}
        if not isinstance(d, dict) or not {"name", "rows", "verify_s", "draft_s", "host_s"} <= d.keys():
            raise ValueError("a cost profile is a JSON object with name, rows, verify_s, draft_s and host_s")
        lines = d.get("lines", [])
        if not isinstance(lines, list) or any(not isinstance(x, list) or len(x) != 3 for x in lines):
            raise ValueError("a cost profile's lines are [strategy, a, b] triples")
        return cls(**{k: v for k, v in d.items() if k in known} | {"lines": tuple(tuple(x) for x in lines)})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> CostProfile:
    """A profile by file path, or by the name of one under ``bastion/profiles/``; a clear error otherwise."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILES_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise ValueError(f"no cost profile {str(name_or_path)!r}: not a file, and not one of "
                             f"{', '.join(profile_names()) or '(none shipped)'}")
    try:
        return CostProfile.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as exc:
        raise ValueError(f"cost profile {path} is not valid JSON: {exc}") from None
    except TypeError as exc:
        raise ValueError(f"cost profile {path}: {exc}") from None


def profile_from_bench(folder: str | Path, name: str | None = None) -> CostProfile:
    """A profile measured by the benchmark folder's run (its host, dtype and drafter):

    - v(n): the median measured verification of every row count with at least :data:`MIN_ROUNDS`
      rounds (all strategies pooled), made non-decreasing by isotonic regression weighted by rounds;
    - T_d: the median draft time of the rounds that drafted (older logs without it: Σ draft / Σ rounds
      of the strategies that draft every round, chain and fixed);
    - a + b·n: least squares of the host's build + commit time on tree size over Bastion's rounds
      (older logs: a from AR's rounds, b from Bastion's mean round and mean tree; AR's rounds alone: b = 0);
      and a line per other strategy kind (ar, chain, fixed; variants pooled) for the modeled time (older
      logs: through each benchmark strategy's mean tree and mean host time a round).
    """
    folder = Path(folder)
    source = next((p for p in (folder / "results.json", folder / "results.json.gz") if p.is_file()), None)
    log = next((p for p in (folder / "rounds.csv.gz", folder / "rounds.csv.xz") if p.is_file()), None)
    if source is None or log is None:
        raise ValueError(f"{folder} is not a benchmark folder: it needs results.json(.gz) and rounds.csv(.gz|.xz)")
    with _open_text(source, encoding="utf-8") as fh:
        results = json.load(fh)
    rounds = read_rounds(log)
    by_rows: dict[int, list[float]] = {}
    for r in rounds:
        by_rows.setdefault(r["rows"], []).append(r["measured_s"])
    points = sorted((n, statistics.median(v), len(v)) for n, v in by_rows.items() if len(v) >= MIN_ROUNDS)
    if not points:
        raise ValueError(f"{folder}: no row count has {MIN_ROUNDS} rounds to measure a verification")
    verify = isotonic_fit([p[1] for p in points], [float(p[2]) for p in points])
    draft, (a, b) = _draft_time(rounds, results["strategies"]), _host_line(rounds, results["strategies"])
    m = results["machine"]
    where = f"{folder.name}: {m.get('gpu') or m.get('cpu')}, {m.get('device')}, {m.get('dtype')}, {m.get('date', '')[:10]}"
    return CostProfile(name or folder.name, tuple(p[0] for p in points), tuple(verify), draft, a, b, where,
                       _other_lines(rounds, results["strategies"]))


def _draft_time(rounds: list[dict], strategies: dict) -> float:
    drafts = [r["draft_s"] for r in rounds if r.get("draft_s", 0.0) > 0]
    if drafts:
        return statistics.median(drafts)
    every = [st for n, st in strategies.items() if (n == "chain" or n.startswith("fixed:")) and st.get("rounds")]
    total = sum(st["rounds"] for st in every)
    return sum(st["time_s"]["draft"] for st in every) / total if total else 0.0


def _fit(pts: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares o = a + b·n, a and b never negative (a single size: b = 0)."""
    mean_n, mean_o = statistics.fmean(n for n, _ in pts), statistics.fmean(o for _, o in pts)
    var = sum((n - mean_n) ** 2 for n, _ in pts)
    b = max(0.0, sum((n - mean_n) * (o - mean_o) for n, o in pts) / var) if var > 0 else 0.0
    return max(0.0, mean_o - b * mean_n), b


def _per_round(st: dict) -> float:
    return (st["time_s"]["build"] + st["time_s"]["commit"]) / st["rounds"]


def _host_line(rounds: list[dict], strategies: dict) -> tuple[float, float]:
    pts = [(r["tree_size"], r["host_s"]) for r in rounds if r["strategy"] == "bastion" and "host_s" in r]
    if len({n for n, _ in pts}) > 1:
        return _fit(pts)
    ar, bas = strategies.get("ar"), strategies.get("bastion")
    if ar is None or not ar.get("rounds"):
        raise ValueError("the benchmark folder has no AR rounds to measure the host's time of a round")
    a = _per_round(ar)
    if bas is None or not bas.get("rounds") or bas["mean_tree_size"] <= 1.0:
        return a, 0.0
    return a, max(0.0, (_per_round(bas) - a) / (bas["mean_tree_size"] - 1.0))


def _kind(name: str) -> str:
    """A benchmark strategy's engine strategy: 'fixed:64' → 'fixed', 'bastion:copies@b' → 'bastion'."""
    return name.split(":")[0].split("@")[0]


def _other_lines(rounds: list[dict], strategies: dict) -> tuple[tuple[str, float, float], ...]:
    """(kind, a, b) of ar, chain and fixed: per-round logs where they have host times, else each benchmark
    strategy's (mean tree, mean host time a round)."""
    pts: dict[str, list[tuple[float, float]]] = {}
    if all("host_s" in r for r in rounds):
        for r in rounds:
            pts.setdefault(_kind(r["strategy"]), []).append((r["tree_size"], r["host_s"]))
    else:
        for name, st in strategies.items():
            if st.get("rounds") and st.get("time_s") and st.get("mean_tree_size"):
                pts.setdefault(_kind(name), []).append((st["mean_tree_size"], _per_round(st)))
    return tuple((kind, *_fit(p)) for kind, p in sorted(pts.items()) if kind in ("ar", "chain", "fixed") and p)
