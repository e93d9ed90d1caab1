"""Feature shards for replies that exist already, in the layout of ``bastion.traindata``'s shards.

``make_replay`` (``python -m bastion.train replay``) turns the replies a drafter's datastore keeps back
into shards — what survives when the training data folders are gone; ``make_features`` (``train
features``) adds the target's features to an ids-only folder (``data --no-features``: e.g. replies a
GPU wrote in minutes), checking each token against this target's greedy choice.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from .loading import encode_prompt
from .target import Target
from .traindata import _records, _refuse_other_settings, atomic_save, pending_shards, progress


def assistant_header(tokenizer) -> list[int]:
    """The tokens that open the assistant's turn: the common suffix of two chat-templated prompts."""
    a, b = encode_prompt(tokenizer, "a"), encode_prompt(tokenizer, "b")
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n:]


@torch.inference_mode()
def make_replay(target: Target, out: Path, datastore: Path, n_seqs: int, batch: int, layer_ids: list[int],
                seed: int = 0, features: bool = True, newest: int = 0) -> None:
    """Feature shards for ``n_seqs`` replies of a stored datastore (a seeded sample; ``n_seqs`` ≤ 0:
    all of them; ``newest`` > 0 samples from the last ``newest`` stored replies only — ``--extend``
    appends, so those are the ones added last, which earlier drafters may never have seen), for
    training on earlier data whose shards are gone: the datastore keeps every reply's token ids
    (prompt included), so one forward per batch restores the features — no generation. The target's
    dtype is the forward's (``replay --dtype bfloat16``: ~3× faster with AMX). The prompt ends after
    the last assistant header (:func:`assistant_header`); replies without one are skipped.
    ``features=False`` writes token ids only, without running the target
    (seconds, a few MB: the input of ``fit --live-features`` on a GPU, ``scripts/gpu_payload.py``)."""
    from .datastore import Datastore

    store = Datastore.load(datastore, target.vocab_size)
    flat = store.tokens.tolist()
    seqs, cur = [], []
    for t in flat:
        if t == -1:
            seqs.append(cur)
            cur = []
        else:
            cur.append(t)
    header = assistant_header(target.tokenizer)
    h = len(header)

    def split(q: list[int]) -> int:
        for i in range(len(q) - h, -1, -1):
            if q[i:i + h] == header:
                return i + h
        return -1

    if newest > 0:
        seqs = seqs[-newest:]
    pairs = [(q, split(q)) for q in seqs]
    pairs = [(q, p) for q, p in pairs if 0 < p < len(q)]
    if not pairs:
        raise ValueError(f"{datastore}: no stored reply follows an assistant header of this target's chat template")
    random.Random(seed).shuffle(pairs)
    if n_seqs > 0:
        pairs = pairs[:n_seqs]
    out.mkdir(parents=True, exist_ok=True)
    meta = {"layer_ids": layer_ids, "prompts": len(pairs), "batch": batch, "corpus": "replay", "seed": seed,
            "features": features, "newest": newest, "dtype": str(target.dtype).removeprefix("torch."),
            "datastore": str(datastore)}
    _refuse_other_settings(out, meta, ("layer_ids", "corpus", "seed", "batch", "features", "newest", "dtype"),
                           defaults={"features": True, "newest": 0, "dtype": "float32"})
    (out / "meta.json").write_text(json.dumps(meta))
    target.set_feature_layers(layer_ids)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    for path, lo, hi in pending_shards(out, len(pairs), batch, "replies"):
        chunk = pairs[lo:hi]
        atomic_save(_records(target, [q for q, _ in chunk], [p for _, p in chunk], pad, features), path)


@torch.inference_mode()
def make_features(target: Target, out: Path, source: Path, batch: int) -> None:
    """Feature shards for an ids-only data folder (``data --no-features``, e.g. written on a GPU):
    each source shard becomes an out shard of the same name with {ids, prompt_len, feats, agree}.

    The forward runs on this target (``_records`` with ``check``): ``agree`` marks the reply tokens
    that are its own greedy choices, so replies another device wrote (where float rounding can turn a
    near-tie the other way) are trained only up to where this target would have left them
    (``distill.make_batch``). Sequences go through the target in batches of ``batch``, sorted by
    length within a shard (less padding), and are stored in the source's order. Finished out shards
    are never redone, so an interrupted run resumes; the source is only read."""
    meta_path = source / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{source} is no data folder (no meta.json)")
    meta = json.loads(meta_path.read_text())
    if meta.get("features", True):
        raise ValueError(f"{source} already holds features (its meta.json says so): train on it directly")
    layer_ids = [int(i) for i in meta["layer_ids"]]
    if not layer_ids or max(layer_ids) >= target.num_layers or min(layer_ids) < 0:
        raise ValueError(f"{source} names target layers {layer_ids}; this target has {target.num_layers}")
    shards = sorted(source.glob("shard_*.pt"))
    if not shards:
        raise FileNotFoundError(f"no shards in {source}")
    if out.resolve() == source.resolve():
        raise ValueError("--out must be another folder than --data (the ids-only shards are kept)")
    out.mkdir(parents=True, exist_ok=True)
    out_meta = meta | {"features": True, "features_from": source.name}
    _refuse_other_settings(out, out_meta, ("layer_ids", "features_from"))
    (out / "meta.json").write_text(json.dumps(out_meta))
    if (source / "requests.json").is_file() and not (out / "requests.json").exists():  # the prompts travel along
        (out / "requests.json").write_text((source / "requests.json").read_text())
    target.set_feature_layers(layer_ids)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    sizes = [len(torch.load(path, mmap=True)) for path in shards]  # ids only: small, for the progress bar
    total = sum(sizes)
    seen = sum(n for path, n in zip(shards, sizes) if (out / path.name).exists())  # a resumed job's
    t0, base = time.time(), seen
    for s, path in enumerate(shards):
        dest = out / path.name
        if dest.exists():
            continue
        recs = torch.load(path)
        order = sorted(range(len(recs)), key=lambda i: len(recs[i]["ids"]))
        done: dict[int, dict] = {}
        for b in range(0, len(order), batch):
            idx = order[b:b + batch]
            made = _records(target, [recs[i]["ids"].tolist() for i in idx], [int(recs[i]["prompt_len"]) for i in idx],
                            pad, features=True, check=True)
            done.update(zip(idx, made))
            seen += len(idx)
            progress(seen, total, t0, f"shard {s + 1}/{len(shards)}", unit="replies", base=base)
        atomic_save([done[i] for i in range(len(recs))], dest)
    print(file=sys.stderr)
