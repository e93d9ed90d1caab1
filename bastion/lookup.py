"""Prompt lookup as a second draft source for Bastion's tree.

Replies copy from their context: names and numbers from the prompt, identifiers in code, whole
phrases when a small model repeats itself. Prompt-lookup decoding (Saxena 2023; transformers'
``prompt_lookup_num_tokens``) drafts such copies for free: find the latest earlier occurrence of the
context's last n tokens and propose what followed it. A block-diffusion drafter predicts some of
these too, but not all, and the two err in different places, so Bastion puts both in one tree:

- :class:`NgramIndex` keeps, for n = 1..N, the latest position where each n-gram of the committed
  tokens ended, updated as tokens are committed (O(N) per token; no scan of the context per round).
- :class:`LookupStats` estimates r(n, d, kind) = P(the d-th proposed token is accepted | the (d−1)-th
  was), for a match of length n, online from verified trees (Beta prior, geometric forgetting).
  ``kind`` says how the token entered the tree, because the same copy is worth less where it
  contradicts the drafter: "reuse" (a drafter node already carried it: both sources agree),
  "branch" (a new node in a round that drafted: the drafter predicted something else there or
  nothing) and "alone" (a new node in a round without a draft). One pooled rate over-stated
  branches: at T = 0 trees holding drafter and copy nodes expected 3.6 tokens and accepted 2.9.
- ``expansion.extend_with_copy`` merges the proposal into the drafter's tree as a trie path and
  keeps the prefix the throughput rule pays for, with path confidence P = Π r.

Verification is unchanged, so the output stays exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Proposal:
    """A lookup draft: ``tokens`` continue the context after its last token; ``ngram`` is the
    length of the matched suffix (longer matches are more reliable)."""

    tokens: list[int]
    ngram: int


class NgramIndex:
    """Latest end position of every n-gram (n ≤ max_ngram) of a growing token sequence.

    Only n-grams that end *before* the last token are indexed, so a lookup of the current suffix
    finds an earlier occurrence, never itself.
    """

    def __init__(self, tokens: list[int], max_ngram: int = 3):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            end = len(self.tokens) - 1  # the old last token: its n-grams become "earlier" now
            for n in range(1, self.max_ngram + 1):
                if end - n + 1 < 0:
                    break
                self.last[tuple(self.tokens[end - n + 1:end + 1])] = end
            self.tokens.append(int(t))

    def propose(self, max_tokens: int) -> Proposal | None:
        """What followed the latest earlier occurrence of the longest matching suffix (at most
        ``max_tokens`` tokens, never past the current end)."""
        L = len(self.tokens)
        if max_tokens < 1:
            return None
        for n in range(min(self.max_ngram, L), 0, -1):
            end = self.last.get(tuple(self.tokens[L - n:]))
            if end is not None:
                out = self.tokens[end + 1:min(end + 1 + max_tokens, L)]
                if out:
                    return Proposal(out, n)
        return None


KINDS = ("reuse", "branch", "alone")


@dataclass
class LookupStats:
    """r(n, d, kind) = P(proposed token d accepted | token d−1 accepted) for a match of length n and a
    token that entered the tree as ``kind`` (one of :data:`KINDS`, see the module docstring).

    Counts decay by ``decay`` per observed round; ``prior_rate`` and ``prior_strength`` form a Beta
    prior, so an unseen cell starts at a cautious rate. Depths beyond ``max_depth`` share a cell.
    """

    prior_rate: float = 0.3
    prior_strength: float = 2.0
    decay: float = 0.995
    max_depth: int = 8
    hits: dict[tuple[int, int, str], float] = field(default_factory=dict)
    tries: dict[tuple[int, int, str], float] = field(default_factory=dict)

    def _key(self, ngram: int, depth: int, kind: str) -> tuple[int, int, str]:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
        return ngram, min(depth, self.max_depth), kind

    def rate(self, ngram: int, depth: int, kind: str = "alone") -> float:
        k = self._key(ngram, depth, kind)
        return ((self.hits.get(k, 0.0) + self.prior_rate * self.prior_strength)
                / (self.tries.get(k, 0.0) + self.prior_strength))

    def rates(self, proposal: Proposal, kind: str = "alone") -> list[float]:
        return [self.rate(proposal.ngram, d, kind) for d in range(1, len(proposal.tokens) + 1)]

    def observe(self, ngram: int, chain: list[int], parents_accepted: list[bool], accepted: set[int],
                kinds: list[str] | None = None) -> None:
        """``chain[d−1]`` is the tree node carrying proposed token d (merged or new) and ``kinds[d−1]``
        how it got there (default "alone"); a token counts only when its parent was accepted
        (otherwise it was never tested)."""
        for k in self.tries:
            self.tries[k] *= self.decay
            self.hits[k] *= self.decay
        kinds = kinds or ["alone"] * len(chain)
        for d, (node, tested, kind) in enumerate(zip(chain, parents_accepted, kinds), start=1):
            if not tested:
                break
            k = self._key(ngram, d, kind)
            self.tries[k] = self.tries.get(k, 0.0) + 1.0
            self.hits[k] = self.hits.get(k, 0.0) + (1.0 if node in accepted else 0.0)


@dataclass
class Sourced:
    """One copy source's proposal in one round: ``source`` names it ("lookup" or "datastore"),
    ``rates`` are its estimated r_d for new nodes ("branch" or "alone", as the round drafted or not),
    ``reuse_rates`` for tokens a drafter node already carries, ``chain`` the tree nodes that carry
    its tokens once merged and ``reused`` how many of them were already there."""

    source: str
    proposal: Proposal
    rates: list[float]
    reuse_rates: list[float]
    fresh: str = "alone"
    chain: list[int] = field(default_factory=list)
    reused: int = 0

    def kinds(self) -> list[str]:
        """How each proposed token entered the tree: "reuse" for the first ``reused``, then ``fresh``."""
        return ["reuse"] * self.reused + [self.fresh] * (len(self.proposal.tokens) - self.reused)

    def used_rates(self) -> list[float]:
        """The rate each proposed token was priced at in the merge (what a replay must use)."""
        return self.reuse_rates[:self.reused] + self.rates[self.reused:]


class CopySources:
    """A request's copy-based draft sources beside the drafter: prompt lookup over its own tokens
    (:class:`NgramIndex`) and, when given, a datastore of the target's earlier replies
    (``bastion.datastore``). Each proposes a continuation of the committed tokens every round, is
    merged into the tree by ``expansion.extend_with_copy`` and learns its own rates r(n, d).

    ``stats`` maps a source name to its :class:`LookupStats`; a source without stats is off.
    """

    CONTEXT = 8  # committed tokens kept for datastore queries (its n-grams are shorter)

    def __init__(self, prompt_ids: list[int], max_tokens: int, stats: dict[str, LookupStats],
                 lookup_ngram: int = 3, datastore=None):
        self.stats = stats
        self.index = NgramIndex(prompt_ids, lookup_ngram) if "lookup" in stats else None
        self.datastore = datastore if "datastore" in stats else None
        self.recent = list(prompt_ids[-self.CONTEXT:])
        self.max_tokens = max_tokens

    def propose(self, drafted: bool = True) -> list[Sourced]:
        """This round's proposals (prompt lookup first), each with its current rates; ``drafted`` says
        whether the tree they join holds a draft (their new nodes are then "branch", else "alone")."""
        found = []
        if self.index is not None:
            found.append(("lookup", self.index.propose(self.max_tokens)))
        if self.datastore is not None:
            found.append(("datastore", self.datastore.propose(self.recent, self.max_tokens)))
        fresh = "branch" if drafted else "alone"
        return [Sourced(name, p, self.stats[name].rates(p, fresh), self.stats[name].rates(p, "reuse"), fresh)
                for name, p in found if p is not None]

    def observe(self, parents: list[int], proposals: list[Sourced], accepted: list[int]) -> None:
        """After verification: each proposed token whose parent was accepted counts as one try."""
        on_path = set(accepted)
        for s in proposals:
            self.stats[s.source].observe(s.proposal.ngram, s.chain, [parents[v] in on_path for v in s.chain], on_path,
                                         s.kinds())

    def extend(self, new: list[int]) -> None:
        if self.index is not None:
            self.index.extend(new)
        self.recent = (self.recent + [int(t) for t in new])[-self.CONTEXT:]
