"""A retrieval datastore as a third draft source: what the target itself wrote after the same words.

Prompt lookup (lookup.py) copies from the request's own context. A small instruct model also
repeats itself *across* requests: stock openings ("Here is a Python function that"), list
scaffolding, the way it phrases a step of arithmetic. Retrieval-based speculative decoding (REST,
He et al. 2023) drafts those from a datastore of text. Ours holds the target's own greedy replies
to the drafter's training prompts (``python -m bastion.train data``), so it shares the drafter's
data and never the evaluation prompts.

Index: for each n in ``ngrams`` the n-grams of the flat token array are hashed to int64 and sorted
(stable, so equal hashes keep text order) beside their int32 end positions, and a query is a binary
search. A proposal follows every occurrence of the longest matching context suffix (the latest
``cap`` of them) and walks their continuations greedily by frequency: token d is the most common
next token among the occurrences that agreed on tokens 1..d−1, kept while it holds at least
``min_share`` of them. Sequences are separated by −1, which no context contains, so continuations
never run into the next reply.
Teacher-forced on the 30 eval prompts (run-5 drafter, trigrams): τ of the drafter's chain with
prompt lookup 1.94, with this datastore as well 2.32 (trigrams only: 2.25).

Stored as ``datastore.safetensors`` beside the drafter's weights: the tokens as int16 (offset by
2^15 − 1, so the separator and a vocabulary up to 65,535 fit), zlib-compressed into a uint8 tensor,
and the target's vocabulary size. Compressed, session 52's 7.3 M tokens took 4.9 MiB instead of
14.0 (a reply's tokens repeat a few thousand common ids); inflating them takes 0.08 s of the 2.8 s
that loading and indexing them took (session 58, the 2-core Xeon; see :func:`_index_build` for later). The repository's size limit
(``tests/test_repository.py``: the tree travels with every GPU call) is what bounds the datastore,
so the bytes buy replies. Files of the first format (``"tokens"`` as plain int16) still load.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from .lookup import Proposal

FILE = "datastore.safetensors"
_OFFSET = (1 << 15) - 1  # int16 holds t − _OFFSET for t in [−1, 65535)
_FORMAT = "bastion datastore v2"  # v1: "tokens" as plain int16; v2: "tokens_zlib", its zlib stream


class Datastore:
    """n-gram index over a token corpus; :meth:`propose` drafts a continuation of a context and
    :meth:`successors` counts what followed a one- or two-token prefix."""

    SUCCESSOR_CACHE = 65536  # prefixes whose successor counts are kept

    def __init__(self, tokens: torch.Tensor, vocab_size: int, ngrams: tuple[int, ...] = (3, 2),
                 cap: int = 256, min_share: float = 0.3):
        if tokens.dim() != 1:
            raise ValueError(f"datastore tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if not ngrams or min(ngrams) < 1:
            raise ValueError(f"ngrams must be positive lengths, got {ngrams}")
        bad = (tokens < -1) | (tokens >= vocab_size)
        if bool(bad.any()):
            raise ValueError(f"datastore token {int(tokens[bad][0])} is outside the vocabulary of {vocab_size}")
        self.tokens = tokens.to(torch.int32).contiguous()  # int32: half of int64's bytes, any vocabulary
        self.vocab_size = int(vocab_size)
        self.ngrams = tuple(sorted(set(ngrams), reverse=True))
        self.cap, self.min_share = cap, min_share
        # the index and a view of the tokens (no copy) are NumPy: a query's few small ops cost ~1 µs
        # each there against ~10 µs as tensor ops (bench/NOTES.md, session 33)
        self._tokens_np = self.tokens.numpy()
        with _index_build():
            self._index = {n: self._build(n) for n in self.ngrams}
        self._counts: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # see _gram_counts
        self._succ_cache: dict[tuple[int, ...], tuple[dict[int, int], int]] = {}

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_sequences(cls, sequences: list[list[int]], vocab_size: int, **kw) -> "Datastore":
        flat: list[int] = []
        for seq in sequences:
            flat.extend(int(t) for t in seq)
            flat.append(-1)
        return cls(torch.tensor(flat, dtype=torch.long), vocab_size, **kw)

    def _build(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(sorted int64 hashes, int32 end positions): the n-gram ending at position e is
        tokens[e−n+1..e], hashed as Σ_j (t_j + 1)·(V + 1)^(n−1−j) — exact (no collisions) while
        (V + 1)^n < 2^62. NumPy, in place where it can: the index is ~12 bytes per token and n,
        and the build's temporaries are handed back to the OS afterwards (:func:`_index_build`).

        The hashes are computed over slices (sequential passes). Where a hash fits 32 bits (bigrams
        of a vocabulary below 65,535) it is packed with its end position into one int64 key,
        hash·2^31 + e, and one sort of the keys orders both — equal hashes by position, as the
        stable sort does — without the random-access gathers of an argsort's permutation, which cost
        most of a build here (session 59: bigrams of 9.4 M tokens 2.7–3.4 s → 0.3–0.6 s)."""
        base = self.vocab_size + 1
        if base ** n >= 2 ** 62:
            raise ValueError(f"{n}-grams of a {self.vocab_size}-token vocabulary do not fit a 64-bit hash")
        t = self._tokens_np
        if t.size < n + 1:
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        m = t.size - n  # windows starting at 0..m−1, each with a token after it
        # n-grams across a separator never match a context; one that ends a reply has no continuation
        ok = t[n:] >= 0
        for j in range(n):
            ok &= t[j:j + m] >= 0
        h = np.zeros(m, np.int64)
        for j in range(n):
            h *= base
            h += t[j:j + m]
            h += 1
        if base ** n <= 2 ** 32 and t.size < 2 ** 31:
            h <<= 31
            h += np.arange(n - 1, m + n - 1, dtype=np.int64)  # the window's end position
            key = h[ok]
            del h, ok
            key.sort()  # distinct keys: any sort gives the stable order
            ends = (key & ((1 << 31) - 1)).astype(np.int32)
            key >>= 31
            return key, ends
        starts = np.flatnonzero(ok)
        h = h[ok]
        del ok
        order = np.argsort(h, kind="stable")  # equal hashes keep text order
        h = h[order]
        starts = starts[order]
        del order
        starts += n - 1
        return h, starts.astype(np.int32)

    # ----------------------------------------------------------------- drafting
    def propose(self, context: list[int], max_tokens: int) -> Proposal | None:
        """Continuation of ``context`` (its last max(ngrams) tokens matter) by the longest matching
        suffix, walked by frequency; None when no suffix occurs or nothing is agreed on."""
        if max_tokens < 1:
            return None
        for n in self.ngrams:
            if len(context) < n:
                continue
            hashes, ends = self._index[n]
            key = 0
            for t in context[-n:]:  # the n-gram's hash as _build computes it, in Python ints (a few tokens)
                key = key * (self.vocab_size + 1) + (int(t) + 1)
            lo, hi = int(np.searchsorted(hashes, key, "left")), int(np.searchsorted(hashes, key, "right"))
            if hi == lo:
                continue
            starts = ends[max(lo, hi - self.cap):hi] + 1  # the latest occurrences
            tokens = self._tokens_np
            cont = tokens[np.minimum(starts[:, None] + np.arange(max_tokens), tokens.size - 1)]
            out = self._walk(cont)
            if out:
                return Proposal(out, n)
        return None

    def _walk(self, cont: np.ndarray) -> list[int]:
        """Greedy frequency walk over continuations [m, k]: keep the agreeing rows at each depth; a
        tie goes to the smaller token id. In Python lists: m ≤ ``cap`` rows of k ≤ ~10 tokens, where
        a tensor op per depth cost more than the walk."""
        out: list[int] = []
        live = cont.tolist()
        for d in range(cont.shape[1]):
            votes = Counter(row[d] for row in live if row[d] >= 0)  # a reply's end votes for nothing
            if not votes:
                break
            tok, count = min(votes.items(), key=lambda kv: (-kv[1], kv[0]))
            if d > 0 and (count < 2 or count < self.min_share * len(live)):
                break  # past the first token, follow only a continuation several occurrences agree on
            out.append(tok)
            live = [row for row in live if row[d] == tok]
        return out

    # ----------------------------------------------------------------- successor statistics
    def successors(self, prefix: tuple[int, ...]) -> tuple[dict[int, int], int]:
        """({next token: count}, total) over the occurrences of ``prefix`` (one or two tokens).

        Read off the sorted (n+1)-gram index for an n-token prefix: its (n+1)-grams (prefix, t) own
        one contiguous hash range, and equal hashes sit together (the index holds the n-grams that
        have a token after them, so a reply's last one is not counted — one in ~180). Kept per
        prefix: a request's trees ask about the same few hundred prefixes again and again, and a
        common one (",") has thousands of successors.
        """
        got = self._succ_cache.get(prefix)
        if got is not None:
            return got
        prefix = tuple(int(t) for t in prefix)
        if not 1 <= len(prefix) <= 2:
            raise ValueError(f"successor prefixes have 1 or 2 tokens, got {len(prefix)}")
        distinct, first = self._gram_counts(len(prefix) + 1)
        base = self.vocab_size + 1
        key = 0
        for t in prefix:
            key = key * base + t + 1
        key *= base
        lo, hi = np.searchsorted(distinct, (key, key + base))
        if hi > lo:
            counts = np.diff(first[lo:hi + 1])
            got = (dict(zip((distinct[lo:hi] - key - 1).tolist(), counts.tolist())), int(first[hi] - first[lo]))
        else:
            got = ({}, 0)
        if len(self._succ_cache) >= self.SUCCESSOR_CACHE:
            self._succ_cache.clear()  # a crude bound: one request touches a few thousand prefixes
        self._succ_cache[prefix] = got
        return got

    def prepare_successors(self) -> None:
        """Build the count tables :meth:`successors` reads (~10 ms), so a timed round does not."""
        self._gram_counts(2)
        self._gram_counts(3)

    def _gram_counts(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(distinct sorted hashes of the n-gram index, start offsets with the end appended): the
        count of distinct[i] is first[i+1] − first[i]. Built once, on first use (~10 ms)."""
        got = self._counts.get(n)
        if got is None:
            if n not in self._index:
                with _index_build():
                    self._index[n] = self._build(n)
            h = self._index[n][0]
            starts = np.flatnonzero(np.concatenate(([True], h[1:] != h[:-1]))) if h.size else np.zeros(0, np.int64)
            got = self._counts[n] = (h[starts], np.concatenate((starts, [h.size])).astype(np.int64))
        return got

    # ----------------------------------------------------------------- persistence
    def save(self, folder: str | Path) -> Path:
        """Write ``folder/datastore.safetensors`` (atomically: a temporary file renamed into place)."""
        from safetensors.torch import save_file

        if self.vocab_size > 2 * _OFFSET + 1:
            raise ValueError(f"a vocabulary of {self.vocab_size} does not fit the int16 file format")
        path = Path(folder) / FILE
        tmp = path.with_suffix(".tmp")
        raw = (self.tokens - _OFFSET).to(torch.int16).numpy().astype("<i2").tobytes()  # little-endian on any host
        packed = torch.frombuffer(bytearray(zlib.compress(raw, 9)), dtype=torch.uint8)
        save_file({"tokens_zlib": packed, "vocab_size": torch.tensor([self.vocab_size], dtype=torch.long)},
                  str(tmp), metadata={"format": _FORMAT, "count": str(len(self.tokens)),
                                      "ngrams": ",".join(map(str, self.ngrams))})
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, folder: str | Path, vocab_size: int, **kw) -> "Datastore":
        """Read ``folder/datastore.safetensors``; the target's vocabulary must be the one it was built for."""
        from safetensors import SafetensorError, safe_open

        path = Path(folder) / FILE
        try:
            with safe_open(str(path), framework="pt") as f:  # one read: the tensors and the header's metadata
                data, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
        except FileNotFoundError:
            raise FileNotFoundError(f"no datastore at {path}") from None
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{path} is not a readable safetensors file ({exc})") from None
        if "vocab_size" not in data or not ({"tokens", "tokens_zlib"} & data.keys()):
            raise ValueError(f"{path} lacks the tensors 'tokens_zlib' (or 'tokens') and 'vocab_size'")
        stored = int(data["vocab_size"][0])
        if stored != vocab_size:
            raise ValueError(f"{path} was built for a vocabulary of {stored} tokens; the target has {vocab_size}")
        tokens = data["tokens"] if "tokens" in data else _inflate(path, data["tokens_zlib"], meta)
        return cls(tokens.to(torch.int32) + _OFFSET, stored, **kw)


def _inflate(path: Path, packed: torch.Tensor, meta: dict[str, str]) -> torch.Tensor:
    """The int16 tokens [count] of a v2 file from its zlib stream (``packed`` uint8); a stream that
    does not inflate to exactly ``count`` tokens is a damaged file, said as such."""
    try:
        raw = zlib.decompress(packed.numpy().tobytes())
        count = int(meta["count"])
    except (zlib.error, KeyError, ValueError) as exc:
        raise ValueError(f"{path} holds a damaged datastore ({exc})") from None
    if len(raw) != 2 * count:
        raise ValueError(f"{path} holds a damaged datastore ({len(raw) // 2} tokens where its header says {count})")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i2").astype(np.int16))


def _trim_heap() -> None:
    """Return freed heap memory to the OS where the C library can (glibc's ``malloc_trim``). An
    index build frees ~30 MB temporaries that glibc keeps in its heap (allocations under its mmap
    threshold, which rises to 32 MB once such a block is freed): without this, loading the shipped
    datastore held ~390 MiB of RSS for ~100 MiB of index (session 47)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass


@contextmanager
def _index_build():
    """Around an index build: within the block, NumPy does not advise the kernel to back new large
    arrays with 2 MiB pages; on exit the previous setting comes back and the build's freed
    temporaries are handed back to the OS (:func:`_trim_heap`).

    NumPy asks for huge pages (``madvise``) on every large array; where the kernel then gathers free
    memory into huge pages synchronously — ``transparent_hugepage/defrag`` = ``madvise``, the
    kernel's default — the first touch of an index build's ~0.5 GB of fresh arrays stalled on that
    compaction. Loading the shipped datastore on the 2-core Xeon (session 59, fresh processes,
    alternated): 4.0–4.5 s with the advice, 1.8–2.0 s without, and 3,000 proposals from the index as
    fast or faster (0.34–0.40 against 0.41–0.44 s). The switch is NumPy's own (private) one; where a
    NumPy lacks it the block only trims the heap."""
    setter = None
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            setter = getattr(__import__(module, fromlist=["_"]), "_set_madvise_hugepage")
            break
        except (ImportError, AttributeError):
            continue
    previous = setter(False) if setter is not None else None
    try:
        yield
    finally:
        if setter is not None:
            setter(previous)
        _trim_heap()


class NgramPrior:
    """The datastore's next-token statistics as a prior for a draft tree's children.

    The drafter returns *marginals* q_d(t): one distribution per depth, shared by every node of that
    depth, so two depth-1 siblings get the same children although "the" and "a" are followed by
    different words. Under a node whose last two tokens are (a, s) the candidates of depth d are
    re-weighted by how often the target's own replies continued that way,

        p₂(t | s) = (c(s, t) + λ·ε) / (c(s) + λ),  p₃(t | a, s) = (c(a, s, t) + m·p₂) / (c(a, s) + m),
        q'(t) = M · q_d(t) · p₃(t)^β / Σ_j q_d(j) · p₃(j)^β,   M = Σ_j q_d(j)

    over the node's candidate list (M keeps the list's total drafter mass, so a node's children are
    never more likely together than the drafter said). A prefix the datastore never saw gives every
    candidate the same weight: q' = q. β = 0 switches it off.
    Teacher-forced on the eval prompts' replies (session 15; ``bench/NOTES.md``), best-first trees of
    8 drafter nodes accepted τ 2.19 → 2.38 with it, of 16 nodes 2.35 → 2.59, flat for β in 0.2–0.4
    and m in 2–20.
    """

    def __init__(self, datastore: Datastore, beta: float = 0.3, smoothing: float = 5.0,
                 bigram_weight: float = 1.0, floor: float = 1e-4):
        if beta < 0 or smoothing <= 0 or bigram_weight <= 0 or not 0 < floor < 1:
            raise ValueError("NgramPrior needs beta >= 0 and positive smoothing, bigram_weight and floor < 1")
        self.datastore, self.beta, self.smoothing = datastore, beta, smoothing
        self.bigram_weight, self.floor = bigram_weight, floor

    def reweight(self, prev: int | None, last: int, q: list[float], tokens: list[int],
                 mass: float) -> list[float] | None:
        """q' (see the class docstring) for candidates ``tokens`` with drafter probabilities ``q``
        summing to ``mass``; None when every weight is the same (β = 0, or ``last`` never seen), i.e.
        q' = q. Plain floats: a tree asks this ~10 times a round for 8 candidates."""
        if self.beta == 0 or not tokens:
            return None
        c2, n2 = self.datastore.successors((last,))
        if not n2:
            return None
        lam_eps, d2, beta = self.bigram_weight * self.floor, n2 + self.bigram_weight, self.beta
        c3, n3 = self.datastore.successors((prev, last)) if prev is not None else (None, 0)
        if n3:
            m = self.smoothing
            d3 = n3 + m
            qw = [qi * ((c3.get(t, 0) + m * (c2.get(t, 0) + lam_eps) / d2) / d3) ** beta for qi, t in zip(q, tokens)]
        else:
            qw = [qi * ((c2.get(t, 0) + lam_eps) / d2) ** beta for qi, t in zip(q, tokens)]
        z = sum(qw)
        if not z > 0:
            return None
        k = mass / z
        return [min(x * k, 1.0) for x in qw]

    def condition(self, prev: int | None, last: int, logq: list[float], tokens: list[int]) -> list[float]:
        """:meth:`reweight` in log space: log q' for candidates with drafter log q ``logq``."""
        q = [math.exp(a) for a in logq]
        out = self.reweight(prev, last, q, tokens, math.fsum(q))
        return list(logq) if out is None else [math.log(x) if x > 0 else -math.inf for x in out]


def main(argv: list[str] | None = None) -> int:
    """``python -m bastion.datastore --data DIR [--data DIR2] --out FOLDER``: build from training shards."""
    import argparse
    import sys

    from .traindata import load_shards

    ap = argparse.ArgumentParser(prog="python -m bastion.datastore", description=main.__doc__)
    ap.add_argument("--data", type=Path, action="append", required=True,
                    help="a folder of shards from `python -m bastion.train data` (repeatable)")
    ap.add_argument("--out", type=Path, required=True, help="folder to write datastore.safetensors into "
                                                            "(the drafter's folder, so it is found with it)")
    ap.add_argument("--vocab-size", type=int, default=None, help="the target's vocabulary (default: from --out's config.json)")
    ap.add_argument("--extend", action="store_true",
                    help="keep the replies of --out's existing datastore and append these (when the "
                         "shards it was built from are no longer at hand)")
    a = ap.parse_args(argv)
    try:
        vocab = a.vocab_size
        if vocab is None:
            import json

            vocab = int(json.loads((a.out / "config.json").read_text())["vocab_size"])
        records = load_shards(a.data, ids_only=True)  # the features are not needed
        seqs = [r["ids"].tolist() if hasattr(r["ids"], "tolist") else list(r["ids"]) for r in records]
        store = Datastore.from_sequences(seqs, vocab)
        kept = ""
        if a.extend:  # the old replies first: a query's latest occurrences are then the new ones
            old = Datastore.load(a.out, vocab).tokens
            n_old = int((old == -1).sum())
            store = Datastore(torch.cat([old, store.tokens]), vocab)
            kept = f" after {n_old} kept sequences ({len(old) - n_old} tokens)"
        path = store.save(a.out)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{path}: {len(seqs)} sequences, {sum(map(len, seqs))} tokens{kept}, "
          f"{path.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
