"""When and how deep a request drafts: Bastion's per-request draft policies.

:class:`DraftDepth` picks how many of the block's depths to draft each round (and how many
candidates of each to keep), :class:`DraftGate` whether to draft at all. Both are plain state machines fed by the round loop (``bastion.engine``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .expansion import Expansion, extend_with_copy
from .tree import DraftTree


@dataclass
class DraftDepth:
    """How many of the block's B − 1 depths to draft: D for the block [root, MASK × D].

    The drafter's work grows with the depths drafted: its layers' rows, then the LM head over the
    draft vocabulary, the log-softmax, the top-k and the calibration. The throughput rule keeps trees
    shallow on a CPU: on the embedded target the deepest drafter node was at depth ≤ 6 in 99% of
    Bastion's rounds and never past 8 (9 eval prompts, 499 rounds), while a full block drafts 15.
    Bastion drafts D = max(``floor``, deepest drafter node of the last ``window`` trees + ``margin``),
    at most B − 1, and the full block until a tree has been seen; a tree that reaches D raises the
    next D, so a growing tree is never held back for long. The floor is there because the block
    attention is non-causal: a much shorter block than the drafter was trained on shifts its
    marginals (interleaved, all 30 eval prompts: with no floor τ 2.40 against the full block's 2.49;
    with a floor of 8, 2.43 against 2.46 and 1.86× against 1.79× AR, bench/NOTES.md).
    ``fixed`` trees of n nodes are at most n deep: they draft min(B − 1, n); ``chain`` (DFlash) the
    full block; ``window`` 0 keeps D at ``full``.

    The same trees bound how many candidates per depth the round needs on the host (:meth:`width`):
    a tree of n drafter nodes ranks below n at every depth, so Bastion keeps the top
    max(``min_width``, 2 × the largest of the last ``window`` trees) instead of its 128-node cap — the
    top-k, the calibration and the host lists of a draft over [D, 16] instead of [D, 128] (~0.3 ms a
    round on the 2-core Zen 3, session 32). A tree that would have wanted more is grown from fewer
    candidates that round (still verified, so still lossless) and doubles the next width.
    """

    full: int
    margin: int = 3
    window: int = 8
    floor: int = 8
    min_width: int = 16
    recent: deque = field(default_factory=deque)
    sizes: deque = field(default_factory=deque)

    def depth(self) -> int:
        if not self.recent:
            return self.full
        return max(1, min(self.full, max(self.floor, max(self.recent) + self.margin)))

    def reach(self) -> int:
        """One depth past the deepest drafter node of the last ``window`` trees (all ``full`` depths
        before the first tree, or when D is fixed): the depths worth coupling (``bastion.coupling``)."""
        return min(self.full, max(self.recent) + 1) if self.recent else self.full

    def width(self, cap: int) -> int:
        """Candidates per depth to keep for a tree of at most ``cap`` drafter nodes."""
        if not self.sizes:
            return cap
        return min(cap, max(self.min_width, 2 * max(self.sizes)))

    def observe(self, tree: DraftTree) -> None:
        """Record the deepest drafter node (rank ≥ 0) of a drafted tree and its drafter nodes
        (nothing when D is fixed)."""
        if self.window == 0:
            return
        drafted = [d for d, r in zip(tree.depths[1:], tree.ranks[1:]) if r >= 0]
        self.recent.append(max(drafted, default=0))
        self.sizes.append(len(drafted))
        if len(self.recent) > self.window:
            self.recent.popleft()
            self.sizes.popleft()


def refine_passes(cfg, drafter) -> int:
    """A request's refinement passes per draft (``DFlashDrafter.draft(refine=…)``): ``cfg.refine``, or
    when that is None the drafter's own ``refine_passes`` (its config.json: what it was trained and
    measured for; 0 for drafters without the key, such as published DFlash checkpoints). The engine
    passes ``refine`` only when this is > 0, so drafters whose ``draft`` lacks the parameter still run."""
    if cfg.refine is not None:
        return cfg.refine
    return int(getattr(getattr(drafter, "cfg", None), "refine_passes", 0) or 0)


def depth_policy(cfg, drafter) -> DraftDepth:
    """A request's :class:`DraftDepth`: adaptive for Bastion (unless ``cfg.adaptive_depth`` is off),
    else fixed at the block's B − 1 depths (``fixed``: at most its budget; no drafter: 1)."""
    full = drafter.block_size - 1 if drafter is not None else 1
    if cfg.strategy == "bastion" and cfg.adaptive_depth:
        return DraftDepth(full)
    return DraftDepth(min(full, cfg.budget) if cfg.strategy == "fixed" else full, window=0)


@dataclass
class DraftGate:
    """Bastion's size-zero option: skip the draft while drafting is predicted not to pay.

    The throughput rule sizes a tree once the draft is paid for. One size is left out: no draft at
    all. After each draft the gate compares the round's two options as the round loop would build
    them, copy sources' branches included in both (:func:`plain_rate`): the merged tree's predicted
    rate S_n / (T_d + T_o + C(n)) against a round without the draft, the root and the copied chains
    priced at their "alone" rates, S_m / (T_o + C(m)) (with no copy source, 1 / (T_o + C(1))).
    Judging the drafter's tree alone against a bare step (sessions 2–53) undervalued both sides
    where the copies are strong. When the tree loses, the next
    ``skip`` rounds go without a draft (1, 2, 4, … up to ``max_skip`` while it keeps losing; back to 1
    as soon as a draft pays). Skipped rounds still feed the drafter's context, and every round is
    verified by the target, so the output is unchanged: only the speed on a weak drafter (or at a
    high temperature) is protected.
    """

    max_skip: int = 8
    skip: int = 1
    left: int = 0
    tree_rate: float = 0.0
    plain_rate: float = 0.0

    def draft_now(self) -> bool:
        if self.left > 0:
            self.left -= 1
            return False
        return True

    def judge(self, tree_rate: float, plain_rate: float) -> None:
        self.tree_rate, self.plain_rate = tree_rate, plain_rate
        if tree_rate < plain_rate:
            self.left, self.skip = self.skip, min(2 * self.skip, self.max_skip)
        else:
            self.skip = 1

    def reason(self) -> str:
        return (f"draft skipped: the last tree was predicted at {self.tree_rate:.1f} tok/s, "
                f"below a round without it at {self.plain_rate:.1f} tok/s")


def plain_rate(root: int, proposals: list, copies, cost: Callable[[int], float], overhead: float,
               max_nodes: int, max_depth: int) -> float:
    """Predicted tokens/s of this round had it not drafted: the root plus each copy proposal
    (``lookup.Sourced``) merged as the round loop merges it, its new nodes priced at the rates
    ``copies`` (``lookup.CopySources``) gives a source's tokens when no draft is there ("alone"),
    S_m / (T_o + C(m)) with ``overhead`` = T_o — the tree a skipped round verifies, built on a
    throwaway :class:`Expansion`."""
    exp = Expansion(DraftTree.root_only(root))
    for prop in proposals:
        extend_with_copy(exp, prop.proposal.tokens, prop.reuse_rates, cost, overhead, max_nodes, max_depth,
                         prop.source, copies.stats[prop.source].rates(prop.proposal, "alone"))
    return exp.tree.expected_tokens / max(overhead + cost(len(exp.tree)), 1e-12)
