"""The drafter's training data: the target's own greedy continuations of a prompt corpus, in shards.

``make_data`` (``python -m bastion.train data``) generates them in batches — batching is what makes this
affordable on 2 cores — with the feature-layer hidden states of every token (or token ids only,
``--no-features``); ``make_requests`` has the target write requests of its own (the ``self`` corpus).
Both run the lean batched loop of ``bastion.batchgen`` where it reproduces the model (Llama, Qwen3),
transformers' ``generate`` elsewhere.
Shards for replies that exist already (a datastore's, an ids-only folder's) are ``bastion.refeature``'s.
Finished shards are never redone, and no shard may hold an evaluation, development or fresh prompt (``_eval_prompt_set``).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
from transformers import LogitsProcessorList

from . import batchgen
from .corpus import (
    CORPORA,
    REQUEST_CATEGORIES,
    build_corpus,
    parse_requests,
    request_prompt,
)
from .kernels.reference import filter_thresholds
from .kvcache import growing_cache
from .loading import DEV_PROMPTS, EVAL_PROMPTS, FRESH_PROMPTS, encode_prompt
from .target import Target


def _eval_prompt_set() -> set[str]:
    """The prompts no training corpus may contain: the evaluation, development and fresh `self` suites."""
    out = set()
    for path in (EVAL_PROMPTS, DEV_PROMPTS, FRESH_PROMPTS):
        data = json.loads(path.read_text())
        out |= {p for v in data.values() if isinstance(v, list) for p in v}
    return out


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def progress(done: int, total: int, t0: float, extra: str = "", deadline: float | None = None,
             unit: str = "", base: int = 0) -> None:
    """One carriage-return line on stderr: done/total, the rate since `t0`, and the time left — by the
    rate, or until `deadline` (a ``time.time()`` value) where that comes first (a fit bounded by
    ``--minutes`` with a large ``--steps`` would otherwise promise days). `base` items were done before
    `t0` (a resumed job's finished shards): they count in done/total, not in the rate."""
    now = time.time()
    rate = (done - base) / max(now - t0, 1e-9)
    eta = (total - done) / rate if rate > 0 else float("inf")
    if deadline is not None:
        eta = max(0.0, min(eta, deadline - now))
    per = f" {unit}/s" if unit else "/s"
    print(f"\r[{done}/{total}] {rate:.2f}{per} eta {eta / 60:.1f} min {extra}", end="", file=sys.stderr, flush=True)


def pending_shards(out: Path, n: int, batch: int, unit: str):
    """Yields ``(path, lo, hi)`` for each shard of items ``lo:hi`` (of `n`, `batch` a shard) that is not
    yet in `out`, and after each one the caller wrote, a progress line counted in items (`unit`, e.g.
    "replies"): a resumed job reports its own rate, not one inflated by the shards it skipped."""
    n_shards = math.ceil(n / batch)
    todo = [s for s in range(n_shards) if not (out / f"shard_{s:05d}.pt").exists()]
    done = n - sum(min(batch, n - s * batch) for s in todo)
    base, t0 = done, time.time()
    for s in todo:
        lo, hi = s * batch, min(n, (s + 1) * batch)
        yield out / f"shard_{s:05d}.pt", lo, hi
        done += hi - lo
        progress(done, n, t0, f"shard {s + 1}/{n_shards}", unit=unit, base=base)
    print(file=sys.stderr)



def _left_pad(enc: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch for ``generate``: [B, W] ids left-padded with `pad` and their [B, W] attention mask."""
    width = max(map(len, enc))
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
    att = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    return ids, att


class NucleusSampler:
    """A logits processor that draws each row's next token from softmax(logits) cut to its top-p
    nucleus and returns 0 there, −inf elsewhere, so ``generate(do_sample=False, logits_processor=[it])``
    samples: what ``do_sample=True, top_p=p, temperature=1, top_k=0`` draws, at a fraction of its cost.
    Those warpers sort all 49,152 logits of every row and draw over the whole vocabulary — 153 ms a
    step for 32 rows on session 45's 2-core Xeon, more than the forward. Here the nucleus's threshold
    comes from the growing top-k search the engine uses (``filter_thresholds``: 64, 512, … largest),
    and the draw runs over the nucleus only (``torch.multinomial`` over [b, m], m the largest nucleus;
    torch's global generator, which ``make_requests`` seeds)."""

    def __init__(self, top_p: float):
        self.top_p = top_p

    def draw(self, scores: torch.Tensor) -> torch.Tensor:
        """The sampled ids [b] for logits [b, V] (what the lean loop needs: no [b, V] row to fill)."""
        x = scores.float()
        thr = filter_thresholds(x, None, self.top_p)[:, None]                     # [b, 1]
        m = int((x >= thr).sum(dim=-1).max())                                     # the largest nucleus
        vals, idx = torch.topk(x, m, dim=-1)                                      # [b, m], descending
        probs = torch.softmax(vals.masked_fill(vals < thr, float("-inf")), dim=-1)
        return idx.gather(1, torch.multinomial(probs, 1))[:, 0]                   # [b]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        pick = self.draw(scores)[:, None]                                         # [b, 1]
        return torch.full_like(scores, float("-inf")).scatter_(1, pick, 0.0)


@torch.inference_mode()
def make_requests(target: Target, n: int, seed: int = 0, batch: int = 64, exclude: set[str] | None = None,
                  max_new_tokens: int = 96, max_rounds: int | None = None, model=None) -> list[str]:
    """`n` distinct requests written by the target itself (the "self" corpus).

    Each round samples (T = 1, top-p 0.95 by :class:`NucleusSampler`, torch seeded with seed + round)
    continuations of `batch` raw few-shot lists (``corpus.request_prompt``; categories in turn, so the
    corpus stays balanced) and keeps the complete, distinct requests ``corpus.parse_requests`` finds. Raises if `max_rounds`
    (default: enough for 4 tries per request) pass without `n` usable requests — a model that cannot
    write requests (e.g. a random one) fails loudly instead of looping. ``model``: what samples (default
    the target's own; ``make_data`` passes a bf16 copy for ``gen_dtype``)."""
    tok, model = target.tokenizer, model if model is not None else target.model
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    rng = random.Random(seed)
    exclude = exclude or set()
    seen: set[str] = set()
    out: list[str] = []
    rounds = max_rounds if max_rounds is not None else max(4, math.ceil(4 * n / batch))
    t0 = time.time()
    for r in range(rounds):
        cats = [REQUEST_CATEGORIES[(r * batch + i) % len(REQUEST_CATEGORIES)] for i in range(batch)]
        enc = [tok(request_prompt(rng, c), add_special_tokens=False)["input_ids"] for c in cats]
        ids, att = _left_pad(enc, pad)
        ids, att = ids.to(target.device), att.to(target.device)
        # the sampler draws from torch's global RNG (the device's, on a GPU): leave the caller's alone
        with torch.random.fork_rng(devices=[target.device] if target.device.type == "cuda" else []):
            torch.manual_seed(seed * 100_003 + r)
            gen = _sample_lists(model, ids, att, max_new_tokens, pad)
        for g in gen:
            for q in parse_requests(tok.decode(g, skip_special_tokens=True)):
                if q not in seen and q not in exclude and len(out) < n:
                    seen.add(q)
                    out.append(q)
        progress(len(out), n, t0, f"round {r + 1}/{rounds}", unit="requests")
        if len(out) >= n:
            print(file=sys.stderr)
            return out
    print(file=sys.stderr)
    raise RuntimeError(f"the model wrote only {len(out)} usable requests of {n} in {rounds} rounds; "
                       "use another corpus (--corpus base|broad) or a model that follows a list")


def _lean(model) -> bool:
    """Whether the lean batched loop writes for ``model``: a CPU model it reproduces (``batchgen.qualifies``).
    On a GPU ``generate`` stays (it writes thousands of replies a minute there; the loop is measured on CPUs)."""
    return model.device.type == "cpu" and batchgen.qualifies(model)


def _sample_lists(model, ids: torch.Tensor, att: torch.Tensor, max_new_tokens: int, pad: int) -> list[list[int]]:
    """Each left-padded row's sampled continuation (:class:`NucleusSampler`, top-p 0.95), up to its
    first end token: through the lean batched loop where it runs the model (``batchgen``), else ``generate``."""
    sampler = NucleusSampler(0.95)
    if _lean(model):
        ends = model.generation_config.eos_token_id
        stop_ids = {ends} if isinstance(ends, int) else set(ends or ())  # generate's: pad is not one
        got = batchgen.greedy_batch(model, ids, att, max_new_tokens, [], stop_ids, features=False,
                                    choose=sampler.draw).tokens.tolist()
        return [g[:next((i + 1 for i, t in enumerate(g) if t in stop_ids), len(g))] for g in got]
    gen = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                         logits_processor=LogitsProcessorList([sampler]), pad_token_id=pad,
                         past_key_values=growing_cache(model.config))
    return gen[:, ids.shape[1]:].tolist()


def _requests_file(target: Target, out: Path, n: int, seed: int, batch: int = 64, model=None) -> list[str]:
    """The "self" corpus of a data folder: written once to out/requests.json (sampling differs across
    machines and library versions, so a rerun must reuse it, not regenerate it; a larger `n` appends)."""
    path = out / "requests.json"
    have = json.loads(path.read_text()) if path.is_file() else []
    if len(have) >= n:
        return have[:n]
    # a larger --prompts extends the list (finished shards keep their prompts)
    more = make_requests(target, n - len(have), seed=seed + 7919 * len(have), batch=batch,
                         exclude=_eval_prompt_set() | set(have), model=model)
    reqs = have + more
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(reqs, indent=0, ensure_ascii=False))
    os.replace(tmp, path)
    return reqs


@torch.inference_mode()
def make_data(target: Target, out: Path, n_prompts: int, batch: int, max_new_tokens: int, layer_ids: list[int],
              seed: int = 0, corpus: str = "base", features: bool = True,
              gen_dtype: torch.dtype | None = None, request_dtype: torch.dtype | None = None) -> None:
    """Write shards of {ids, prompt_len[, feats][, agree]} records (see the module docstring);
    ``features=False`` stores token ids only, for ``fit --live-features``. Each shard is one batch
    (``_shard``); with the target itself writing, its features come from the generation's own forwards.

    ``gen_dtype`` (e.g. bfloat16; default the target's dtype): write the requests and continuations
    with a copy of the target in that dtype — on a CPU with AMX, bf16 generation at batch 64 wrote
    534 tokens/s against float32's 220–273 at batch 32 (session 27, 64 new tokens, before the float32
    path kept its generation's features); with features, the float32 target writing itself is now the
    faster (session 50, the AMX Xeon, 160 new tokens: 160 replies a minute at batch 32 against bf16's
    113 at batch 64, whose records need the second forward below). Its greedy path
    leaves the target's now and then (on 18 of 32 replies within 64 tokens), so the records' forward,
    in the target's own dtype, also checks every reply token against the target's greedy choice:
    ``agree`` [n] bool marks the tokens the target itself would have written after the text before
    them, and ``distill.make_batch`` drops every label at or past a disagreement inside a block — what
    is trained stays the target's own greedy output.

    ``request_dtype`` (the "self" corpus only; default ``gen_dtype``): the dtype of the copy that writes
    the request list. Requests are samples, not labels — nothing is trained on them, so they need no
    check — and a bf16 copy writes them faster on an AMX CPU (session 50: 9 a second at batch 64 against
    float32's 5.9, session 51) while float32 writes the replies, the faster way with features."""
    out.mkdir(parents=True, exist_ok=True)
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; choose one of {', '.join(CORPORA)}")
    gen_dtype = gen_dtype or target.dtype
    request_dtype = request_dtype or gen_dtype
    if request_dtype != gen_dtype and corpus != "self":
        raise ValueError(f"a request dtype is for the 'self' corpus, whose requests the target writes; "
                         f"the {corpus!r} corpus has none")
    meta = {"layer_ids": layer_ids, "prompts": n_prompts, "max_new_tokens": max_new_tokens, "batch": batch,
            "corpus": corpus, "seed": seed, "features": features, "gen_dtype": str(gen_dtype).removeprefix("torch.")}
    if corpus == "self":  # a record only: a rerun reuses requests.json, whoever wrote it
        meta["request_dtype"] = str(request_dtype).removeprefix("torch.")
    # folders made before these keys existed
    _refuse_other_settings(out, meta, ("layer_ids", "corpus", "seed", "batch", "features", "gen_dtype"),
                           {"corpus": "base", "seed": 0, "features": True,
                            "gen_dtype": str(target.dtype).removeprefix("torch.")})
    tok = target.tokenizer
    def in_dtype(dtype: torch.dtype):  # the target itself, or a plain copy in another dtype
        return target.model if dtype == target.dtype else target.plain_copy(dtype)

    model = in_dtype(gen_dtype)
    check = model is not target.model
    if corpus == "self":
        writer = model if request_dtype == gen_dtype else in_dtype(request_dtype)
        prompts = _requests_file(target, out, n_prompts, seed, batch=batch, model=writer)
        del writer  # a bf16 copy's memory back before the replies
    else:
        prompts = build_corpus(n_prompts, seed=seed, exclude=_eval_prompt_set(), corpus=corpus)
    (out / "meta.json").write_text(json.dumps(meta | {"prompts": len(prompts)}))
    target.set_feature_layers(layer_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for path, lo, hi in pending_shards(out, len(prompts), batch, "replies"):
        enc = [encode_prompt(tok, p) for p in prompts[lo:hi]]
        atomic_save(_shard(target, model, enc, pad, max_new_tokens, layer_ids, features, check), path)


def _shard(target: Target, model, enc: list[list[int]], pad: int, max_new_tokens: int, layer_ids: list[int],
           features: bool, check: bool) -> list[dict]:
    """The records of one batch of encoded prompts: ``model``'s greedy replies (each up to and
    including its first end-of-text or pad token, at most ``max_new_tokens``).

    When the target itself writes on a CPU and ``batchgen`` reproduces it (Llama, Qwen3), its lean
    batched loop writes the replies and keeps every token's features as it reads them (session 56, a
    2-core Xeon: the same 128 replies in 58.6 s at 128 prompts a batch against ``generate``'s 82.5–84.9 s
    at 32). Otherwise,
    when the target itself writes the replies and features are wanted, they are kept as ``generate``
    computes them (``Target.feature_stream``): its prefill and steps read every token of every reply
    once, left-padded; asking for one token more than kept, with no early stop (``eos_token_id=None``:
    text after an end token is cut off here), makes the last kept token one that was read too. They
    equal a separate forward over the finished sequences up to float rounding (stored in fp16: within
    1e-5 relative on the embedded target; tests) at ~40% less time a shard. Otherwise (a bf16 copy writes, or ids only) ``_records`` runs
    that forward, which also checks every token against the target's own greedy choice."""
    ids, att = _left_pad(enc, pad)
    ids, att = ids.to(target.device), att.to(target.device)
    width = ids.shape[1]
    stream = features and not check
    stop_ids = {target.tokenizer.eos_token_id, pad} - {None}
    # the cache appends in place instead of copying itself every step (the replies are the same)
    args = dict(input_ids=ids, attention_mask=att, do_sample=False, pad_token_id=pad,
                past_key_values=growing_cache(model.config))
    if not check and _lean(model):  # the same replies (and features) in less time than generate's
        got = batchgen.greedy_batch(model, ids, att, max_new_tokens, layer_ids, stop_ids, features=features)
        gen, feats = torch.cat((ids.cpu(), got.tokens), dim=1), got.feats
    elif stream:
        with target.feature_stream(layer_ids) as streamed:
            gen = model.generate(**args, max_new_tokens=max_new_tokens + 1, eos_token_id=None)
            feats = streamed()
    else:
        gen = model.generate(**args, max_new_tokens=max_new_tokens)
    seqs = []
    for e, g in zip(enc, gen[:, width:width + max_new_tokens].tolist()):
        stop = next((i for i, t in enumerate(g) if t in stop_ids), len(g) - 1)
        seqs.append(e + g[:stop + 1])
    if not stream:
        return _records(target, seqs, [len(e) for e in enc], pad, features, check)
    records = []
    for e, q, f in zip(enc, seqs, feats.cpu()):
        start = width - len(e)  # left padding
        records.append({"ids": torch.tensor(q, dtype=torch.int32), "prompt_len": len(e),
                        "feats": f[start:start + len(q)].to(torch.float16).clone()})
    return records


def _refuse_other_settings(out: Path, meta: dict, keys: tuple[str, ...], defaults: dict | None = None) -> None:
    """Raise if ``out`` already holds shards made with other values of ``keys`` (finished shards would
    silently belong to another prompt list); ``defaults`` fill keys older folders lack."""
    old = out / "meta.json"
    if old.is_file() and any(out.glob("shard_*.pt")):
        prev = (defaults or {}) | json.loads(old.read_text())
        clash = [k for k in keys if prev.get(k) != meta[k]]
        if clash:
            raise ValueError(f"{out} holds shards made with other settings ({', '.join(clash)}); use a new --out")


def _records(target: Target, seqs: list[list[int]], prompt_lens: list[int], pad: int,
             features: bool = True, check: bool = False, greedy: bool = False) -> list[dict]:
    """Shard records {ids, prompt_len[, feats][, agree][, greedy]}: one forward over the right-padded
    batch gives every token's feature-layer states (fp16); with ``check``, ``agree`` [n] bool: token t
    equals the target's greedy choice after tokens < t (True over the prompt, which nobody generated);
    with ``greedy``, that choice itself, int32 [n] (g_t: the token the target writes after tokens ≤ t)."""
    records = [{"ids": torch.tensor(q, dtype=torch.int32), "prompt_len": p} for q, p in zip(seqs, prompt_lens)]
    if features or check or greedy:
        L = max(map(len, seqs))
        full = torch.tensor([q + [pad] * (L - len(q)) for q in seqs])
        fmask = torch.tensor([[1] * len(q) + [0] * (L - len(q)) for q in seqs])
        feats, nxt = target.batch_features(full.to(target.device), fmask.to(target.device), greedy=True)
        feats, nxt = feats.cpu(), nxt.cpu()
        for i, r in enumerate(records):
            n, p = len(seqs[i]), prompt_lens[i]
            if features:
                r["feats"] = feats[i, :n].to(torch.float16).clone()
            if greedy:
                r["greedy"] = nxt[i, :n].to(torch.int32).clone()
            if check:
                agree = torch.ones(n, dtype=torch.bool)
                agree[p:] = nxt[i, p - 1:n - 1] == full[i, p:n]
                r["agree"] = agree
    return records


@torch.inference_mode()
def make_text(target: Target, out: Path, sources: list[str], n_chunks: int, batch: int, max_tokens: int,
              layer_ids: list[int], seed: int = 0) -> None:
    """Shards of offline text for the drafter (``bastion.textcorpus``): ``n_chunks`` chunks of at most
    ``max_tokens`` tokens from ``sources`` (files seeded-shuffled, at most 3 chunks of a file, the chunks
    shuffled too), each the assistant's
    reply to its request, with every token's features and the target's greedy choice after it
    (``greedy`` records: ``distill.make_batch`` trains those choices where the text has followed them).
    One forward a batch, no generation. The chunk list is fixed by the first run (``chunks.json``),
    so a resumed job writes the shards it had not finished."""
    from .textcorpus import text_chunks, text_files

    if n_chunks < 1 or batch < 1 or max_tokens < 8:
        raise ValueError("--chunks and --batch must be positive and --max-tokens at least 8")
    meta = {"layer_ids": layer_ids, "corpus": "text", "sources": list(sources), "chunks": n_chunks,
            "batch": batch, "max_tokens": max_tokens, "seed": seed}
    _refuse_other_settings(out, meta, ("layer_ids", "corpus", "sources", "chunks", "batch", "max_tokens", "seed"))
    tok = target.tokenizer
    listed = out / "chunks.json"
    if listed.is_file():
        chunks = json.loads(listed.read_text())
    else:
        files = text_files(sources)  # ValueError before anything is written
        random.Random(seed).shuffle(files)
        found = text_chunks(files, tok, max_tokens=max_tokens, exclude=_eval_prompt_set(), seed=seed,
                            limit=n_chunks, per_file=3)
        random.Random(seed + 1).shuffle(found)
        chunks = [[c.request, c.text] for c in found[:n_chunks]]
        if not chunks:
            raise ValueError(f"no chunk of at least 32 tokens in {', '.join(sources)}")
        out.mkdir(parents=True, exist_ok=True)
        tmp = listed.with_suffix(".tmp")
        tmp.write_text(json.dumps(chunks))
        os.replace(tmp, listed)
    (out / "meta.json").write_text(json.dumps(meta | {"found": len(chunks)}))
    target.set_feature_layers(layer_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for path, lo, hi in pending_shards(out, len(chunks), batch, "documents"):
        prompts = [encode_prompt(tok, req) for req, _ in chunks[lo:hi]]
        seqs = [p + tok(text, add_special_tokens=False)["input_ids"][:max_tokens]
                for p, (_, text) in zip(prompts, chunks[lo:hi])]
        atomic_save(_records(target, seqs, [len(p) for p in prompts], pad, greedy=True), path)


def load_shards(data: Path | list[Path], ids_only: bool = False) -> list[dict]:
    """Every record of every finished shard of one or several data folders, memory-mapped: features
    are read from the page cache as batches gather them (copy-on-write; training only reads them), so
    two fits on the same folders share one copy — read into each process, session 47's four folders
    (~10 GB) took 12 GB per fit and a second fit beside the first was killed for memory. ``ids_only``:
    keep only the token ids (no features: a few MB instead of GBs, e.g. for a datastore)."""
    records = []
    for folder in ([data] if isinstance(data, Path) else data):
        for path in sorted(folder.glob("shard_*.pt")):
            if ids_only:
                records.extend({k: (v.clone() if k == "ids" else v) for k, v in r.items() if k != "feats"}
                               for r in torch.load(path, mmap=True))
            else:
                records.extend(torch.load(path, mmap=True))
    if not records:
        raise FileNotFoundError(f"no shards in {data}: run `python -m bastion.train data --out DIR` first")
    return records


def count_shards(data: list[Path]) -> int:
    return sum(len(list(d.glob("shard_*.pt"))) for d in data)
