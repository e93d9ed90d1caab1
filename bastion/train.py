"""Self-distillation of a DFlash drafter for a target, on CPU (or one GPU), resumable.

    python -m bastion.train data  --out DIR [--corpus base|broad|self] [--prompts N] [--batch 128] [--max-new-tokens 160]
    python -m bastion.train replay --datastore FOLDER --out DIR [--sequences N]
    python -m bastion.train features --data IDS_DIR --out DIR [--batch 16]
    python -m bastion.train text  --source stdlib --source packages [--source PATH] --out DIR [--chunks N]
    python -m bastion.train fit   --data DIR [--data DIR2 ...] --ckpt DIR [--steps N] [--minutes M]
                                  [--init FOLDER] [--draft-vocab N] [--export FOLDER]
    python -m bastion.train average --drafter A --drafter B [...] --out FOLDER

``data``: the offline corpus (bastion.corpus, eval and dev prompts excluded; ``self``: requests the target
writes itself, see ``make_requests``) → the target's own greedy
continuations, generated in batches (batching is what makes this affordable on 2 cores), plus the
feature-layer hidden states of every token, written in shards; finished shards are never redone.
``--no-features`` stores token ids only (a few MB instead of GBs); ``fit --live-features`` then runs
the target on every batch instead (the sensible split on a GPU, where that forward is cheap).

``features``: the target's feature-layer states for an ids-only folder (``data --no-features``, e.g.
replies a GPU wrote in minutes), checked token by token against this target's greedy choices, so a
CPU's ``fit`` can train on them without ``--live-features``.

``text``: offline text (``bastion.textcorpus``: the standard library, installed packages' READMEs,
any files) as the assistant's replies, with the target's greedy choice after every token — one forward
a batch; ``fit`` trains those choices where the text has followed them (``distill.make_batch``).

``fit``: random anchor positions a in the response; context = target features of tokens < a;
block = [x_a, MASK × (B−1)]; labels = x_{a+1..a+B−1}. Loss = Σ_k w_k·CE_k with w_k = exp(−(k−1)/γ)
(early depths matter most for acceptance). Checkpoints (atomic) every ``--ckpt-every`` steps;
a rerun resumes from the last one.

``average``: the element-wise mean of warm-started runs of one drafter (``average_drafters``).

The data side lives in ``traindata.py``, the making of drafters (new, grown, widened, averaged, the
draft vocabulary) in ``drafter_ops.py``, the batches and the loss in ``distill.py``, :class:`FitConfig`
and ``fit`` in ``fitting.py``; this module is the command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .corpus import CORPORA
from .drafter_config import spread_layer_ids
from .drafter_ops import average_drafters
from .datastore import FILE as DATASTORE_FILE
from .fitting import FitConfig, bf16_is_fast, fit
from .loading import EMBEDDED, checked_device, load_target
from .refeature import make_features, make_replay
from .traindata import make_data, make_text
from .trainlog import plot_log, read_logs  # noqa: F401  (the plot command; read_logs is public here too)


def _parser() -> argparse.ArgumentParser:
    """The command line: data, fit, replay, features, average, text and plot."""
    ap = argparse.ArgumentParser(prog="python -m bastion.train", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d, f = _data_command(sub), _fit_command(sub)
    r, e, v = _replay_and_average_commands(sub)
    t = _text_command(sub)
    for p in (d, f, r, e, v, t):
        p.add_argument("--model", default=EMBEDDED)
        p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
        p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the target and the drafter)")
    return ap


def _data_command(sub) -> argparse.ArgumentParser:
    """``data``: the target's continuations (and features) of a prompt corpus, in shards."""
    d = sub.add_parser("data", help="generate the target's continuations and features")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--prompts", type=int, default=2048)
    d.add_argument("--batch", type=int, default=128,
                   help="prompts written together (and per shard); the lean batched loop (bastion.batchgen) "
                        "runs its products near a CPU's peak from ~128 rows")
    d.add_argument("--max-new-tokens", type=int, default=160)
    d.add_argument("--feature-layers", type=int, default=4, help="number of target layers used as features")
    d.add_argument("--corpus", choices=CORPORA, default="base", help="which prompt templates (bastion.corpus)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-features", action="store_true",
                   help="store token ids only (train them with fit --live-features)")
    d.add_argument("--gen-dtype", choices=("float32", "bfloat16"), default=None,
                   help="generate in this dtype (default the target's); every token a bf16 copy writes is "
                        "checked against the target's own choice by a second, float32 forward, so with features "
                        "it was slower than float32 on the AMX Xeon (113 against 160 replies a minute)")
    d.add_argument("--request-dtype", choices=("float32", "bfloat16"), default=None,
                   help="--corpus self: write the request list in this dtype (default --gen-dtype's); requests "
                        "are samples, not labels, so a bf16 copy needs no check (AMX Xeon: 9 requests a "
                        "second against float32's 5.9; a Xeon with AVX512-BF16 but no AMX: 2.0 against 3.4)")
    return d


def _text_command(sub) -> argparse.ArgumentParser:
    """``text``: offline documents as replies, with features and the target's greedy choices."""
    t = sub.add_parser("text", help="offline text as training data (one forward a batch, no generation)")
    t.add_argument("--source", required=True, action="append",
                   help="a file, a folder of .md/.rst/.txt/.py/METADATA files, or the name stdlib (Python's "
                        "standard library) or packages (installed distributions' READMEs); repeatable")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--chunks", type=int, default=2048, help="how many chunks (a seeded sample)")
    t.add_argument("--max-tokens", type=int, default=256, help="tokens per chunk at most")
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--feature-layers", type=int, default=4, help="number of target layers used as features")
    t.add_argument("--seed", type=int, default=0)
    return t


def _fit_command(sub) -> argparse.ArgumentParser:
    """``fit``: train a drafter on data folders (:class:`FitConfig`)."""
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
    f.add_argument("--no-bf16", action="store_true", help="train in fp32 (slower on a GPU or a CPU with AMX; "
                                                          "CPUs without AMX train in fp32 anyway)")
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
    f.add_argument("--reveal", type=float, default=0.0,
                   help="share in [0, 1] of blocks whose first j masks hold the true tokens (no loss there; j >= 1, "
                        "P(j) ~ 1/j): teaches the drafter to read drafted tokens, for the engine's refine passes. "
                        "The logged chain length counts such a block's chain as ending at its first revealed depth")
    f.add_argument("--add-feature-layers", default=None,
                   help="comma-separated target layers to read beyond the data's feature layers (later ones, e.g. "
                        "the last); computed per batch from the last stored layer. With --init the drafter's fc "
                        "gains zero columns for them, so training starts from the same drafter")
    return f


def _replay_and_average_commands(sub) -> tuple[argparse.ArgumentParser, ...]:
    """``replay`` (feature shards for a datastore's replies), ``features`` (for an ids-only folder),
    ``average`` (a mean of drafters) and ``plot``."""
    r = sub.add_parser("replay", help="feature shards for replies kept in a datastore (when their shards are gone)")
    r.add_argument("--datastore", type=Path, required=True, help="a folder holding datastore.safetensors")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--sequences", type=int, default=2048,
                   help="how many stored replies (a seeded sample; 0 = all)")
    r.add_argument("--batch", type=int, default=16)
    r.add_argument("--feature-layers", type=int, default=4, help="number of target layers used as features")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--newest", type=int, default=0,
                   help="sample from the last N stored replies only (those an --extend added last; 0 = all)")
    r.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the target's dtype for the feature forward (bfloat16: ~3x faster on a CPU with AMX; "
                        "the features differ from float32's by bf16 rounding, far below fit's --feature-noise)")
    r.add_argument("--no-features", action="store_true",
                   help="token ids only, no target forward (for fit --live-features, e.g. on a GPU)")
    e = sub.add_parser("features", help="add the target's features to an ids-only data folder (e.g. one a GPU wrote)")
    e.add_argument("--data", type=Path, required=True, help="an ids-only data folder (data --no-features)")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--batch", type=int, default=16)
    v = sub.add_parser("average", help="write the element-wise mean of drafters of one lineage (a model soup)")
    v.add_argument("--drafter", type=Path, required=True, action="append", help="drafter folder (repeat, 2 or more)")
    v.add_argument("--out", type=Path, required=True, help="folder to write (config.json + model.safetensors, fp16)")
    c = sub.add_parser("plot", help="draw the loss curve of a checkpoint folder")
    c.add_argument("--ckpt", type=Path, required=True, action="append",
                   help="checkpoint folder; repeat to draw a lineage of warm-started runs end to end")
    c.add_argument("--out", type=Path, required=True)
    return r, e, v


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
                    live=a.live_features, kd=a.kd, accept=a.accept, feature_noise=a.feature_noise, reveal=a.reveal,
                    add_feature_layers=ints(a.add_feature_layers, "--add-feature-layers", "layer ids"))
    cfg.validate()
    return cfg


def _check_before_loading(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """The commands' input checks that need no target (``ap.error`` exits, or 2 for a missing datastore)."""
    if a.cmd == "average":
        if len(a.drafter) < 2:
            ap.error("average: give two or more --drafter folders")
        if a.out.resolve() in {d.resolve() for d in a.drafter}:
            ap.error(f"average: --out {a.out} is one of the inputs (it would be replaced)")
    if a.cmd == "replay" and (a.sequences < 0 or a.batch < 1 or a.newest < 0):
        ap.error("--sequences and --newest must be ≥ 0 (0 = all) and --batch positive")
    if a.cmd == "replay" and not (a.datastore / DATASTORE_FILE).is_file():
        print(f"error: no datastore at {a.datastore / DATASTORE_FILE}", file=sys.stderr)
        return 2
    if a.cmd == "features":
        if a.batch < 1:
            ap.error("--batch must be positive")
        meta = a.data / "meta.json"
        if not meta.is_file():
            print(f"error: {a.data} is no data folder (no meta.json)", file=sys.stderr)
            return 2
    if a.cmd == "data" and a.request_dtype is not None and a.corpus != "self":
        ap.error(f"--request-dtype is for --corpus self (the target writes its requests), not {a.corpus}")
    if a.cmd == "text":
        from .textcorpus import text_files
        try:
            text_files(a.source)
        except ValueError as exc:
            ap.error(str(exc))
    return 0


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
    refused = _check_before_loading(ap, a)
    if refused:
        return refused
    dtype = getattr(torch, a.dtype) if a.cmd == "replay" else torch.float32
    if dtype == torch.bfloat16 and not bf16_is_fast(device):
        print("replay: this CPU has no AMX: --dtype bfloat16 will be slower than float32 here, not faster",
              file=sys.stderr)
    target = load_target(a.model, dtype, str(device))
    try:
        _run(ap, a, target, fit_cfg)
    except (OSError, ValueError) as exc:
        if a.cmd in ("data", "fit"):  # their errors carry tracebacks worth reading (and tests match them)
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _run(ap: argparse.ArgumentParser, a: argparse.Namespace, target, fit_cfg: FitConfig | None) -> None:
    """The command ``a.cmd`` once the target is loaded (bad input raises OSError or ValueError)."""
    if a.cmd == "average":
        from .drafter_io import load_drafter, save_drafter
        drafters = [load_drafter(d, target.hidden_size, target.vocab_size, target.num_layers, dtype=torch.float32)
                    for d in a.drafter]
        save_drafter(average_drafters(drafters), a.out, dtype=torch.float16)
        print(f"wrote the mean of {len(drafters)} drafters to {a.out}", file=sys.stderr)
    elif a.cmd == "data":
        if a.prompts < 1 or a.batch < 1 or a.max_new_tokens < 1:
            ap.error("--prompts, --batch and --max-new-tokens must be positive")
        for flag, dt in (("--gen-dtype", a.gen_dtype), ("--request-dtype", a.request_dtype)):
            if dt == "bfloat16" and not bf16_is_fast(target.device):
                print(f"data: this CPU has no AMX: {flag} bfloat16 will be slower than float32 here, not "
                      "faster", file=sys.stderr)
        make_data(target, a.out, a.prompts, a.batch, a.max_new_tokens,
                  spread_layer_ids(target.num_layers, a.feature_layers), seed=a.seed, corpus=a.corpus,
                  features=not a.no_features, gen_dtype=a.gen_dtype and getattr(torch, a.gen_dtype),
                  request_dtype=a.request_dtype and getattr(torch, a.request_dtype))
    elif a.cmd == "replay":
        make_replay(target, a.out, a.datastore, a.sequences, a.batch,
                    spread_layer_ids(target.num_layers, a.feature_layers), seed=a.seed, features=not a.no_features,
                    newest=a.newest)
    elif a.cmd == "features":
        make_features(target, a.out, a.data, a.batch)
    elif a.cmd == "text":
        make_text(target, a.out, a.source, a.chunks, a.batch, a.max_tokens,
                  spread_layer_ids(target.num_layers, a.feature_layers), seed=a.seed)
    else:
        fit(target, a.data, a.ckpt, fit_cfg)

if __name__ == "__main__":
    raise SystemExit(main())
