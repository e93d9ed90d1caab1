"""Noise-coupled drafting: at T > 0 the drafter proposes the tokens the target's own draws will pick.

A sampled verification (``bastion.verify``) draws the token after a node at position π as

    y = argmax_v ( ℓ_v / T + G_π(v) ),   G_π(v) = −log(−log u(seed, π, v)),

the Gumbel-max form of a draw from softmax(ℓ / T) (after top-k / top-p). The noise row G_π is a hash
of (seed, π, v) alone: it does not depend on the tree, the strategy or the round, so it is known
before the target runs. Every node at depth d − 1 of a tree sits at position π = P + d − 1 (P: the
root's), so the token a depth-d node must carry to be accepted is the argmax of the target's tempered
logits at its parent plus the row G_{P+d−1} — the same row for every node of that depth.

The drafter's depth-d marginal log q_d stands in for those logits, so the coupled score

    s_d(v) = log q_d(v) / T + G_{P+d−1}(v)

ranks first the token the target will draw wherever q_d ≈ the target's conditional. Without coupling
the best a draft tree can do at T > 0 is to hold the target's likeliest tokens: a depth is accepted
with the target's mass on its candidates. With it, a depth is accepted whenever the drafter's
perturbed argmax equals the target's — always, for a drafter that equals the target.

Ours does not: it was trained on the target's greedy choices, so where it is unsure its q is flatter
than the target's tempered distribution, and the noise then pulls its pick away from a token the
target is sure of. The engine therefore ranks, calibrates and grows the tree from the even mixture

    c_d(v) = ½ q_d(v) + ½ softmax(s_d)(v),

which keeps both the drafter's own favourite and the coupled pick near the top of every depth.
Measured on 9 eval prompts (shipped drafter, 128 tokens, seed 1; τ of ``chain`` · ``fixed:32``):
T = 1: uncoupled 1.44 · 1.89, coupled alone 1.59 · 2.23, mixture 1.55 · 2.20; T = 0.7: uncoupled
1.84 · 2.58, coupled alone 1.78 · 2.52, mixture 1.86 · 2.63 — the mixture never lost to uncoupled
drafting, coupling alone did at T = 0.7 (bench/NOTES.md).

Lossless by construction, not by a correction step: the target's draw at every accepted position is
the same function of its own logits and G_π as in plain decoding (the walk only decides how many of
them one forward yields), so a seed gives AR's very tokens, and over seeds exactly its distribution.
The drafter reads the noise; it never changes it. (At T = 0 there is no noise: nothing changes.)
"""

from __future__ import annotations

import math

import torch

from .kernels.reference import GumbelRows, column_keys


class DraftNoise:
    """A request's noise rows G_π at its draft vocabulary, kept per position.

    Each round drafts positions P … P + D − 1 and the next round starts τ further on, so a position is
    drafted in several rounds: its row is made once. With a draft vocabulary the row is hashed at
    those V_d columns only (the same bits as the verification's full row: the hash is element-wise in
    (seed, π, v)) — 8,192 + the request's tokens instead of the embedded target's 49,152, whose full
    row costs ~0.17 ms natively on 2 cores, and most drafted depths are never reached by the walk.
    Without one, the full rows come from the request's :class:`GumbelRows` memo, which the
    verification then finds hashed. A wider vocabulary (the request's new tokens join it) clears the
    kept rows.
    """

    def __init__(self, memo: GumbelRows, full_vocab: int):
        self.memo, self.full_vocab = memo, full_vocab
        self._rows: dict[int, torch.Tensor] = {}
        self._width: int | None = None
        self._col_keys: torch.Tensor | None = None  # _mix32(v + golden) of the draft vocabulary's ids

    def rows(self, first: int, n: int, vocab: torch.Tensor | None) -> torch.Tensor:
        """Noise [n, V_d] of positions first … first + n − 1 at the columns ``vocab`` (None: all)."""
        width = self.full_vocab if vocab is None else len(vocab)
        if width != self._width:
            self._rows.clear()
            self._width = width
            self._col_keys = None if vocab is None else column_keys(vocab.to(torch.int64).cpu())
        for p in [p for p in self._rows if p < first]:  # behind the root: never drafted again
            del self._rows[p]
        new = [p for p in range(first, first + n) if p not in self._rows]
        if new:
            fresh = (self.memo.rows(new, self.full_vocab, keep_from=first) if self._col_keys is None
                     else self.memo.cells(new, self._col_keys))
            self._rows.update(zip(new, fresh))
        return torch.stack([self._rows[p] for p in range(first, first + n)])


def coupled_logq(logq: torch.Tensor, noise: DraftNoise, root_position: int, vocab: torch.Tensor | None,
                 temperature: float, depths: int | None = None) -> torch.Tensor:
    """log c = log(½ q + ½ softmax(log q / T + G)) for the first ``depths`` depths (default all), the
    rest ``logq`` as it is; [D, V_d] like ``logq``.

    ``logq`` [D, V_d]: the drafter's log marginals of depths 1..D over its draft vocabulary, whose
    column j is token ``vocab[j]`` (``vocab`` None: the full vocabulary). Row i (depth i + 1) takes
    the noise row of position ``root_position + i``. Bastion couples only the depths its recent trees
    reached (:meth:`DraftDepth.reach`): at T = 1 its trees are ~3 deep while it drafts 8 or more
    depths, and each coupled depth costs a noise row and the mixture's few passes over V_d.
    """
    if temperature <= 0:
        raise ValueError("coupled drafting needs T > 0 (at T = 0 the target's choice has no noise)")
    d = logq.shape[0] if depths is None else min(logq.shape[0], max(0, depths))
    if d == 0:
        return logq
    g = noise.rows(root_position, d, vocab).to(logq.device)
    own = torch.log_softmax(logq[:d].float(), dim=-1)
    coupled = torch.logaddexp(own, torch.log_softmax(own / temperature + g, dim=-1)) - math.log(2.0)
    return coupled if d == logq.shape[0] else torch.cat([coupled.to(logq.dtype), logq[d:]])
