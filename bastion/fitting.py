"""Training a drafter: :class:`FitConfig` (the ``fit`` command's options) and :func:`fit`.

Each step draws random anchor positions a in the stored replies: context = target features of
tokens < a; block = [x_a, MASK × (B−1)]; labels = x_{a+1..a+B−1} (``distill.make_batch``); loss =
Σ_k w_k·CE_k with w_k = exp(−(k−1)/γ), early depths weighing most (``distill.train_step``). The
command line is ``python -m bastion.train fit`` (``train.py``); the data side lives in
``traindata.py``, the making of drafters in ``drafter_ops.py``.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .drafter import DFlashDrafter
from .datastore import FILE as DATASTORE_FILE
from .drafter_io import load_drafter, save_drafter
from .distill import live_features, make_batch, noisy_features, reveal_prefixes, train_step
from .drafter_ops import build_draft_vocab, extend_features, grow_drafter, new_drafter, widen_features
from .target import Target
from .traindata import atomic_save, count_shards, load_shards, progress


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

    ``reveal``: the share of blocks whose first j ≥ 1 masks hold their labels instead (no loss there;
    ``distill.reveal_prefixes``), so the drafter learns to read drafted tokens: what its refinement
    passes show it (``DFlashDrafter.draft(refine=…)``). 0: none.

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
    bf16: bool = True            # autocast the drafter's forward to bf16 (where it is fast: bf16_is_fast)
    loss_depths: int | None = None  # train depths 1..D only (default B − 1)
    init: Path | None = None     # warm start from this drafter folder
    draft_vocab: int | None = None  # draft over the N most frequent tokens of the data only
    live: bool = False
    kd: float = 0.0
    add_feature_layers: tuple[int, ...] | None = None
    accept: float = 0.0
    feature_noise: float = 0.0   # σ of the context features' noise, relative to each layer's RMS
    reveal: float = 0.0          # share of blocks with a revealed prefix (distill.reveal_prefixes)
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
        if not 0.0 <= self.reveal <= 1.0:
            raise ValueError(f"--reveal {self.reveal}: give a share of blocks in [0, 1]")
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
    text = [r for r in records if "greedy" in r]
    if text:  # offline text: how often it follows the target's own choices bounds its deeper labels
        n = sum(len(r["ids"]) - r["prompt_len"] for r in text)
        hit = sum(int((r["ids"][r["prompt_len"]:] == r["greedy"][r["prompt_len"] - 1:-1]).sum()) for r in text)
        off += f", {len(text)} text sequences whose reply tokens are the target's choice {hit / max(n, 1):.0%} of the time"
    print(f"{len(records)} sequences, {sum(len(r['ids']) for r in records)} tokens{off}", file=sys.stderr)
    return records, n_shards


def bf16_is_fast(device: torch.device) -> bool:
    """bf16 autocast pays on a GPU and on CPUs with AMX; elsewhere ``fit`` trains in float32 and says
    so. Without bf16 arithmetic it is emulated, ~20× slower than float32 (an AVX2 EPYC); with
    AVX512-BF16 but no AMX it is still ~2× slower (0.67 against 1.30 steps a second on a 2-core Xeon,
    the same batches, session 56: torch's bf16 products run below its float32 ones there)."""
    from .kernels.cpu_build import cpu_has_amx

    return device.type != "cpu" or cpu_has_amx()


def fit(target: Target, data: list[Path], ckpt: Path, cfg: FitConfig) -> None:
    """Train (or resume from ``ckpt``) a drafter on the data folders; runs on the target's device.

    Each step: a batch of random anchor blocks (``distill.make_batch``), the loss of ``distill.train_step``,
    AdamW with the gradient norm clipped at 1. Every ``cfg.ckpt_every`` steps, and at the end, an
    atomic checkpoint (drafter, optimiser, batch stream, log) and the drafter folder if exported; a
    data job still writing shards is picked up at those points."""
    cfg.validate()
    stored_ids = _data_layers(data, cfg.live)
    records, n_shards = _load_data(data, cfg.live)
    from .config import stop_token_ids
    stops = stop_token_ids(target.tokenizer, target.model.generation_config)
    drafter, opt, step, log, rng = _start(target, cfg, ckpt, stored_ids, records, stops)
    blocks = list(cfg.blocks or [drafter.block_size])
    spent = log[-1]["time"] if log else 0.0  # wall time of earlier runs, so a resumed schedule continues
    t0 = time.time() - spent
    deadline = t0 + 60 * cfg.minutes if cfg.minutes else float("inf")
    bf16 = cfg.bf16 and bf16_is_fast(target.device)
    if cfg.bf16 and not bf16:
        print("fit: training in float32: this CPU has no AMX, and without it bf16 autocast runs slower "
              "(~2x with AVX512-BF16, ~20x without)", file=sys.stderr)
    # the exported folder keeps the --init folder's datastore: without it Bastion would lose a source
    carry = tuple(p for p in [cfg.init / DATASTORE_FILE] if p.is_file()) if cfg.init and cfg.export else ()
    while step < cfg.steps and time.time() < deadline:
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step, time.time() - t0)
        # a single full-length block draws nothing: runs without --blocks keep their exact batch stream
        # (and resume bit for bit from checkpoints written before the option existed)
        b = drafter.block_size if blocks == [drafter.block_size] else rng.choice(blocks)
        batch = reveal_prefixes(make_batch(records, cfg.rows, cfg.anchors, b, cfg.mask_token_id, rng), cfg.reveal,
                                rng).to(target.device)
        loss, acc, run = _step(drafter, target, opt, cfg, batch, stored_ids, step, bf16)
        step += 1
        log.append({"step": step, "loss": round(loss, 4), "acc": [round(a, 3) for a in acc],
                    "chain_len": round(run, 3), "time": round(time.time() - t0, 1)}
                   | ({"kd": cfg.kd} if cfg.kd else {}) | ({"accept": cfg.accept} if cfg.accept else {})
                   | ({"feature_noise": cfg.feature_noise} if cfg.feature_noise else {})
                   | ({"reveal": cfg.reveal} if cfg.reveal else {}))  # another scale: say so
        progress(step, cfg.steps, t0, f"loss {loss:.3f} acc1 {acc[0]:.2f} acc2 {acc[1]:.2f} chain {run:.2f}",
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
            _checkpoint(ckpt, drafter, opt, step, log, rng, cfg.export, carry)
    print(file=sys.stderr)


def _start(target: Target, cfg: FitConfig, ckpt: Path, stored_ids: list[int], records: list[dict], stops: set[int]
           ) -> tuple[DFlashDrafter, torch.optim.Optimizer, int, list[dict], random.Random]:
    """The run's drafter (on the target's device, in training mode), its AdamW optimiser, and the step,
    log and batch stream to go on from: ``ckpt``'s checkpoint when there is one, else a fresh start
    (the draft vocabulary fitted to ``records`` when ``cfg.draft_vocab`` asks). The target is frozen."""
    for p in target.model.parameters():
        p.requires_grad_(False)
    ckpt.mkdir(parents=True, exist_ok=True)
    state_path = ckpt / "state.pt"
    drafter = _fit_drafter(target, cfg, stored_ids)
    if cfg.live:  # the target's hooks give every layer the drafter reads
        target.set_feature_layers(list(drafter.cfg.target_layer_ids))
    drafter.to(target.device)  # parameters and buffers, the draft vocabulary included
    if cfg.draft_vocab and not state_path.exists():
        _fit_vocab(drafter, records, cfg.draft_vocab, target.vocab_size, stops)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.01,
                            betas=(0.9, 0.95))
    step, log, rng = 0, [], random.Random(cfg.seed)
    if state_path.exists():
        step, log = _resume(state_path, drafter, opt, rng, target.hidden_size)
    drafter.train()
    return drafter, opt, step, log, rng


def _step(drafter: DFlashDrafter, target: Target, opt: torch.optim.Optimizer, cfg: FitConfig, batch, stored_ids: list[int],
          step: int, bf16: bool) -> tuple[float, list[float], float]:
    """One optimiser step on ``batch`` (its features carried to added layers and noised as ``cfg``
    asks): the loss of ``distill.train_step``, AdamW with the gradient norm clipped at 1. Returns
    (loss, per-depth accuracy, mean accepted chain length) of the batch; ``bf16``: autocast the drafter."""
    feature_ids = list(drafter.cfg.target_layer_ids)
    if not cfg.live and feature_ids != stored_ids:
        batch = batch._replace(feats=extend_features(target, batch.feats, stored_ids, feature_ids, batch.valid))
    if batch.feats is None:  # --live-features: the target's features first, so the noise reaches them
        # under the step's autocast as before: on a GPU bf16 rounding (~0.4% of a feature) is far below
        # the noise the recipe adds (--feature-noise 0.3: 30% of each layer's RMS) and several times faster
        with torch.autocast(batch.valid.device.type, dtype=torch.bfloat16, enabled=bf16):
            batch = live_features(target, batch)
    if cfg.feature_noise:
        batch = batch._replace(feats=noisy_features(batch.feats, cfg.feature_noise, target.hidden_size,
                                                    cfg.seed * 1_000_003 + step))
    loss, acc, run = train_step(drafter, target, batch, cfg.gamma, bf16, cfg.loss_depths, cfg.kd, cfg.accept)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    opt.step()
    return loss.item(), acc, run


def _checkpoint(ckpt: Path, drafter: DFlashDrafter, opt: torch.optim.Optimizer, step: int, log: list[dict],
                rng: random.Random, export: Path | None, carry: tuple[Path, ...] = ()) -> None:
    """The atomic checkpoint (drafter, optimiser, batch stream, log), the log as JSON lines, and the
    drafter folder (fp16, with the ``carry`` files) when ``export`` is set."""
    atomic_save({"drafter": drafter.state_dict(), "opt": opt.state_dict(), "step": step, "log": log,
                 "rng": rng.getstate()}, ckpt / "state.pt")
    (ckpt / "log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in log))
    if export:
        save_drafter(drafter.eval(), export, dtype=torch.float16, carry=carry)
        drafter.train()
