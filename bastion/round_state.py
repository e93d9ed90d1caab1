"""What :class:`~bastion.engine.Engine`'s round loop carries: a request's state from round to round,
and within a round the draft (on the host) and the plan (the tree and the target's inputs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .calibration import AcceptanceCalibrator
from .config import GenerationConfig
from .coupling import DraftNoise
from .draft_policy import DraftDepth, DraftGate
from .drafter import DrafterCache
from .expansion import Expansion
from .kernels.reference import GumbelRows
from .lookup import CopySources
from .textstream import TextStream
from .threads import ThreadGovernor
from .tree import DraftTree


@dataclass
class Request:
    """What one request carries from round to round: the root (the last committed token, not yet in
    the target's cache) and the token before it, counts, and the per-request state of each stage."""

    cfg: GenerationConfig
    root: int
    before_root: int | None
    committed: int                  # tokens committed so far, prompt included (the root among them)
    dcache: DrafterCache | None     # the drafter's context cache (None: AR, or no drafter)
    vocab: torch.Tensor | None      # the draft vocabulary, widened by this request's tokens
    in_vocab: set[int]
    calib: AcceptanceCalibrator
    copies: CopySources | None
    gate: DraftGate | None
    depth: DraftDepth
    noise: GumbelRows | None
    governor: ThreadGovernor | None
    prefill_s: float
    generated: int = 0
    index: int = 0
    text: TextStream | None = None  # the new tokens' text pieces (None: no tokenizer, the ids as text)
    draft_noise: DraftNoise | None = None  # T > 0, coupled drafting: noise rows at the draft vocabulary


@dataclass
class Draft:
    """One round's draft on the host: ``topk`` = (log confidences, ids), each D lists of k (the
    confidences calibrated when the request calibrates), ``raw`` the drafter's own log q when the
    confidences differ from it."""

    topk: tuple[list[list[float]], list[list[int]]]
    raw: list[list[float]] | None


@dataclass
class Plan:
    """The tree a round verifies (with the copy sources merged) and its target inputs: ``rows``
    tokens (the tree padded with dummy rows), the additive mask (1, 1, rows, prefix + rows) and the
    position ids (1, rows)."""

    exp: Expansion
    proposals: list
    rows: int
    tokens: torch.Tensor
    mask: torch.Tensor
    pos: torch.Tensor

    @property
    def tree(self) -> DraftTree:
        return self.exp.tree

    def proposed(self, source: str) -> tuple[list[int], list[float]]:
        """(tokens, rates) of this round's proposal from ``source`` ("lookup", "datastore"), empty when it had none."""
        p = next((p for p in self.proposals if p.source == source), None)
        return (list(p.proposal.tokens), p.used_rates()) if p is not None else ([], [])
