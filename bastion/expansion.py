"""Tree construction from the drafter's position-wise marginals: chain, fixed budget, adaptive.

Best-first enumeration (a max-heap on log P): popping node (depth d, rank r) pushes its first
child (d+1, rank 0) and its next sibling (d, rank r+1, same parent). Nodes pop in non-increasing
P and a parent always pops before its children, so the first n pops are the best tree of size n
under the surrogate P(v) = Π q_i(y_i).

Budget awareness (Bastion): with n nodes, S_n = Σ P, C(n) the predicted verification time and
T = T_d + T_o, candidate p is worth adding iff it raises predicted throughput:

    (S_n + p) / (T + C(n+1)) > S_n / (T + C(n))  ⇔  p·(T + C(n)) > S_n·(C(n+1) − C(n)).

After the first failure we keep popping up to ``lookahead`` more candidates and take them if the
throughput of the longer prefix beats the best so far (a step in a non-convex C can hide a better
size just beyond it); the tree returned is the best prefix seen.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .tree import DraftTree


@dataclass
class Decision:
    """One popped candidate: where it sits, its confidence, and what the budget rule said."""

    node: int            # index it got (or would have got) in the tree
    depth: int
    token: int
    parent: int
    p: float             # path confidence of the candidate
    expected: float      # S_{n+1} if added
    cost: float          # predicted C(n+1) in seconds
    throughput: float    # predicted (S_{n+1}) / (T + C(n+1)) in tokens/s
    added: bool
    reason: str
    source: str = "draft"  # "draft" (the drafter's marginals), "lookup" (prompt lookup) or "datastore"

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("p", "expected", "cost", "throughput"):
            d[k] = float(f"{d[k]:.6g}")
        return d


@dataclass
class Expansion:
    """The tree a strategy chose, the decision trace behind it, and the predictions at its size."""

    tree: DraftTree
    trace: list[Decision] = field(default_factory=list)
    stop_reason: str = ""
    root_cost: float = 0.0        # predicted C(1)
    root_throughput: float = 0.0  # predicted 1 / (T + C(1))
    round_overhead: float = 0.0   # T = T_d + T_o used for the decisions
    conditioned: bool = False     # children listed per node (Rerank), not per depth


@dataclass(frozen=True)
class BudgetRule:
    """How big a tree to grow. kind: 'fixed' (exactly ``budget`` draft nodes when available) or
    'adaptive' (the throughput rule); caps apply to both. Sizes count draft nodes, root excluded."""

    kind: str = "adaptive"
    budget: int = 32
    max_nodes: int = 256
    max_depth: int = 15
    min_nodes: int = 0
    lookahead: int = 8


@dataclass
class Rerank:
    """Per-node candidate lists for :func:`best_first_from_topk`: under a node whose last two tokens
    are (prev, last), depth d's top ``width`` drafter candidates re-weighted by ``prior``
    (datastore.NgramPrior.reweight: q → q'), then mapped to log confidences by ``calibrate``
    ((depth, [q']) → [log g], the calibrator's scalar form; None: log q'), sorted descending (stable: ties
    keep the drafter's order). A node's stored marginal is its q' — what the calibrator then learns
    from — and its rank its place in its parent's list.

    ``raw``/``ids``: per depth 1..D, the drafter's top-k log q (descending) and token ids."""

    raw: list[list[float]]
    ids: list[list[int]]
    prior: object  # datastore.NgramPrior (duck-typed: ``reweight(prev, last, q, tokens, mass)``)
    calibrate: Callable[[int, list[float]], list[float]] | None = None
    width: int = 8
    _depths: dict[int, tuple] = field(default_factory=dict, repr=False)  # per depth: see _depth

    def _depth(self, depth: int) -> tuple[list[float], list[float], list[int], float, float]:
        """(top-``width`` log q, q, their ids, their mass M, the bound) of one depth, made once."""
        got = self._depths.get(depth)
        if got is None:
            logq, toks = self.raw[depth - 1][:self.width], self.ids[depth - 1][:self.width]
            q = [math.exp(v) for v in logq]
            mass = min(math.fsum(q), 1.0)
            bound = self.calibrate(depth, [mass])[0] if self.calibrate else (math.log(mass) if mass > 0 else -math.inf)
            got = self._depths[depth] = (logq, q, toks, mass, bound)
        return got

    def bound(self, depth: int) -> float:
        """An upper bound on the best child's log confidence at ``depth`` under any node: q' ≤ the
        candidates' drafter mass M (the re-weighting keeps M), and g is non-decreasing. Lets the
        builder list a node's children only when that bound comes up in its heap."""
        return self._depth(depth)[4]

    def __call__(self, depth: int, prev: int | None, last: int) -> tuple[list[float], list[int], list[float]]:
        logq, q, toks, mass, _ = self._depth(depth)
        qc = self.prior.reweight(prev, last, q, toks, mass)
        if qc is None:
            cond, qc = logq, q
        else:
            log = math.log
            cond = [log(x) if x > 0 else -math.inf for x in qc]
        g = self.calibrate(depth, qc) if self.calibrate else cond
        order = sorted(range(len(toks)), key=g.__getitem__, reverse=True)
        return [g[j] for j in order], [toks[j] for j in order], [cond[j] for j in order]


def topk_tensors(logq: torch.Tensor, k: int, vocab: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per depth, the top-k log-probabilities [D, k] (descending) and their token ids [D, k].

    ``vocab`` [V_d] maps column j of logq [D, V_d] to its token id (a drafter's draft vocabulary).
    """
    vals, ids = torch.topk(logq, min(k, logq.shape[-1]), dim=-1)
    if vocab is not None:
        ids = vocab.to(ids.device)[ids]
    return vals, ids


def topk_marginals(logq: torch.Tensor, k: int, vocab: torch.Tensor | None = None
                   ) -> tuple[list[list[float]], list[list[int]]]:
    """:func:`topk_tensors` as Python lists (one host transfer each)."""
    vals, ids = topk_tensors(logq, k, vocab)
    return vals.float().cpu().tolist(), ids.cpu().tolist()


def chain_tree(root: int, logq: torch.Tensor, max_depth: int) -> Expansion:
    """DFlash: the argmax at every depth, one path of min(B−1, max_depth) nodes."""
    vals, ids = topk_marginals(logq[:max_depth], 1)
    return chain_from_topk(root, vals, ids)


def chain_from_topk(root: int, vals: list[list[float]], ids: list[list[int]],
                    raw: list[list[float]] | None = None) -> Expansion:
    """The chain through the rank-0 token of every depth (lists as from :func:`topk_marginals`;
    ``raw``: see :func:`best_first_from_topk`)."""
    tree = DraftTree.root_only(root)
    raw = raw or vals
    logp = 0.0
    for d, (v, t) in enumerate(zip(vals, ids)):
        logp += v[0]
        tree.add(t[0], d, math.exp(raw[d][0]), math.exp(logp), 0)
    return Expansion(tree, stop_reason="chain: the argmax of every depth")


def best_first_tree(root: int, logq: torch.Tensor, rule: BudgetRule,
                    cost: Callable[[int], float] | None = None, round_overhead: float = 0.0) -> Expansion:
    """Grow a tree best-first from logq [D, V], the drafter's log-probabilities of depths 1..D.

    See :func:`best_first_from_topk`; this only extracts the per-depth top-k lists.
    """
    limit = min(rule.budget if rule.kind == "fixed" else rule.max_nodes, rule.max_nodes)
    vals, ids = topk_marginals(logq[:max(0, min(rule.max_depth, logq.shape[0]))], max(limit, 1))
    return best_first_from_topk(root, vals, ids, rule, cost, round_overhead)


def best_first_from_topk(root: int, vals: list[list[float]], ids: list[list[int]], rule: BudgetRule,
                         cost: Callable[[int], float] | None = None, round_overhead: float = 0.0,
                         raw: list[list[float]] | None = None, rerank: "Rerank | None" = None,
                         before_root: int | None = None) -> Expansion:
    """Grow a tree best-first.

    Args:
        root: the root token (node 0).
        vals, ids: per depth 1..D, the top-k log confidences (descending) and token ids: the drafter's
            log q, or calibrated log g(q) (calibration.py), which the path probabilities multiply.
        raw: the drafter's log q for the same entries when ``vals`` are calibrated; stored as the
            nodes' marginals (default: ``vals``).
        rule: fixed budget or adaptive rule, with caps.
        cost: n_nodes -> predicted verification seconds C(n) (tree size including the root);
            required for 'adaptive', used for the trace of 'fixed'.
        round_overhead: T = T_d + T_o in seconds.
        rerank: per-node candidate lists (:class:`Rerank`): the children of a node are then depth
            d+1's candidates re-weighted by the node's last two tokens, not one list shared by the
            whole depth. Best-first stays exact as long as each list is sorted and its values are
            ≤ 0 (a child never beats its parent).
        before_root: the committed token before the root (the root's children's history).
    """
    max_depth = min(rule.max_depth, len(vals))
    limit = min(rule.budget if rule.kind == "fixed" else rule.max_nodes, rule.max_nodes)
    c_now = cost(1) if cost else 0.0
    exp = Expansion(DraftTree.root_only(root), root_cost=c_now, round_overhead=round_overhead,
                    root_throughput=1.0 / (round_overhead + c_now) if cost and round_overhead + c_now > 0 else 0.0,
                    conditioned=rerank is not None)
    if limit <= 0 or max_depth <= 0 or not vals[0]:
        exp.stop_reason = "budget 0: root only"
        return exp
    frontier = _Frontier(root, vals, ids, raw or vals, max_depth, rerank, before_root)
    s_total, best_thr, best_n, misses = 1.0, exp.root_throughput, 1, 0
    while frontier.popped < limit and (node := frontier.pop()) is not None:
        idx, d, token, parent, p = node
        s_total += p
        c_next = cost(idx + 1) if cost else 0.0
        denom = round_overhead + c_next
        thr = s_total / denom if cost and denom > 0 else 0.0
        if rule.kind == "fixed":
            exp.trace.append(Decision(idx, d, token, parent, p, s_total, c_next, thr, True, "within fixed budget"))
            best_n = idx + 1
            continue
        if thr > best_thr or idx <= rule.min_nodes:
            reason = "raises predicted throughput" if thr > best_thr else "below minimum size"
            exp.trace.append(Decision(idx, d, token, parent, p, s_total, c_next, thr, True, reason))
            # decisions tentatively made in a look-ahead window become real once a later prefix wins
            for dec in exp.trace[best_n - 1:-1]:
                dec.added, dec.reason = True, "kept: a longer prefix wins"
            best_thr, best_n, misses = max(thr, best_thr), idx + 1, 0
            continue
        misses += 1
        exp.trace.append(Decision(idx, d, token, parent, p, s_total, c_next, thr, False,
                                  "look-ahead: no gain yet" if misses <= rule.lookahead else "no gain"))
        if misses > rule.lookahead:
            break
    frontier.materialise(exp.tree, best_n - 1)
    exp.stop_reason = _stop_reason(rule, exp, limit, frontier.popped, misses > rule.lookahead, best_n)
    for dec in exp.trace[best_n - 1:]:
        if dec.added:
            dec.added, dec.reason = False, "dropped: beyond the best prefix"
    return exp


class _Frontier:
    """Best-first enumeration of a draft tree's candidates in non-increasing path log P.

    Each node has a candidate list for its children — (log confidences descending, ids, raw log q) —
    either depth d+1's list shared by all nodes of depth d, or with ``rerank`` its own, made when the
    node's lazy entry (rank −1, keyed by ``rerank.bound``, an upper bound on its best child) comes up.
    The heap holds, per list in use, only its next unpopped entry: (−log P, tie-breaker, depth, rank,
    parent, log P of parent). Popping entry (d, r) pushes (d, r+1) under the same parent and the
    popped node's first child; since every list is sorted and ≤ 0, that is exactly the order of P.

    ``vals`` / ``ids`` / ``raw``: per depth 1..D the top-k lists, as in :func:`best_first_from_topk`.
    Popped nodes are numbered 1, 2, ... in pop order and kept until :meth:`materialise`."""

    def __init__(self, root: int, vals: list[list[float]], ids: list[list[int]], raw: list[list[float]],
                 max_depth: int, rerank: Rerank | None, before_root: int | None):
        self.shared = list(zip(vals, ids, raw))
        self.max_depth, self.rerank = max_depth, rerank
        self.lists = {0: rerank(1, before_root, root) if rerank else self.shared[0]}
        self.last_two = {0: (before_root, root)}  # with rerank: each listed node's history
        self.heap = [(-self.lists[0][0][0], 0, 1, 0, 0, 0.0)] if self.lists[0][0] else []
        self.counter = 1
        self.nodes: list[tuple[int, int, float, float, int]] = []  # (token, parent, marginal, P, rank)

    @property
    def popped(self) -> int:
        return len(self.nodes)

    def _push(self, neg_logp: float, depth: int, rank: int, parent: int, parent_logp: float) -> None:
        heapq.heappush(self.heap, (neg_logp, self.counter, depth, rank, parent, parent_logp))
        self.counter += 1

    def pop(self) -> tuple[int, int, int, int, float] | None:
        """The next best candidate as (node index, depth, token, parent, P), or None when none is left."""
        heap, rerank = self.heap, self.rerank
        while heap:
            neg, _, d, r, parent, parent_logp = heapq.heappop(heap)
            if r < 0:  # a node's children, listed only now that the bound on the best of them came up
                self.lists[parent] = rerank(d, *self.last_two[parent])
                if self.lists[parent][0]:
                    self._push(-(parent_logp + self.lists[parent][0][0]), d, 0, parent, parent_logp)
                continue
            logp = -neg
            idx = len(self.nodes) + 1
            lv, lt, lq = self.lists[parent]
            token = lt[r]
            p = math.exp(logp)
            self.nodes.append((token, parent, math.exp(lq[r]), p, r))
            if r + 1 < len(lv):
                self._push(-(parent_logp + lv[r + 1]), d, r + 1, parent, parent_logp)
            if d < self.max_depth:
                if rerank:  # lazily: most popped nodes' children never come up (see Rerank.bound)
                    self.last_two[idx] = (self.last_two[parent][1], token)
                    self._push(-(logp + rerank.bound(d + 1)), d + 1, -1, idx, logp)
                elif self.shared[d][0]:
                    self.lists[idx] = self.shared[d]
                    self._push(-(logp + self.shared[d][0][0]), d + 1, 0, idx, logp)
            return idx, d, token, parent, p
        return None

    def materialise(self, tree: DraftTree, n: int) -> None:
        """Add the first ``n`` popped nodes to ``tree`` (parents always come first)."""
        for token, parent, marginal, path_p, r in self.nodes[:n]:
            tree.add(token, parent, marginal, path_p, r)


def _stop_reason(rule: BudgetRule, exp: Expansion, limit: int, popped: int, no_gain: bool, best_n: int) -> str:
    """Why the builder stopped, in words for the trace view."""
    if rule.kind == "fixed":
        return f"fixed budget of {limit} nodes reached" if popped >= limit else "candidates exhausted"
    if no_gain:
        return (f"next node lowers predicted throughput (p={exp.trace[best_n - 1].p:.3g} too small "
                f"for its cost); best size {best_n} nodes")
    if popped >= limit:
        return f"cap of {limit} draft nodes reached"
    return "candidates exhausted"


COPY_RANKS = {"lookup": -1, "datastore": -2}  # DraftTree.ranks of nodes a copy source added


def extend_with_copy(exp: Expansion, tokens: list[int], rates: list[float], cost: Callable[[int], float],
                     round_overhead: float, max_nodes: int, max_depth: int, source: str = "lookup",
                     fresh_rates: list[float] | None = None) -> list[int]:
    """Merge a copied proposal (prompt lookup, or the datastore: ``source``) into ``exp.tree`` and
    keep the prefix the throughput rule pays for.

    The proposal is walked down the tree as a trie path: while a child carries the next proposed
    token, it is reused. The rest hangs below as a chain of new nodes (rank −1 for prompt lookup, −2
    for the datastore: not the drafter's)
    with path confidence P = P_attach · Π r_d, where r_d = ``rates[d−1]`` estimates the acceptance of
    proposed token d given token d−1, and P_attach = max(the attach node's P, Π of the rates of the
    reused part). With S = the tree's S_n and n its size, the j new nodes maximising
    (S + Σ_{k≤j} P_k) / (T + C(n + j)) are kept, if that beats the tree without them. ``fresh_rates``
    (default ``rates``) price the new nodes and ``rates`` the reused part: a copied token that
    contradicts the drafter is accepted less often than one the drafter also proposed (lookup.py).

    Returns the node index of each proposed token now in the tree (reused or new), in order.
    """
    tree = exp.tree
    kids = tree.children()
    node, chain = 0, []
    while len(chain) < len(tokens):
        nxt = next((c for c in kids[node] if tree.tokens[c] == tokens[len(chain)]), None)
        if nxt is None:
            break
        node = nxt
        chain.append(node)
    i = len(chain)
    if fresh_rates is not None:
        rates = list(rates[:i]) + list(fresh_rates[i:])
    reused = 1.0
    for r in rates[:i]:
        reused *= r
    p = max(tree.path_probs[node], reused)
    n0, s_total = len(tree), tree.expected_tokens
    best_thr, best_j = s_total / max(round_overhead + cost(n0), 1e-12), 0
    trace = []
    for j, (tok, r) in enumerate(zip(tokens[i:], rates[i:]), start=1):
        if n0 - 1 + j > max_nodes or tree.depths[node] + j > max_depth:
            break
        p *= r
        s_total += p
        c = cost(n0 + j)
        thr = s_total / max(round_overhead + c, 1e-12)
        trace.append((tok, p, s_total, c, thr))
        if thr > best_thr:
            best_thr, best_j = thr, j
    parent = node
    for j, (tok, p, s, c, thr) in enumerate(trace, start=1):
        keep = j <= best_j
        idx = n0 + j - 1
        would_be_parent = parent if keep else (node if j == 1 else idx - 1)
        exp.trace.append(Decision(idx, tree.depths[node] + j, tok, would_be_parent, p, s, c, thr, keep,
                                  f"{source}: kept (raises predicted throughput)" if keep else f"{source}: no gain",
                                  source=source))
        if keep:
            parent = tree.add(tok, parent, rates[i + j - 1], p, COPY_RANKS.get(source, -1))
            chain.append(parent)
    if trace:
        exp.stop_reason += f" · {source}: {best_j} of {len(trace)} proposed nodes kept"
    return chain
