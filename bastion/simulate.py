"""Simulated decoders over a teacher-forced reply (no model; ``heldout.evaluate`` runs them).

A reply's anchors a = prompt_len − 1 … n − 2 are the places a decoding round can start. Each function
below says, per anchor, how many of the reply's next tokens one kind of round would accept — prompt
lookup's proposal, the datastore's, the drafter's best-first tree of N nodes — and
:func:`simulate_tau` strings those rounds together as a decoder does: a round at a accepts
``accepted[a]`` tokens plus the bonus, and the next round starts where it ended.
"""

from __future__ import annotations

from .expansion import BudgetRule, Rerank, best_first_from_topk
from .lookup import CopySources, NgramIndex


def tree_lengths(rec: dict, lists: list[tuple[list, list]], size: int, prior=None) -> list[int]:
    """For every anchor a: how many tokens of the reply after a the best-first tree of ``size`` drafter
    nodes (``expansion.best_first_from_topk``, a fixed budget, ranked by the drafter's raw q: the
    engine's ``fixed:N`` with calibration off) holds as one path from its root token_a. With ``prior``
    (datastore.NgramPrior) each node's children are re-weighted by its last two tokens first
    (``expansion.Rerank``), as Bastion's trees are at T = 0. ``lists``: ``heldout.scan``'s top-k lists,
    k ≥ ``size`` (and ≥ the re-weighting's 8 candidates with a prior)."""
    ids, P, out = rec["ids"], rec["prompt_len"], []
    for a, (vals, tops) in zip(range(P - 1, len(ids) - 1), lists):
        tree = best_first_from_topk(ids[a], vals, tops, BudgetRule("fixed", budget=size, max_depth=len(vals)),
                                    rerank=Rerank(vals, tops, prior) if prior is not None else None,
                                    before_root=ids[a - 1] if a else None).tree
        kids, node, k = tree.children(), 0, 0
        while a + 1 + k < len(ids):
            node = next((c for c in kids[node] if tree.tokens[c] == ids[a + 1 + k]), None)
            if node is None:
                break
            k += 1
        out.append(k)
    return out


def _matched(proposal, truth: list[int]) -> int:
    k = 0
    if proposal is not None:
        while k < min(len(proposal.tokens), len(truth)) and proposal.tokens[k] == truth[k]:
            k += 1
    return k


def datastore_lengths(rec: dict, datastore, max_tokens: int = 10) -> list[int]:
    """For every anchor a: how many tokens the datastore proposes after ids[:a+1] match the reply."""
    ids, P = rec["ids"], rec["prompt_len"]
    ctx = CopySources.CONTEXT  # the engine's datastore queries see this many committed tokens
    return [_matched(datastore.propose(ids[max(0, a + 1 - ctx):a + 1], max_tokens), ids[a + 1:a + 1 + max_tokens])
            for a in range(P - 1, len(ids) - 1)]


def lookup_lengths(rec: dict, max_ngram: int = 3, max_tokens: int = 10) -> list[int]:
    """For every anchor a: how many proposed tokens of prompt lookup over ids[:a+1] match the reply."""
    ids, P = rec["ids"], rec["prompt_len"]
    index = NgramIndex(ids[:P], max_ngram)
    out = []
    for a in range(P - 1, len(ids) - 1):
        out.append(_matched(index.propose(max_tokens), ids[a + 1:a + 1 + max_tokens]))
        index.extend([ids[a + 1]])
    return out


def simulate_tau(accepted: list[int]) -> tuple[int, int]:
    """(tokens, rounds) of a decoder whose round at anchor a accepts accepted[a] drafts plus a bonus."""
    a = tokens = rounds = 0
    while a < len(accepted):
        step = accepted[a] + 1
        tokens, rounds, a = tokens + step, rounds + 1, a + step
    return tokens, rounds


def simulations(rec: dict, lengths: list[int], lists: list[tuple[list, list]], datastore,
                 trees: tuple[int, ...]) -> dict[str, list[int]]:
    """Per simulated decoder (``heldout.evaluate``'s τ columns), the tokens its round at each anchor accepts."""
    looks = lookup_lengths(rec)
    sims = {"chain": lengths, "lookup": looks, "both": [max(x, y) for x, y in zip(lengths, looks)]}
    if datastore is not None:
        sims["datastore"] = datastore_lengths(rec, datastore)
        sims["all"] = [max(x, y) for x, y in zip(sims["both"], sims["datastore"])]
    from .datastore import NgramPrior

    prior = NgramPrior(datastore) if trees and datastore is not None else None  # counts cached on the datastore
    for size in trees:
        sims[f"fixed:{size}"] = tree_lengths(rec, lists, size)
        if prior is not None:
            sims[f"cond:{size}"] = cond = tree_lengths(rec, lists, size, prior)
            # Bastion's tree at this size with its two copy branches: a round accepts at least the
            # longest of the three (a lower bound: merged into one trie, a path may switch branches)
            sims[f"all:{size}"] = [max(x, y) for x, y in zip(cond, sims["all"])]
    return sims
