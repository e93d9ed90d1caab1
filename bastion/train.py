"""Self-distillation of a DFlash drafter for a target, on CPU (or one GPU), resumable.

    python -m bastion.train data  --out DIR [--corpus base|broad|self] [--prompts N] [--batch 32] [--max-new-tokens 160]
    python -m bastion.train replay --datastore FOLDER --out DIR [--sequences N]
    python -m bastion.train fit   --data DIR [--data DIR2 ...] --ckpt DIR [--steps N] [--minutes M]
                                  [--init FOLDER] [--draft-vocab N] [--export FOLDER]
    python -m bastion.train average --drafter A --drafter B [...] --out FOLDER

``data``: the offline corpus (bastion.corpus, eval and dev prompts excluded; ``self``: requests the target
writes itself, see ``make_requests``) → the target's own greedy
continuations, generated in batches (batching is what makes this affordable on 2 cores), plus the
feature-layer hidden states of every token, written in shards; finished shards are never redone.
``--no-features`` stores token ids only (a few MB instead of GBs); ``fit --live-features`` then runs
the target on every batch instead (the sensible split on a GPU, where that forward is cheap).

``fit``: random anchor positions a in the response; context = target features of tokens < a;
block = [x_a, MASK × (B−1)]; labels = x_{a+1..a+B−1}. Loss = Σ_k w_k·CE_k with w_k = exp(−(k−1)/γ)
(early depths matter most for acceptance). Checkpoints (atomic) every ``--ckpt-every`` steps;
a rerun resumes from the last one.

``average``: the element-wise mean of warm-started runs of one drafter (``average_drafters``).

The data side lives in ``traindata.py``, the making of drafters (new, grown, widened, averaged, the
draft vocabulary) in ``drafter_ops.py``, the batches and the loss in ``distill.py``; this module holds
``fit`` and the command line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .corpus import CORPORA
from .drafter import DFlashDrafter, spread_layer_ids
from .drafter_io import load_drafter, save_drafter
from .distill import make_batch, noisy_features, train_step
from .drafter_ops import average_drafters, build_draft_vocab, extend_features, grow_drafter, new_drafter, widen_features
from .loading import EMBEDDED, checked_device, load_target
from .target import Target
from .traindata import atomic_save, count_shards, load_shards, make_data, make_replay, progress
from .trainlog import plot_log, read_logs  # noqa: F401  (the plot command; read_logs is public here too)

MASK_TOKEN_SMOLLM2 = 16  # <empty_output>: a special token that never appears in chat text


@dataclass(frozen=True)
class FitConfig:
    """How ``fit`` trains: the ``fit`` command's options (``python -m bastion.train fit --help``).

    ``steps`` / ``minutes``: the cosine schedule runs over whichever budget ends first (``minutes`` 0:
    steps only), after ``warmup`` linear steps, never below 5% of ``lr``. ``rows`` sequences of
    ``anchors`` blocks each make a batch.

    ``layers``: a new drafter's layer count (default 2); with ``init``, the count to grow the loaded
    drafter to (:func:`grow_drafter`; default: its own).

    ``blocks``: block lengths B' ≤ B, one drawn per step (uniformly from the list; repeat a length to
    weight it). The engine drafts blocks of depth + 1 tokens (draft_policy.DraftDepth: mostly 9 of the 16),
    and the block attention is non-causal, so a drafter trained on 16-token blocks sees a shorter
    block out of distribution: held out, run 11's chain τ was 1.81 at 16 tokens and 1.72 at 9
    (``python -m bastion.heldout --block``). Default: the drafter's B alone.

    ``add_feature_layers``: target layers the drafter reads beyond the data's (later ones only, e.g.
    the last layer); stored features are carried to them per batch by the target's layers in between
    (:func:`extend_features`). With ``init`` the loaded drafter is widened (:func:`widen_features`).

    ``kd``: weight α of the target's own distributions in the loss (``distill._train_step``); they are
    computed per batch from the stored features by the target's layers after the last feature layer.
    (On the embedded target it tied plain training held out: the model card's runs 16–18.)

    ``accept``: weight β of the expected-acceptance-length weighting of the labels (``distill._train_step``).

    ``feature_noise``: σ of the Gaussian noise added to the context features, relative to each
    feature layer's RMS per token (``distill.noisy_features``); a regulariser, drawn per step from
    ``seed`` and the step number. 0: none.

    ``live``: context features come from the target on every batch (``live_features``) instead of
    the shards, which then need only token ids (``data --no-features``).
    """

    steps: int = 4000
    minutes: float = 0.0
    rows: int = 8
    anchors: int = 8
    lr: float = 6e-4
    layers: int | None = None
    block: int = 16
    blocks: tuple[int, ...] | None = None
    gamma: float = 5.0
    ckpt_every: int = 50
    export: Path | None = None   # also write the drafter folder (fp16) at each checkpoint
    seed: int = 0                # seed of the batch stream (rows, anchors, block lengths)
    mask_token_id: int = MASK_TOKEN_SMOLLM2
    bf16: bool = True            # autocast the drafter's forward to bf16 (where it is fast: _bf16_is_fast)
    loss_depths: int | None = None  # train depths 1..D only (default B − 1)
    init: Path | None = None     # warm start from this drafter folder
    draft_vocab: int | None = None  # draft over the N most frequent tokens of the data only
    live: bool = False
    kd: float = 0.0
    add_feature_layers: tuple[int, ...] | None = None
    accept: float = 0.0
    feature_noise: float = 0.0   # σ of the context features' noise, relative to each layer's RMS
    warmup: int = 50

    def validate(self) -> None:
        """Raise ValueError naming the option that is out of range (before anything loads)."""
        if self.blocks is not None and (min(self.blocks) < 2 or (self.init is None and max(self.blocks) > self.block)):
            raise ValueError(f"--blocks {','.join(map(str, self.blocks))!r}: block lengths must lie in "
                             f"[2, --block = {self.block}]")
        if not 0.0 <= self.kd <= 1.0:
            raise ValueError(f"--kd {self.kd}: give a weight in [0, 1]")
        if not 0.0 <= self.accept <= 1.0:
            raise ValueError(f"--accept {self.accept}: give a weight in [0, 1]")
        if not 0.0 <= self.feature_noise <= 10.0:
            raise ValueError(f"--feature-noise {self.feature_noise}: give a σ in [0, 10] (a fraction of each layer's RMS)")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"--layers {self.layers}: give a positive layer count")

    def lr_at(self, step: int, elapsed_s: float) -> float:
        """The learning rate of ``step``: linear warm-up, then cosine decay over whichever budget
        (steps or minutes) runs out first, floored at 5% of ``lr``."""
        frac = max(step / self.steps, elapsed_s / (60 * self.minutes) if self.minutes else 0.0)
        scale = min(1.0, (step + 1) / self.warmup) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        return self.lr * max(scale, 0.05)


def _data_layers(data: list[Path], live: bool) -> list[int]:
    """The feature layers the data folders were made with (the same in all of them, or ValueError)."""
    metas = []
    for d in data:
        if not (d / "meta.json").is_file():
            raise FileNotFoundError(f"{d} has no meta.json: run `python -m bastion.train data --out {d}` first")
        metas.append(json.loads((d / "meta.json").read_text()))
    if any(m["layer_ids"] != metas[0]["layer_ids"] for m in metas):
        raise ValueError("the --data folders were made with different feature layers: "
                         + ", ".join(f"{d}: {m['layer_ids']}" for d, m in zip(data, metas)))
    if not live:
        no_feats = [str(d) for d, m in zip(data, metas) if not m.get("features", True)]
        if no_feats:
            raise ValueError(f"{', '.join(no_feats)} hold token ids only (data/replay --no-features): "
                             "train with --live-features")
    return list(metas[0]["layer_ids"])


def _fit_drafter(target: Target, cfg: FitConfig, stored_ids: list[int]) -> DFlashDrafter:
    """The drafter to train: loaded from ``cfg.init`` (widened to the added feature layers, grown to
    ``cfg.layers``) or new; checks that it reads the data's layers plus later ones only. Weights it
    initialises (a new drafter, grown layers) are drawn from ``cfg.seed``, so one seed gives one
    start (torch's global generator is left as it was)."""
    added = list(cfg.add_feature_layers or [])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.init is not None:  # warm start from a saved drafter folder (e.g. the shipped weights)
            drafter = load_drafter(cfg.init, target.hidden_size, target.vocab_size, target.num_layers,
                                   dtype=torch.float32)
            if added:
                drafter = widen_features(drafter, added)
            drafter = grow_drafter(drafter, target, cfg.layers or drafter.cfg.num_hidden_layers)
        else:
            drafter = new_drafter(target, cfg.layers or 2, stored_ids + added, cfg.block, cfg.mask_token_id)
    feature_ids = list(drafter.cfg.target_layer_ids)
    extra_ids = feature_ids[len(stored_ids):]
    if feature_ids[:len(stored_ids)] != stored_ids or sorted(set(extra_ids)) != extra_ids \
            or any(i <= stored_ids[-1] for i in extra_ids) or feature_ids[-1] >= target.num_layers:
        raise ValueError(f"the drafter reads target layers {feature_ids}, the data holds {stored_ids}: "
                         "a drafter may only add later layers, ascending, to the data's (--add-feature-layers)")
    bad = [b for b in (cfg.blocks or ()) if not 2 <= b <= drafter.block_size]
    if bad:
        raise ValueError(f"block lengths {bad} outside [2, {drafter.block_size}] (the drafter's block size)")
    return drafter


def _fit_vocab(drafter: DFlashDrafter, records: list[dict], size: int, vocab_size: int, stops: set[int]) -> None:
    """Set the drafter's draft vocabulary to the ``size`` most frequent tokens of ``records`` (it only
    selects rows of the frozen LM head, so it can be refitted as the data grows)."""
    drafter.set_draft_vocab(build_draft_vocab(records, size, vocab_size, stops))
    vocab_cpu = drafter.draft_vocab.cpu()
    covered = sum(int(torch.isin(r["ids"][r["prompt_len"]:].long(), vocab_cpu).sum()) for r in records)
    total = sum(len(r["ids"]) - r["prompt_len"] for r in records)
    print(f"\ndraft vocabulary: {size} ids cover {covered / max(total, 1):.2%} of response tokens", file=sys.stderr)


def _resume(state_path: Path, drafter: DFlashDrafter, opt: torch.optim.Optimizer, rng: random.Random,
            hidden_size: int) -> tuple[int, list[dict]]:
    """Load a checkpoint into drafter, optimiser and batch stream; returns (step, log). A checkpoint of
    another shape (layers, feature layers) is refused with the option to resume it with."""
    st = torch.load(state_path, map_location="cpu", weights_only=False)
    saved = len({k.split(".")[1] for k in st["drafter"] if k.startswith("layers.")})
    if saved != drafter.cfg.num_hidden_layers:
        raise ValueError(f"{state_path} holds a {saved}-layer drafter, this run builds "
                         f"{drafter.cfg.num_hidden_layers}: resume with the --layers it was started with")
    if st["drafter"]["fc.weight"].shape != drafter.fc.weight.shape:
        raise ValueError(f"{state_path} holds a drafter reading {st['drafter']['fc.weight'].shape[1] // hidden_size} "
                         f"target layers, this run builds one reading {list(drafter.cfg.target_layer_ids)}: "
                         "resume with the --add-feature-layers it was started with")
    drafter.set_draft_vocab(st["drafter"].get("draft_vocab"))  # the vocabulary it was trained with
    drafter.load_state_dict(st["drafter"])
    opt.load_state_dict(st["opt"])
    rng.setstate(st["rng"])
    print(f"resumed from step {st['step']}", file=sys.stderr)
    return st["step"], st["log"]


def _load_data(data: list[Path], live: bool) -> tuple[list[dict], int]:
    """Every finished shard's records and the shard count they were loaded at (counted first: a
    shard written meanwhile is then loaded again at the next check, never skipped)."""
    n_shards = count_shards(data)
    records = load_shards(data, ids_only=live)
    checked = [r["agree"][r["prompt_len"]:] for r in records if "agree" in r]
    off = f", {sum(int((~a).sum()) for a in checked)} of {sum(map(len, checked))} checked reply tokens " \
          "not the target's choice" if checked else ""
    print(f"{len(records)} sequences, {sum(len(r['ids']) for r in records)} tokens{off}", file=sys.stderr)
    return records, n_shards


def _bf16_is_fast(device: torch.device) -> bool:
    """bf16 autocast pays on a GPU and on CPUs with bf16 arithmetic; elsewhere it is emulated and
    ~20× slower than float32 (``fit`` then trains in float32 and says so)."""
    from .kernels.cpu_build import cpu_has_bf16

    return device.type != "cpu" or cpu_has_bf16()


def fit(target: Target, data: list[Path], ckpt: Path, cfg: FitConfig) -> None:
    """Train (or resume from ``ckpt``) a drafter on the data folders; runs on the target's device.

    Each step: a batch of random anchor blocks (``distill.make_batch``), the loss of ``distill.train_step``,
    AdamW with the gradient norm clipped at 1. Every ``cfg.ckpt_every`` steps, and at the end, an
    atomic checkpoint (drafter, optimiser, batch stream, log) and the drafter folder if exported; a
    data job still writing shards is picked up at those points."""
    cfg.validate()
    stored_ids = _data_layers(data, cfg.live)
    records, n_shards = _load_data(data, cfg.live)
    for p in target.model.parameters():
        p.requires_grad_(False)
    ckpt.mkdir(parents=True, exist_ok=True)
    state_path = ckpt / "state.pt"
    drafter = _fit_drafter(target, cfg, stored_ids)
    feature_ids = list(drafter.cfg.target_layer_ids)
    if cfg.live:  # the target's hooks give every layer the drafter reads
        target.set_feature_layers(feature_ids)
    blocks = list(cfg.blocks or [drafter.block_size])
    drafter.to(target.device)  # parameters and buffers, the draft vocabulary included
    from .config import stop_token_ids
    stops = stop_token_ids(target.tokenizer, target.model.generation_config)
    if cfg.draft_vocab and not state_path.exists():
        _fit_vocab(drafter, records, cfg.draft_vocab, target.vocab_size, stops)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.01,
                            betas=(0.9, 0.95))
    step, log, rng = 0, [], random.Random(cfg.seed)
    if state_path.exists():
        step, log = _resume(state_path, drafter, opt, rng, target.hidden_size)
    spent = log[-1]["time"] if log else 0.0  # wall time of earlier runs, so a resumed schedule continues
    t0 = time.time() - spent
    deadline = t0 + 60 * cfg.minutes if cfg.minutes else float("inf")
    bf16 = cfg.bf16 and _bf16_is_fast(target.device)
    if cfg.bf16 and not bf16:
        print("fit: this CPU has no bf16 arithmetic (AVX512-BF16 / AMX); training in float32, where bf16 "
              "autocast would run ~20x slower", file=sys.stderr)
    drafter.train()
    while step < cfg.steps and time.time() < deadline:
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step, time.time() - t0)
        # a single full-length block draws nothing: runs without --blocks keep their exact batch stream
        # (and resume bit for bit from checkpoints written before the option existed)
        b = drafter.block_size if blocks == [drafter.block_size] else rng.choice(blocks)
        batch = make_batch(records, cfg.rows, cfg.anchors, b, cfg.mask_token_id, rng).to(target.device)
        if not cfg.live and feature_ids != stored_ids:
            batch = batch._replace(feats=extend_features(target, batch.feats, stored_ids, feature_ids, batch.valid))
        if cfg.feature_noise:
            batch = batch._replace(feats=noisy_features(batch.feats, cfg.feature_noise, target.hidden_size,
                                                        cfg.seed * 1_000_003 + step))
        loss, acc, run = train_step(drafter, target, batch, cfg.gamma, bf16, cfg.loss_depths, cfg.kd, cfg.accept)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        log.append({"step": step, "loss": round(loss.item(), 4), "acc": [round(a, 3) for a in acc],
                    "chain_len": round(run, 3), "time": round(time.time() - t0, 1)}
                   | ({"kd": cfg.kd} if cfg.kd else {}) | ({"accept": cfg.accept} if cfg.accept else {})
                   | ({"feature_noise": cfg.feature_noise} if cfg.feature_noise else {}))  # another scale: say so
        progress(step, cfg.steps, t0, f"loss {loss.item():.3f} acc1 {acc[0]:.2f} acc2 {acc[1]:.2f} chain {run:.2f}",
                 deadline=deadline)  # inf without --minutes: the rate's estimate
        if step % cfg.ckpt_every == 0 and count_shards(data) > n_shards:
            # the data job may still be writing shards: train on everything finished so far
            # (the old list is dropped first: holding both doubles the peak memory)
            records = None
            print(file=sys.stderr)
            records, n_shards = _load_data(data, cfg.live)
            if cfg.draft_vocab:  # refitted only when asked for: an --init drafter keeps its own
                _fit_vocab(drafter, records, cfg.draft_vocab, target.vocab_size, stops)
        if step % cfg.ckpt_every == 0 or step >= cfg.steps or time.time() >= deadline:
            atomic_save({"drafter": drafter.state_dict(), "opt": opt.state_dict(), "step": step, "log": log,
                          "rng": rng.getstate()}, state_path)
            (ckpt / "log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in log))
            if cfg.export:
                save_drafter(drafter.eval(), cfg.export, dtype=torch.float16)
                drafter.train()
    print(file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    """The command line: data, fit, replay, average and plot."""
    ap = argparse.ArgumentParser(prog="python -m bastion.train", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="generate the target's continuations and features")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--prompts", type=int, default=2048)
    d.add_argument("--batch", type=int, default=32)
    d.add_argument("--max-new-tokens", type=int, default=160)
    d.add_argument("--feature-layers", type=int, default=4, help="number of target layers used as features")
    d.add_argument("--corpus", choices=CORPORA, default="base", help="which prompt templates (bastion.corpus)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-features", action="store_true",
                   help="store token ids only (train them with fit --live-features)")
    d.add_argument("--gen-dtype", choices=("float32", "bfloat16"), default=None,
                   help="generate in this dtype (default the target's); a bf16 copy writes ~2× faster on CPUs "
                        "with AMX, and every token it wrote is checked against the target's own choice")
    f = sub.add_parser("fit", help="train the drafter on generated data")
    f.add_argument("--data", type=Path, required=True, action="append", help="data folder (repeatable)")
    f.add_argument("--ckpt", type=Path, required=True)
    f.add_argument("--steps", type=int, default=4000)
    f.add_argument("--minutes", type=float, default=0.0, help="stop (with a checkpoint) after this long")
    f.add_argument("--rows", type=int, default=8)
    f.add_argument("--anchors", type=int, default=8)
    f.add_argument("--lr", type=float, default=6e-4)
    f.add_argument("--layers", type=int, default=None,
                   help="drafter layers (default 2); with --init, grow the loaded drafter to this many")
    f.add_argument("--block", type=int, default=16)
    f.add_argument("--blocks", default=None,
                   help="comma-separated block lengths, one drawn per step (e.g. 9,9,10,12,16: what the engine "
                        "drafts); default --block alone")
    f.add_argument("--gamma", type=float, default=5.0)
    f.add_argument("--ckpt-every", type=int, default=50)
    f.add_argument("--export", type=Path, default=None, help="also write the drafter folder at each checkpoint")
    f.add_argument("--no-bf16", action="store_true", help="train in fp32 (slower where the CPU or GPU has bf16 arithmetic; "
                                                          "CPUs without it train in fp32 anyway)")
    f.add_argument("--loss-depths", type=int, default=None, help="train depths 1..D only (default B−1)")
    f.add_argument("--init", type=Path, default=None, help="start from this drafter folder instead of the target's layers")
    f.add_argument("--draft-vocab", type=int, default=0,
                   help="draft over the N most frequent tokens of the data only (0 = full vocabulary)")
    f.add_argument("--live-features", action="store_true",
                   help="run the target on every batch for its features instead of reading them from the shards")
    f.add_argument("--seed", type=int, default=0,
                   help="seed of the batch stream (rows, anchors, block lengths); a resumed run continues its "
                        "checkpoint's stream. Warm starts that differ only here are ingredients for `average`")
    f.add_argument("--kd", type=float, default=0.0,
                   help="weight in [0, 1] of the target's own next-token distributions in the loss (the rest: "
                        "its greedy label); they cost the target's layers after the last feature layer per batch")
    f.add_argument("--accept", type=float, default=0.0,
                   help="weight in [0, 1] of labels weighted by the expected accepted chain length that rides on "
                        "them (the rest: the fixed depth decay of --gamma)")
    f.add_argument("--feature-noise", type=float, default=0.0,
                   help="σ of Gaussian noise on the context features, relative to each feature layer's RMS "
                        "per token (a regulariser; 0 = none)")
    f.add_argument("--add-feature-layers", default=None,
                   help="comma-separated target layers to read beyond the data's feature layers (later ones, e.g. "
                        "the last); computed per batch from the last stored layer. With --init the drafter's fc "
                        "gains zero columns for them, so training starts from the same drafter")
    r = sub.add_parser("replay", help="feature shards for replies kept in a datastore (when their shards are gone)")
    r.add_argument("--datastore", type=Path, required=True, help="a folder holding datastore.safetensors")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--sequences", type=int, default=2048,
                   help="how many stored replies (a seeded sample; 0 = all)")
    r.add_argument("--batch", type=int, default=16)
    r.add_argument("--feature-layers", type=int, default=4, help="number of target layers used as features")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-features", action="store_true",
                   help="token ids only, no target forward (for fit --live-features, e.g. on a GPU)")
    v = sub.add_parser("average", help="write the element-wise mean of drafters of one lineage (a model soup)")
    v.add_argument("--drafter", type=Path, required=True, action="append", help="drafter folder (repeat, 2 or more)")
    v.add_argument("--out", type=Path, required=True, help="folder to write (config.json + model.safetensors, fp16)")
    c = sub.add_parser("plot", help="draw the loss curve of a checkpoint folder")
    c.add_argument("--ckpt", type=Path, required=True, action="append",
                   help="checkpoint folder; repeat to draw a lineage of warm-started runs end to end")
    c.add_argument("--out", type=Path, required=True)
    for p in (d, f, r, v):
        p.add_argument("--model", default=EMBEDDED)
        p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
        p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the target and the drafter)")
    return ap


def _fit_config(a: argparse.Namespace) -> FitConfig:
    """The ``fit`` command's options as a checked :class:`FitConfig` (ValueError names a bad one)."""
    def ints(text: str | None, flag: str, what: str) -> tuple[int, ...] | None:
        if not text:
            return None
        try:
            return tuple(int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"{flag} {text!r}: give comma-separated {what}") from None

    cfg = FitConfig(steps=a.steps, minutes=a.minutes, rows=a.rows, anchors=a.anchors, lr=a.lr, layers=a.layers,
                    block=a.block, blocks=ints(a.blocks, "--blocks", "integers"), gamma=a.gamma,
                    ckpt_every=a.ckpt_every, export=a.export, seed=a.seed, bf16=not a.no_bf16,
                    loss_depths=a.loss_depths, init=a.init, draft_vocab=a.draft_vocab or None,
                    live=a.live_features, kd=a.kd, accept=a.accept, feature_noise=a.feature_noise,
                    add_feature_layers=ints(a.add_feature_layers, "--add-feature-layers", "layer ids"))
    cfg.validate()
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    fit_cfg = None
    if a.cmd == "fit":  # checked before anything loads
        try:
            fit_cfg = _fit_config(a)
        except ValueError as exc:
            ap.error(str(exc))
    if a.cmd == "plot":
        log, starts = read_logs(a.ckpt)
        plot_log(log, a.out, starts=starts)
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        device = torch.device(checked_device(a.device))
    except ValueError as e:
        ap.error(f"--device: {e}")
    if a.cmd == "average":  # checked before the target loads
        if len(a.drafter) < 2:
            ap.error("average: give two or more --drafter folders")
        if a.out.resolve() in {d.resolve() for d in a.drafter}:
            ap.error(f"average: --out {a.out} is one of the inputs (it would be replaced)")
    if a.cmd == "replay" and not (a.datastore / "datastore.safetensors").is_file():
        print(f"error: no datastore at {a.datastore / 'datastore.safetensors'}", file=sys.stderr)
        return 2  # before the target loads
    target = load_target(a.model, torch.float32, str(device))
    if a.cmd == "average":
        from .drafter_io import load_drafter, save_drafter
        try:
            drafters = [load_drafter(d, target.hidden_size, target.vocab_size, target.num_layers, dtype=torch.float32)
                        for d in a.drafter]
            save_drafter(average_drafters(drafters), a.out, dtype=torch.float16)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote the mean of {len(drafters)} drafters to {a.out}", file=sys.stderr)
    elif a.cmd == "data":
        if a.prompts < 1 or a.batch < 1 or a.max_new_tokens < 1:
            ap.error("--prompts, --batch and --max-new-tokens must be positive")
        if a.gen_dtype == "bfloat16" and not _bf16_is_fast(target.device):
            print("data: this CPU has no bf16 arithmetic (AVX512-BF16 / AMX): --gen-dtype bfloat16 will be "
                  "slower than float32 here, not faster", file=sys.stderr)
        make_data(target, a.out, a.prompts, a.batch, a.max_new_tokens,
                  spread_layer_ids(target.num_layers, a.feature_layers), seed=a.seed, corpus=a.corpus,
                  features=not a.no_features, gen_dtype=a.gen_dtype and getattr(torch, a.gen_dtype))
    elif a.cmd == "replay":
        if a.sequences < 0 or a.batch < 1:
            ap.error("--sequences must be ≥ 0 (0 = all) and --batch positive")
        try:
            make_replay(target, a.out, a.datastore, a.sequences, a.batch,
                        spread_layer_ids(target.num_layers, a.feature_layers), seed=a.seed,
                        features=not a.no_features)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        fit(target, a.data, a.ckpt, fit_cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
