"""What a decoding round reports: per-stage times, the Step record a viewer draws, the run summary.

Plain dataclasses that serialise to JSON (``Step.to_dict`` / ``Step.from_dict``), so a run can be
streamed, exported and replayed without a model.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

from .expansion import Decision
from .tree import DraftTree

@dataclass
class StageTimes:
    """Seconds spent in each stage of a round."""

    draft: float = 0.0
    build: float = 0.0
    verify: float = 0.0
    commit: float = 0.0  # accept + cache compaction + drafter context update

    @property
    def total(self) -> float:
        return self.draft + self.build + self.verify + self.commit


@dataclass
class Step:
    """Everything a viewer needs about one round. Serialises to JSON with ``to_dict``."""

    index: int
    strategy: str
    tree: DraftTree
    trace: list[Decision]
    stop_reason: str
    accepted: list[int]          # node indices, root first
    choices: list[int]           # the target's choice at each node
    tokens: list[int]            # tokens committed this round (accepted drafts + bonus)
    token_texts: list[str]
    bonus: int
    expected_tokens: float       # S_n of the verified tree
    predicted_verify_s: float
    measured_verify_s: float
    round_overhead_s: float      # T_d + T_o the decisions used
    times: StageTimes
    context_len: int             # committed tokens before this round (prompt included)
    generated: int               # tokens generated so far, this round included
    elapsed_s: float             # engine decode time so far (prefill and the consumer's time between steps excluded)
    prefill_s: float = 0.0       # time of the prompt's prefill (same in every step of a run)
    finished: bool = False
    finish_reason: str = ""
    # per depth, the top-k log confidences the tree was built from (descending): log g(q) once the
    # calibrator has data, log q before (and for chain, which takes the argmax whatever the values)
    draft_logq: list[list[float]] = field(default_factory=list)
    draft_ids: list[list[int]] = field(default_factory=list)     # per depth, their token ids
    lookup_tokens: list[int] = field(default_factory=list)  # this round's prompt-lookup proposal (may be unused)
    lookup_rates: list[float] = field(default_factory=list)  # the rate r_d each of its tokens was priced at
    rows: int = 0                # rows the target verified: the tree plus padding (0: a record made before padding)
    datastore_tokens: list[int] = field(default_factory=list)  # this round's datastore proposal (may be unused)
    datastore_rates: list[float] = field(default_factory=list)
    conditioned: bool = False    # the drafter nodes' children were re-weighted per parent (datastore.NgramPrior)
    threads: int = 0             # CPU threads of the round's forwards (0: a record made before it was kept)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("index", "strategy", "stop_reason", "accepted", "choices", "tokens",
                                            "token_texts", "bonus", "context_len", "generated", "finished",
                                            "finish_reason", "rows", "conditioned", "threads")}
        d.update(tree=self.tree.to_dict(), trace=[x.to_dict() for x in self.trace],
                 expected_tokens=round(self.expected_tokens, 6),
                 predicted_verify_s=round(self.predicted_verify_s, 6),
                 measured_verify_s=round(self.measured_verify_s, 6),
                 round_overhead_s=round(self.round_overhead_s, 6),
                 times={k: round(v, 6) for k, v in asdict(self.times).items()},
                 elapsed_s=round(self.elapsed_s, 6), prefill_s=round(self.prefill_s, 6),
                 draft_logq=[[round(v, 4) for v in row] for row in self.draft_logq],
                 draft_ids=[list(row) for row in self.draft_ids], lookup_tokens=list(self.lookup_tokens),
                 lookup_rates=[round(r, 5) for r in self.lookup_rates],
                 datastore_tokens=list(self.datastore_tokens),
                 datastore_rates=[round(r, 5) for r in self.datastore_rates])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Step":
        return cls(
            index=int(d["index"]), strategy=str(d["strategy"]), tree=DraftTree.from_dict(d["tree"]),
            trace=[Decision(**x) for x in d.get("trace", [])], stop_reason=str(d.get("stop_reason", "")),
            accepted=[int(x) for x in d["accepted"]], choices=[int(x) for x in d.get("choices", [])],
            tokens=[int(x) for x in d["tokens"]], token_texts=[str(x) for x in d.get("token_texts", [])],
            bonus=int(d["bonus"]), expected_tokens=float(d["expected_tokens"]),
            predicted_verify_s=float(d["predicted_verify_s"]), measured_verify_s=float(d["measured_verify_s"]),
            round_overhead_s=float(d.get("round_overhead_s", 0.0)), times=StageTimes(**d["times"]),
            context_len=int(d["context_len"]), generated=int(d["generated"]), elapsed_s=float(d["elapsed_s"]),
            prefill_s=float(d.get("prefill_s", 0.0)),
            draft_logq=[[float(v) for v in row] for row in d.get("draft_logq", [])],
            draft_ids=[[int(v) for v in row] for row in d.get("draft_ids", [])],
            lookup_tokens=[int(v) for v in d.get("lookup_tokens", [])],
            lookup_rates=[float(v) for v in d.get("lookup_rates", [])], rows=int(d.get("rows", 0)),
            datastore_tokens=[int(v) for v in d.get("datastore_tokens", [])],
            datastore_rates=[float(v) for v in d.get("datastore_rates", [])],
            finished=bool(d.get("finished", False)), finish_reason=str(d.get("finish_reason", "")),
            conditioned=bool(d.get("conditioned", False)), threads=int(d.get("threads", 0)))


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    strategy: str
    steps: int
    tau: float
    tokens_per_s: float
    decode_s: float
    prefill_s: float
    finish_reason: str
    stage_s: dict = field(default_factory=dict)
    mean_tree_size: float = 0.0
    latency_error: float | None = None  # median |pred − meas| / meas after the first 10 rounds
    prompt_tokens: int = 0

    @classmethod
    def from_steps(cls, steps: list[Step], prompt_tokens: int,
                   decode: Callable[[list[int]], str] | None = None) -> "GenerationResult":
        """The summary of a run's rounds: τ = tokens / rounds (the bonus token counted), tokens/s over
        decode time (prefill excluded), the latency error as the median |pred − meas| / meas after
        the first 10 rounds; ``decode`` turns ids into text (None: the ids, space-separated)."""
        decode_s = steps[-1].elapsed_s
        ids = [t for s in steps for t in s.tokens]
        stage = {k: sum(getattr(s.times, k) for s in steps) for k in ("draft", "build", "verify", "commit")}
        errs = [abs(s.predicted_verify_s - s.measured_verify_s) / s.measured_verify_s
                for s in steps[10:] if s.measured_verify_s > 0]
        return cls(
            text=decode(ids) if decode is not None else " ".join(map(str, ids)), token_ids=ids,
            strategy=steps[0].strategy, steps=len(steps), tau=len(ids) / len(steps),
            tokens_per_s=len(ids) / decode_s if decode_s > 0 else 0.0, decode_s=decode_s,
            prefill_s=steps[0].prefill_s, finish_reason=steps[-1].finish_reason, stage_s=stage,
            mean_tree_size=statistics.fmean(len(s.tree) for s in steps),
            latency_error=statistics.median(errs) if errs else None, prompt_tokens=prompt_tokens)

    def to_dict(self) -> dict:
        return asdict(self)
