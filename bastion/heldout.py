"""Teacher-forced evaluation of a drafter on the held-out eval prompts (no timing, no tree search).

``python -m bastion.heldout [--drafter DIR]`` generates (once, cached) the target's greedy
continuation of every prompt of assets/eval_prompts.json (or ``--prompts``: assets/dev_prompts.json is
a three times larger suite for comparing drafters), then, at every position a of every
reply, drafts the block [token_a, MASK × (B−1)] from the target's features before a — exactly the
context a decoding round has — and compares with the reply:

- per-depth top-1 accuracy and the mean accepted chain length (the training log's numbers, here on
  prompts the drafter never saw, so the gap to the training log measures over-fitting);
- τ of simulated decoders that start each round where the previous one ended: the drafter's chain
  (DFlash), prompt lookup alone (lookup.NgramIndex), a tree holding both (a round accepts the longer
  of the two matches), the datastore alone (datastore.Datastore, when the drafter folder has one) and
  a tree holding all three, and with ``--trees N,...`` the drafter's best-first trees of N nodes (plain
  and re-weighted per parent by the datastore's n-grams; ``all:N`` adds the two copy branches: Bastion's
  tree at that size, the proxy for its τ where the host lets trees grow). Measured τ of ``chain`` in the benchmark
  should match the first.

All of it is cheap next to a benchmark (one drafter forward per 16 positions) and deterministic.
``--data DIR`` scores replies the drafter was *trained* on instead (sampled from its training data
folders, their stored features): the gap between those and a prompt suite is over-fitting; a low
score on both is a drafter that cannot fit its data.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from .draft_policy import refine_passes
from .config import GenerationConfig
from .drafter import DFlashDrafter
from .drafter_io import load_drafter
from .kernels.cpu_linear import MODES
from .loading import EMBEDDED, EVAL_PROMPTS, encode_prompt, load_default_datastore, load_default_drafter, load_target
from .simulate import simulate_tau, simulations
from .target import Target


def suite_items(path: Path) -> list[tuple[str, str]]:
    """[(category, prompt)] of a prompt suite, read and checked as the benchmark reads it."""
    from .bench import read_prompts  # ValueError (BenchError) naming what is wrong with the file

    return [(c, p) for c, ps in read_prompts(path).items() for p in ps]


def data_records(folders: list[Path], layer_ids: list[int], n: int, seed: int = 0) -> list[dict]:
    """``n`` records sampled (without replacement, seeded) from training data folders
    (``train data`` / ``train replay``), in :func:`eval_records`' form, category "trained". Their
    features must be the drafter's layers: a ValueError names both otherwise."""
    from .traindata import load_shards

    for folder in folders:
        if not (folder / "meta.json").is_file():
            raise ValueError(f"{folder} is not a training data folder (no meta.json)")
        meta = json.loads((folder / "meta.json").read_text())
        if not meta.get("features", True):
            raise ValueError(f"{folder} holds token ids only (data --no-features): no features to draft from")
        if meta.get("layer_ids") != list(layer_ids):
            raise ValueError(f"{folder} holds features of target layers {meta.get('layer_ids')}, "
                             f"the drafter reads {list(layer_ids)}")
    recs = load_shards(list(folders))
    pick = random.Random(seed).sample(range(len(recs)), min(n, len(recs)))
    return [{"category": "trained", "ids": recs[i]["ids"].tolist(), "prompt_len": int(recs[i]["prompt_len"]),
             "feats": recs[i]["feats"]} for i in pick]


def eval_records(target: Target, layer_ids: list[int], cache: Path | None, max_new_tokens: int = 128,
                 prompts_file: Path = EVAL_PROMPTS) -> list[dict]:
    """[{category, ids, prompt_len, feats}] for every eval prompt; read from ``cache`` when it matches.
    A cache of the same replies made for other feature layers keeps its replies (the generation is
    the slow part) and only recomputes the features."""
    items = suite_items(prompts_file)
    key = {"prompts": items, "layer_ids": list(layer_ids), "max_new_tokens": max_new_tokens}
    stored = torch.load(cache, weights_only=False) if cache is not None and cache.is_file() else {}
    if stored.get("key") == key:
        return stored["records"]
    target.set_feature_layers(list(layer_ids))
    same_replies = {k: v for k, v in stored.get("key", {}).items() if k != "layer_ids"} == \
        {k: v for k, v in key.items() if k != "layer_ids"}
    records, t0 = [], time.time()
    for i, (cat, prompt) in enumerate(items):
        if same_replies:
            out, n_prompt = stored["records"][i]["ids"], stored["records"][i]["prompt_len"]
        else:
            enc = encode_prompt(target.tokenizer, prompt)
            out = target.model.generate(input_ids=torch.tensor([enc]), attention_mask=torch.ones(1, len(enc), dtype=torch.long),
                                        max_new_tokens=max_new_tokens, do_sample=False,
                                        pad_token_id=target.tokenizer.pad_token_id or 0)[0].tolist()
            n_prompt = len(enc)
        feats = target.batch_features(torch.tensor([out]), torch.ones(1, len(out), dtype=torch.long))
        records.append({"category": cat, "ids": out, "prompt_len": n_prompt, "feats": feats[0].to(torch.float16)})
        print(f"\r  {'features' if same_replies else 'continuations'} {i + 1}/{len(items)} ({time.time() - t0:.0f} s)",
              end="", file=sys.stderr)
    print(file=sys.stderr)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        torch.save({"key": key, "records": records}, tmp)
        tmp.replace(cache)
    return records


def chain_lengths(drafter: DFlashDrafter, target: Target, rec: dict, per_call: int = 16, block: int | None = None
                  ) -> tuple[list[int], list[list[bool]]]:
    """For every anchor a in the reply: accepted chain length and per-depth hits of the drafter's argmax.

    ``block`` B' ≤ B: draft blocks of B' tokens, [token_a, MASK × (B'−1)] — what a decoding round with
    an adaptive draft depth D = B'−1 runs (draft_policy.DraftDepth); default the drafter's own B."""
    lengths, hits, _ = scan(drafter, target, rec, per_call=per_call, block=block)
    return lengths, hits


@torch.inference_mode()
def scan(drafter: DFlashDrafter, target: Target, rec: dict, k: int = 0, per_call: int = 16,
         block: int | None = None, refine: int = 0) -> tuple[list[int], list[list[bool]], list[tuple[list, list]]]:
    """:func:`chain_lengths`' lengths and hits, and with ``k`` > 0 also, per anchor, the drafter's
    top-k log q of each depth 1..B'−1 and their token ids ([B'−1][k] lists each, as the engine's
    ``expansion.topk_tensors`` gives them) for ``simulate.tree_lengths`` — one drafter pass for both.
    ``refine`` r: r more passes per block, as a decoding round's ``DFlashDrafter.draft(refine=r)``."""
    from .distill import block_mask  # the training-time packing of several blocks into one row
    from .expansion import topk_tensors

    ids, P, B = rec["ids"], rec["prompt_len"], block or drafter.block_size
    if not 2 <= B <= drafter.block_size or not 0 <= refine < B - 1:
        raise ValueError(f"block must be in [2, {drafter.block_size}] and refine in [0, block − 2], got {B}, {refine}")
    n = len(ids)
    dt = drafter.fc.weight.dtype
    feats = rec["feats"].to(dt)[None]
    ctx_kv = drafter.context_kv(feats, torch.arange(n)[None])
    valid = torch.ones(1, n, dtype=torch.bool)
    vocab = drafter.draft_vocab
    lengths, hits, lists = [], [], []
    anchors = list(range(P - 1, n - 1))
    for c0 in range(0, len(anchors), per_call):
        A = anchors[c0:c0 + per_call]
        block = torch.full((1, len(A) * B), drafter.cfg.mask_token_id, dtype=torch.long)
        pos = torch.zeros(1, len(A) * B, dtype=torch.long)
        for j, a in enumerate(A):
            block[0, j * B] = ids[a]
            pos[0, j * B:(j + 1) * B] = torch.arange(a, a + B)
        logits = pred = None
        for i in range(refine + 1):  # pass i + 1 reveals the i tokens drafted so far (i = 0: the plain draft)
            if i:
                block.view(len(A), B)[:, i] = pred[:, i - 1]
            h = drafter.blocks(target.embed(block).to(dt), pos, ctx_kv, block_mask(valid, torch.tensor([A]), B, dt))
            h = h.view(len(A), B, -1)[:, 1:].reshape(len(A) * (B - 1), -1).to(target.dtype)
            # the head as a decoding round multiplies it (drafter.draft): same rows, same precision
            out = (target.lm_head(h, vocab, drafter.low_precision) if vocab is not None else target.lm_head(h))
            out = out.view(len(A), B - 1, -1)
            logits = out if logits is None else torch.cat([logits[:, :i], out[:, i:]], dim=1)
            pred = logits.argmax(-1) if vocab is None else vocab[logits.argmax(-1)]
        logits = logits.reshape(len(A) * (B - 1), -1)
        pred = pred.tolist()
        if k > 0:
            vals, tops = topk_tensors(torch.log_softmax(logits.float(), -1), k, vocab)
            lists += zip(vals.view(len(A), B - 1, -1).tolist(), tops.view(len(A), B - 1, -1).tolist())
        for j, a in enumerate(A):
            truth = ids[a + 1:a + B]
            row = [p == t for p, t in zip(pred[j], truth)]
            lengths.append(next((i for i, ok in enumerate(row) if not ok), len(row)))
            hits.append(row)
    return lengths, hits, lists


#: edges of the target-confidence bins of ``evaluate(by_confidence=True)``; the last bin holds 1.0
CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)
MAX_TREE = GenerationConfig.max_nodes  # --trees sizes up to the engine's own largest tree


@torch.no_grad()  # not inference mode: Target.layers_from's attention keeps version counters
def greedy_confidence(target: Target, rec: dict, layer_id: int) -> list[float]:
    """For every anchor a of :func:`chain_lengths` (a = prompt_len − 1 … n − 2): the target's own
    probability p(x_{a+1} | x_{≤a}) of the token that follows, the one the drafter's depth 1 must name.
    On a greedy reply that token is the target's argmax, so p is how sure the target itself was:
    near 1 where the next token is all but forced (the rest of a word, a closing bracket), low where
    the target chose among near-equals. The record's last feature columns hold decoder layer
    ``layer_id``'s outputs, so only the layers after it run (:meth:`Target.finish_from`)."""
    ids, P = rec["ids"], rec["prompt_len"]
    h = target.hidden_size
    feats = rec["feats"][None, :, -h:].to(target.device)
    final = target.finish_from(feats, layer_id, torch.ones(1, len(ids), dtype=torch.bool, device=target.device))
    logits = target.lm_head(final[0, P - 1:len(ids) - 1]).float()
    nxt = torch.tensor(ids[P:], device=logits.device)
    return logits.log_softmax(-1).gather(1, nxt[:, None])[:, 0].exp().tolist()


def _confidence_bin(p: float) -> int:
    for i, hi in enumerate(CONFIDENCE_EDGES[1:-1]):
        if p < hi:
            return i
    return len(CONFIDENCE_EDGES) - 2  # the last bin is closed: it holds p = 1.0


def evaluate(drafter: DFlashDrafter, target: Target, records: list[dict], depths: int = 8, datastore=None,
             block: int | None = None, by_confidence: bool = False, trees: tuple[int, ...] = (), refine: int = 0) -> dict:
    """Per category and overall: per-depth accuracy, mean chain length, simulated τ (chain, lookup,
    both; with a datastore also datastore and all). ``block``: see :func:`chain_lengths`; ``refine``: :func:`scan`.

    ``trees``: also τ of decoders whose rounds verify the drafter's best-first tree of N nodes
    (``simulate.tree_lengths``), as ``fixed:N``, and with a datastore ``cond:N`` with each node's children
    re-weighted by its n-grams (Bastion's drafter nodes at that size, without copy branches), and
    ``all:N``, that tree with the lookup and datastore branches (a round accepts the longest of the three).

    ``by_confidence``: also the drafter's depth-1 accuracy per bin of the target's own confidence in
    the token (:func:`greedy_confidence`, bins :data:`CONFIDENCE_EDGES`): ``"by_confidence"`` holds
    per bin ``lo``, ``hi``, ``n`` positions, their ``share`` of all, and ``acc1``. A drafter that
    misses tokens the target is sure of has room to learn; misses where the target itself hesitated
    are the hard part."""
    groups: dict[str, dict] = {}
    depths = min(depths, (block or drafter.block_size) - 1)
    n_bins = len(CONFIDENCE_EDGES) - 1
    for rec in records:
        lengths, hits, lists = scan(drafter, target, rec, k=max([*trees, 8]) if trees else 0, block=block,
                                    refine=refine)
        conf = greedy_confidence(target, rec, drafter.cfg.target_layer_ids[-1]) if by_confidence else []
        sims = simulations(rec, lengths, lists, datastore, trees)
        for name in (rec["category"], "all"):
            g = groups.setdefault(name, {"hits": [[0, 0] for _ in range(depths)], "chain": [],
                                         "sim": {k: [0, 0] for k in sims}, "conf": [[0, 0] for _ in range(n_bins)]})
            for row in hits:
                for d, ok in enumerate(row[:depths]):
                    g["hits"][d][0] += ok
                    g["hits"][d][1] += 1
            for p, row in zip(conf, hits):
                b = g["conf"][_confidence_bin(p)]
                b[0] += row[0]
                b[1] += 1
            g["chain"] += lengths
            for k, acc in sims.items():
                t, r = simulate_tau(acc)
                g["sim"][k][0] += t
                g["sim"][k][1] += r
    out = {name: {"acc": [round(h / max(n, 1), 3) for h, n in g["hits"]],
                  "chain_len": round(sum(g["chain"]) / max(len(g["chain"]), 1), 3),
                  "tau": {k: round(t / max(r, 1), 3) for k, (t, r) in g["sim"].items()}}
           for name, g in groups.items()}
    if by_confidence:
        for name, g in groups.items():
            total = max(sum(n for _, n in g["conf"]), 1)
            out[name]["by_confidence"] = [
                {"lo": lo, "hi": hi, "n": n, "share": round(n / total, 4), "acc1": round(h / n, 3) if n else None}
                for lo, hi, (h, n) in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:], g["conf"])]
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bastion.heldout", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=EMBEDDED)
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    ap.add_argument("--cache", type=Path, default=None,
                    help="where the target's continuations are kept between runs (default ~/.cache/bastion/"
                         "heldout.pt, heldout-NAME.pt for another suite NAME.json)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--block", type=int, default=None,
                    help="draft blocks of this many tokens (the engine drafts depth + 1; default the drafter's "
                         "block size)")
    ap.add_argument("--prompts", type=Path, default=EVAL_PROMPTS,
                    help="JSON {category: [prompt, ...]} (default the evaluation suite; assets/dev_prompts.json "
                         "holds 90 more)")
    ap.add_argument("--data", type=Path, action="append", default=None,
                    help="score replies from these training data folders instead of a prompt suite (repeatable)")
    ap.add_argument("--sample", type=int, default=60, help="with --data: how many replies (default 60)")
    ap.add_argument("--seed", type=int, default=0, help="with --data: the sample's seed")
    ap.add_argument("--by-confidence", action="store_true",
                    help="also the drafter's depth-1 accuracy per bin of the target's own confidence in the token")
    ap.add_argument("--trees", default="",
                    help="comma-separated tree sizes N: also τ of the drafter's best-first trees of N nodes "
                         "(fixed:N; cond:N with the datastore's per-parent re-weighting; all:N that tree with the "
                         "prompt-lookup and datastore branches)")
    ap.add_argument("--drafter-linear", choices=(*MODES, "auto"), default="auto",
                    help="the drafter's products: auto (default) times bf16 against float32 panels as the "
                         "engine's probe does and keeps its choice, so the proposals scored are the engine's")
    ap.add_argument("--refine", type=int, default=None,
                    help="refinement passes per block (the engine's GenerationConfig.refine; default the drafter's "
                         "own refine_passes): pass i + 1 redrafts the depths after the i tokens drafted so far, "
                         "revealed in place of their masks")
    ap.add_argument("--json", action="store_true")
    return ap


def set_products(drafter: DFlashDrafter, target: Target, mode: str) -> str:
    """Put the drafter's linear layers in ``mode``, or with ``auto`` in the mode the engine's probe
    (:func:`bastion.probe.tune_drafter_products`) picks on this host — the two modes' drafts differ
    within bf16 rounding, and so may a few proposals; returns the mode as the benchmark records it."""
    from .bench_runs import linear_mode
    from .probe import set_drafter_products, tune_drafter_products

    set_drafter_products(drafter, mode)
    tune_drafter_products(drafter, target)
    return linear_mode(drafter)


def _check_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse what can be refused before the target loads; fill in the default cache path."""
    if a.data and a.sample < 1:
        ap.error("--sample must be positive")
    try:
        suite_items(a.prompts)
    except ValueError as exc:
        ap.error(str(exc))
    missing = [str(d) for d in a.data or [] if not (d / "meta.json").is_file()]
    if missing:
        ap.error(f"not training data folders (no meta.json): {', '.join(missing)}")
    try:
        a.trees = tuple(int(x) for x in a.trees.split(",") if x.strip())
    except ValueError:
        ap.error(f"--trees wants comma-separated sizes, got {a.trees!r}")
    if any(n < 1 or n > MAX_TREE for n in a.trees):
        ap.error(f"--trees sizes must be in [1, {MAX_TREE}], got {a.trees}")
    if a.cache is None:
        name = "heldout.pt" if a.prompts.resolve() == EVAL_PROMPTS.resolve() else f"heldout-{a.prompts.stem}.pt"
        a.cache = Path.home() / ".cache" / "bastion" / name


def _print_tables(res: dict, by_confidence: bool) -> None:
    """The result as Markdown: per category, depth accuracies, chain length and each simulated τ;
    with ``by_confidence`` also depth-1 accuracy per bin of the target's confidence."""
    sims = list(res["all"]["tau"])
    print(f"| prompts | acc depth 1–{len(res['all']['acc'])} | chain length | {' | '.join(f'τ {k}' for k in sims)} |\n"
          f"|---|---|---:|{'---:|' * len(sims)}")
    for name, r in sorted(res.items(), key=lambda kv: kv[0] == "all"):  # categories, then all
        print(f"| {name} | {' '.join(f'{x:.2f}' for x in r['acc'])} | {r['chain_len']:.2f} | "
              + " | ".join(f"{r['tau'][k]:.2f}" for k in sims) + " |")
    if by_confidence:
        names = sorted(res, key=lambda k: k == "all")
        print("\n| target's p(greedy token) | share of positions | depth-1 accuracy: "
              + " | ".join(names) + " |\n|---|---:|" + "---:|" * len(names))
        for i, b in enumerate(res["all"]["by_confidence"]):
            cells = [res[k]["by_confidence"][i]["acc1"] for k in names]
            print(f"| [{b['lo']:.2f}, {b['hi']:.2f}{']' if i == len(CONFIDENCE_EDGES) - 2 else ')'} | {b['share']:.1%} | "
                  + " | ".join("–" if c is None else f"{c:.2f}" for c in cells) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    _check_args(ap, a)  # a bad suite or folder is refused before the target loads
    if a.threads:
        torch.set_num_threads(a.threads)
    target = load_target(a.model, torch.float32, "cpu")
    datastore = load_default_datastore(target, a.drafter, a.model)
    if a.drafter is None:
        drafter = load_default_drafter(target, None, a.model)
        if drafter is None:
            ap.error("no drafter: pass --drafter DIR")
    else:
        drafter = load_drafter(Path(a.drafter), target.hidden_size, target.vocab_size, target.num_layers,
                               dtype=torch.float32)
    drafter = drafter.float().eval()
    print(f"[heldout] the drafter's products: {set_products(drafter, target, a.drafter_linear)}", file=sys.stderr)
    if a.block is not None and not 2 <= a.block <= drafter.block_size:
        ap.error(f"--block must be in [2, {drafter.block_size}]")
    if a.data:
        try:
            records = data_records(a.data, drafter.cfg.target_layer_ids, a.sample, a.seed)
        except (OSError, ValueError) as exc:
            ap.error(str(exc))
    else:
        records = eval_records(target, drafter.cfg.target_layer_ids, a.cache, prompts_file=a.prompts)
    refine = refine_passes(a, drafter)  # --refine, else the drafter's own: what the engine would run
    if not 0 <= refine < (a.block or drafter.block_size) - 1:
        ap.error(f"--refine must be in [0, {(a.block or drafter.block_size) - 2}] for these blocks")
    print(f"[heldout] refinement passes per block: {refine}", file=sys.stderr)
    res = evaluate(drafter, target, records, datastore=datastore, block=a.block, by_confidence=a.by_confidence,
                   trees=a.trees, refine=refine)
    if a.json:
        print(json.dumps(res))
    else:
        _print_tables(res, a.by_confidence)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
