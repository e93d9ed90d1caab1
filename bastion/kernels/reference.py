"""Pure-torch references for the verification kernels (and the CPU backend).

Three operations touch every tree node during verification:

* ``node_choice``: one token per node from the target's logits, either the argmax (T = 0) or an
  exact sample from softmax(logits / T) restricted to the top-k / top-p set. Sampling uses the
  Gumbel-max trick with a *counter-based* random stream: the uniform variate of (node i, token v)
  is ``u = hash(seed, offset + i, v)``, so the Triton kernel and this reference draw the very same
  sample from the same (seed, offset) without materialising noise in memory on the GPU.
* ``tree_walk``: from the root, follow the child whose token equals the target's choice at the
  current node; the nodes walked are accepted, the choice at the last one is the bonus token.
* ``tree_mask``: the additive float attention mask (cache prefix + ancestors) and position ids.

The top-k / top-p restriction is a pre-pass (:func:`filter_thresholds`) shared by both backends:
it turns the restriction into one logit threshold per node, and a token is allowed iff its logit
is >= the threshold. (Tokens tied with the last kept token are kept too; ties of float logits are
measure-zero events for a trained model.)
"""

from __future__ import annotations

import torch

from . import cpu_native, cpu_rows

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The 'lowbias32' integer hash on uint32 values held in int64 tensors."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    x = x ^ (x >> 16)
    return x


def uniform_stream(seed: int, offset: int, n: int, vocab: int, device=None,
                   counters: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform variates u in (0, 1), float32 [n, vocab]: u[i, v] = hash(seed, r_i, v), where the
    row counter r_i = offset + i, or counters[i] when given (taken mod 2^32).

    23 random bits per variate: u = (k + 0.5) / 2^23 with k = h >> 9 (see ``bits_to_unit``).
    """
    if counters is not None:
        rows = counters.to(device=device, dtype=torch.int64) & _MASK32
    else:
        rows = torch.arange(offset, offset + n, device=device, dtype=torch.int64)
    return uniform_cells(seed, rows, column_keys(torch.arange(vocab, device=device, dtype=torch.int64)))


def column_keys(cols: torch.Tensor) -> torch.Tensor:
    """The per-token half of the hash (int64 [m], values < 2^32) of token ids ``cols``."""
    return _mix32(cols + 0x9E3779B9)


def uniform_cells(seed: int, rows: torch.Tensor, col_keys: torch.Tensor) -> torch.Tensor:
    """u [n, m] of stream rows ``rows`` (int64 [n], < 2^32) at the tokens whose :func:`column_keys`
    are ``col_keys``: any subset of a row's columns, bit for bit as in the full row."""
    return bits_to_unit(_mix32(row_keys(seed, rows)[:, None] ^ col_keys[None, :]))


def _mix32_int(x: int) -> int:
    """:func:`_mix32` of one Python int."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _row_key(seed: int, row: int) -> int:
    """:func:`row_keys` of one row counter, in Python ints (a few microseconds, no tensors)."""
    return _mix32_int(_mix32_int((row & _MASK32) ^ (seed & _MASK32)) + ((seed >> 32) & _MASK32))


def row_keys(seed: int, rows: torch.Tensor) -> torch.Tensor:
    """The 32-bit key of each stream row (int64 [n], values < 2^32) for this seed: what every token's
    hash of that row starts from."""
    return _mix32(_mix32(rows ^ (seed & _MASK32)) + ((seed >> 32) & _MASK32))


def bits_to_unit(h: torch.Tensor) -> torch.Tensor:
    """float32 u in [2^-24, 1 − 2^-24] from 32-bit hashes: (k + 0.5) · 2^-23 with k = h >> 9.

    Every k + 0.5 < 2^23 is exact in float32 and the scale is a power of two, so u is exactly the
    midpoint of k's cell and never 0 or 1. (With 24 bits, k + 0.5 for k = 2^24 − 1 rounds to 2^24:
    u = 1, a Gumbel noise of +inf, and that token is drawn whatever its probability — or, masked by
    top-k/top-p, −inf + inf = NaN. That happened for about one token in 2^24.)
    """
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


class GumbelRows:
    """Memo of one request's Gumbel noise rows g_q = −log(−log u(seed, q, ·)), float32 [V] per stream row q.

    A sampled verification draws node i from row positions[i] (see :func:`node_choice_torch`). The
    nodes at one depth of a tree share a position, hence a row, and the next round draws again at the
    positions this round rejected: of the ~n rows a round needs, about τ are new. Each row is hashed
    once (a round's new rows in one batch) and dropped once the walk has moved past it (positions only
    grow within a request). Noise is element-wise in (seed, q, v), so a row is the same whichever
    batch computed it, and every draw is the one :func:`node_choice_torch` makes without the memo.
    """

    def __init__(self, seed: int, device=None, keep: int = 64, native: bool | None = None):
        """``native``: hash new CPU rows with :func:`cpu_rows.uniform_rows` (default: where the
        library is built)."""
        self.seed, self.device, self.keep = seed, device, keep
        self.native = cpu_native.available() if native is None else native
        self.vocab: int | None = None
        self._rows: dict[int, torch.Tensor] = {}
        self.computed = 0  # rows hashed so far (for tests and profiling)

    def rows(self, counters: list[int], vocab: int, keep_from: int | None = None) -> torch.Tensor:
        """Noise [len(counters), vocab] for these stream rows, hashing only the ones not seen yet; rows
        below ``keep_from`` (default: the lowest counter asked for) are dropped."""
        if self.vocab is None:
            self.vocab = vocab
        elif vocab != self.vocab:
            raise ValueError(f"noise rows were made for a vocabulary of {self.vocab}, got {vocab}")
        low = min(counters) if keep_from is None else keep_from
        for c in [c for c in self._rows if c < low]:  # behind the walk: never drawn from again
            del self._rows[c]
        new = sorted({c for c in counters if c not in self._rows})
        if new:
            if self.native and (self.device is None or torch.device(self.device).type == "cpu"):
                # the same bits natively (~1 ms a row of 49,152 tokens in torch ops on a 2-core CPU)
                u = cpu_rows.uniform_rows([_row_key(self.seed, c) for c in new], vocab)
            else:
                u = uniform_stream(self.seed, 0, len(new), vocab, device=self.device,
                                   counters=torch.tensor(new, dtype=torch.int64))
            for c, row in zip(new, -torch.log(-torch.log(u))):
                self._rows[c] = row
            self.computed += len(new)
        out = torch.stack([self._rows[c] for c in counters])
        while len(self._rows) > self.keep:  # a bound for callers whose counters do not advance
            del self._rows[min(self._rows)]
        return out

    def cells(self, counters: list[int], col_keys: torch.Tensor) -> torch.Tensor:
        """Noise [len(counters), m] of these stream rows at the tokens whose :func:`column_keys` are
        ``col_keys`` (on the CPU): the same bits as :meth:`rows` at those columns, hashed anew, not
        kept (a drafter's vocabulary, ``bastion.coupling``)."""
        if self.native:  # natively (cpu_noise.c), ~20× faster than torch's int64 ops at ~8,600 tokens
            u = cpu_rows.uniform_cells([_row_key(self.seed, c) for c in counters], col_keys)
        else:
            u = uniform_cells(self.seed, torch.tensor(counters, dtype=torch.int64), col_keys)
        return -torch.log(-torch.log(u))


def filter_thresholds(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor | None:
    """Per-node logit thresholds for top-k / top-p, float32 [n], or None when neither applies.

    top-k keeps the k largest logits; top-p keeps the smallest prefix of the sorted distribution
    whose probability mass reaches p (the token that crosses p is kept). Both are applied at the
    (already tempered) logits, so callers pass logits / T.
    """
    use_k = top_k is not None and 0 < top_k < logits.shape[-1]
    use_p = top_p is not None and top_p < 1.0
    if not (use_k or use_p):
        return None
    x = logits.float()
    if use_p:
        return _top_p_thresholds(x, top_p, top_k if use_k else x.shape[-1])
    return torch.topk(x, top_k, dim=-1).values[:, -1]


def _top_p_thresholds(x: torch.Tensor, top_p: float, limit: int, first: int = 64) -> torch.Tensor:
    """Top-p (within the ``limit`` largest) thresholds of float32 logits x [n, V].

    With probabilities p_(1) ≥ p_(2) ≥ … of the sorted row, token j is kept iff the mass before it,
    Σ_{i<j} p_(i), is below top_p (the first always). A full sort of V = 49,152 logits per node cost
    ~35 ms a round on the CPU; the kept prefix is usually a few dozen tokens, so the sorted prefix
    comes from ``topk`` with k = 64, 512, 4096, … per row until the prefix ends inside it. The
    normaliser is Σ exp(x − max) over the whole row and the prefix sums run over the same values in
    the same order whatever k is, so the threshold does not depend on how far the search went.
    """
    n = x.shape[0]
    top = x.max(dim=-1, keepdim=True).values
    z = torch.exp(x - top).sum(dim=-1, keepdim=True)
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    rows = torch.arange(n, device=x.device)
    k = min(first, limit)
    while rows.numel():
        vals = torch.topk(x[rows], k, dim=-1).values  # sorted, descending
        probs = torch.exp(vals - top[rows]) / z[rows]
        keep = (torch.cumsum(probs, dim=-1) - probs) < top_p
        keep[:, 0] = True  # the first token is always kept (also when top_p <= 0)
        done = ~keep[:, -1] if k < limit else torch.ones_like(keep[:, -1])
        last = keep.sum(dim=-1) - 1
        out[rows[done]] = vals[done].gather(1, last[done, None]).squeeze(1)
        rows, k = rows[~done], min(limit, k * 8)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` of a 2-D tensor, int64 [n] — on the CPU through NumPy's vectorised
    argmax: over 9 × 49,152 float32 logits 0.74 ms with torch 2.13 against 0.03 ms (one thread), the
    cost of every verification's walk. Same rule: the first maximal index of each row, a NaN counted
    as the maximum."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0 \
            and not x.requires_grad:
        return torch.from_numpy(x.numpy().argmax(axis=1).astype("int64", copy=False))
    return torch.argmax(x, dim=-1)


def node_choice_torch(logits: torch.Tensor, temperature: float, thresholds: torch.Tensor | None = None,
                      seed: int = 0, offset: int = 0, counters: torch.Tensor | None = None,
                      noise: GumbelRows | None = None) -> torch.Tensor:
    """One token per node, int64 [n].

    Args:
        logits: [n, V] target logits (any float dtype; computed in float32).
        temperature: 0 for argmax, > 0 for an exact sample from softmax(logits / T).
        thresholds: optional [n] float32 tempered-logit thresholds from :func:`filter_thresholds`.
        seed, offset: the random stream; row i uses counter offset + i ...
        counters: ... or counters[i] [n] when given. The engine passes each node's position id,
            so the draw for the token at position q always comes from row q, whatever the tree.
        noise: a request's :class:`GumbelRows` (same seed; needs ``counters``): rows drawn in
            earlier rounds are reused instead of hashed again — the same draws, less work.
    """
    x = logits.float()
    if temperature <= 0.0:
        return argmax_rows(x)
    x = x / temperature
    if thresholds is not None:
        x = x.masked_fill(x < thresholds[:, None], float("-inf"))
    if noise is not None:
        if counters is None or noise.seed != seed:
            raise ValueError("noise rows need the row counters and the seed they were made with")
        gumbel = noise.rows([int(c) for c in counters.tolist()], x.shape[1]).to(x.device)
    else:
        u = uniform_stream(seed, offset, x.shape[0], x.shape[1], device=x.device, counters=counters)
        gumbel = -torch.log(-torch.log(u))
    return argmax_rows(x + gumbel)


def tree_walk_torch(parents: list[int], tokens: list[int], choices: torch.Tensor | list[int]) -> tuple[list[int], int]:
    """Accepted node indices (root first) and the bonus token.

    Siblings carry distinct tokens, so at most one child can match the choice at a node.
    """
    if isinstance(choices, torch.Tensor):
        choices = choices.tolist()
    child_by_token: dict[tuple[int, int], int] = {}
    for i in range(1, len(parents)):
        child_by_token[(parents[i], tokens[i])] = i
    path = [0]
    node = 0
    while True:
        nxt = child_by_token.get((node, choices[node]))
        if nxt is None:
            return path, int(choices[node])
        path.append(nxt)
        node = nxt


def tree_mask_torch(parents: list[int], prefix_len: int, dtype: torch.dtype = torch.float32,
                    device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive mask [1, 1, n, prefix_len + n] and position ids [1, n] for a tree forward.

    mask[i, j] = 0 if j < prefix_len (cached context) or tree node j - prefix_len is node i or
    one of its ancestors; the dtype's minimum otherwise. position id of node i = prefix_len + depth.
    """
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
            depth[i] = depth[p] + 1
        anc[i, i] = True
    mask = torch.zeros(n, prefix_len + n, dtype=dtype)
    mask[:, prefix_len:].masked_fill_(~anc, torch.finfo(dtype).min)
    pos = torch.tensor(depth, dtype=torch.long) + prefix_len
    return mask[None, None].to(device), pos[None].to(device)
