"""Acceptance that preserves the target's output distribution exactly.

T = 0 (greedy walk): the target's argmax at each node; from the root, move to the child carrying
that token while one exists. Accepted = the nodes walked, bonus = the argmax at the last one, so
the output equals plain greedy decoding token for token.

T > 0 (sample and walk): at the current node draw y ~ softmax(logits / T) (after top-k / top-p);
if a child carries y, move there and repeat, else emit y as the bonus and stop. Every emitted token
is a draw from the target's own conditional at its true prefix, so the output is distributed
exactly as the target's. Drawing one y per node up front and then walking is the same procedure,
which is what lets a kernel do all draws in one pass.

The random stream is indexed by (seed, position): a node at position q draws from row q. The walk
visits one node per position and no position is drawn twice in a request (committed positions only
grow), so the draws that matter are independent; and since the row depends on the position alone,
not on the tree, a seed gives the same sample whatever the strategy or tree size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import Kernels
from .kernels.reference import GumbelRows
from .tree import DraftTree


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0/None and top_p 1.0/None disable the filters."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def validate(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


@dataclass
class Acceptance:
    accepted: list[int]   # node indices walked, root first
    bonus: int            # the target's token after the last accepted node
    choices: list[int]    # the target's choice at every node (argmax or sample)


def target_choices(logits: torch.Tensor, params: SamplingParams, kernels: Kernels,
                   positions: torch.Tensor, noise: GumbelRows | None = None) -> torch.Tensor:
    """One token per node [n]: argmax at T = 0, else an exact tempered/filtered sample.

    ``positions`` [n] (the nodes' position ids) index the random stream. ``noise``: the request's
    memo of noise rows (:class:`~bastion.kernels.reference.GumbelRows`), used by backends that
    materialise the noise (``kernels.reuses_noise``); the draws are the same with or without it.
    """
    if params.temperature <= 0.0:
        return kernels.node_choice(logits, 0.0)
    thresholds = None
    if params.top_k or (params.top_p is not None and params.top_p < 1.0):
        thresholds = kernels.filter_thresholds(logits.float() / params.temperature, params.top_k or None, params.top_p)
    if noise is not None and kernels.reuses_noise:
        return kernels.node_choice(logits, params.temperature, thresholds, params.seed, 0, positions, noise=noise)
    return kernels.node_choice(logits, params.temperature, thresholds, params.seed, 0, positions)


def accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, kernels: Kernels,
           positions: torch.Tensor, noise: GumbelRows | None = None) -> Acceptance:
    """Walk the tree against the target's per-node choices (greedy or sampled)."""
    choices = target_choices(logits, params, kernels, positions, noise).tolist()
    accepted, bonus = kernels.tree_walk(tree.parents, tree.tokens, choices)
    return Acceptance(accepted, bonus, choices)
