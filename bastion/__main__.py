"""Command line: ``python -m bastion generate ...``, ``python -m bastion bench ...``,
``python -m bastion report FOLDER`` and ``python -m bastion profile FOLDER``.

Bad input gets one line on stderr and exit code 2, before any model is loaded where possible.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from .config import STRATEGIES, GenerationConfig


class UsageError(Exception):
    """A problem with what the user asked for: reported in one line, exit code 2."""


def _generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text with speculative decoding")
    g.add_argument("--prompt", required=True, help="the user message (wrapped in the chat template unless --raw)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--strategy", default="bastion", help="|".join(STRATEGIES))
    g.add_argument("--budget", type=int, default=32, help="draft nodes for --strategy fixed")
    g.add_argument("--max-nodes", type=int, default=128, help="cap on draft nodes for bastion")
    g.add_argument("--no-skip-draft", action="store_true",
                   help="bastion: draft every round, even when a plain step is predicted faster")
    g.add_argument("--no-draft", action="store_true",
                   help="bastion: never run the drafter; prompt lookup and the datastore alone (what the drafter adds)")
    g.add_argument("--no-lookup", action="store_true", help="bastion: no prompt-lookup branch in the tree")
    g.add_argument("--no-datastore", action="store_true", help="bastion: no datastore branch in the tree")
    g.add_argument("--no-condition", action="store_true",
                   help="bastion at T = 0: give every node of a depth the drafter's marginals (no n-gram re-weighting)")
    g.add_argument("--no-calibration", action="store_true",
                   help="rank tree candidates by the drafter's raw q instead of the calibrated g(q)")
    g.add_argument("--no-pad-rows", action="store_true",
                   help="verify each tree as its own row count, not the cheapest count at or above it")
    g.add_argument("--full-depth", action="store_true",
                   help="bastion: draft the drafter's whole block every round, not only the depths its trees reach")
    g.add_argument("--node-cost", action="store_true",
                   help="price the host's tree-building and commit time per node in the throughput rule (for "
                        "hosts where a verification costs the same for 1 and 64 rows, e.g. a small model on a GPU)")
    g.add_argument("--no-couple", action="store_true",
                   help="T > 0: rank draft candidates by the drafter's q alone, not also by the target's own "
                        "Gumbel draws (coupled drafting, bastion/coupling.py; the output is the same either way)")
    g.add_argument("--refine", type=int, default=None,
                   help="refinement passes per draft: pass i + 1 redrafts the depths after the i tokens drafted so "
                        "far (default: the drafter's own refine_passes, 0 for the shipped one; DFlashDrafter.draft)")
    g.add_argument("--cost-profile", default=None,
                   help="size trees with another host's measured costs (a name under bastion/profiles, e.g. "
                        "h100-s43, or a JSON file from `python -m bastion profile`): a what-if, see bastion/costprofile.py")
    g.add_argument("--max-new-tokens", type=int, default=128, help="stop after this many new tokens (default 128)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (output identical to plain greedy decoding); > 0 samples exactly as the target")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold in (0, 1] (T > 0)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only (T > 0)")
    g.add_argument("--seed", type=int, default=0,
                   help="random stream of T > 0 (one seed, one sample, whatever the strategy)")
    g.add_argument("--model", default="embedded", help="'embedded', a local HF folder or a hub id")
    g.add_argument("--drafter", default=None, help="DFlash drafter folder or hub id (default: the shipped one)")
    g.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or float64")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when visible, else cpu)")
    g.add_argument("--kernels", default="auto", help="auto|torch|triton")
    g.add_argument("--trace", type=Path, default=None, help="write one JSON step record per line")
    g.add_argument("--json", action="store_true", help="print one JSON object with the result")


def _checked_config(a) -> GenerationConfig:
    """The generation settings from the command line, every bad value refused before anything loads."""
    from .kernels import BACKENDS
    from .loading import DTYPES

    cfg = GenerationConfig(strategy=a.strategy, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                           top_p=a.top_p, top_k=a.top_k, seed=a.seed, budget=a.budget, max_nodes=a.max_nodes,
                           skip_draft=not a.no_skip_draft, draft=not a.no_draft, lookup=not a.no_lookup,
                           datastore=not a.no_datastore, condition=not a.no_condition,
                           calibrate=not a.no_calibration, pad_rows=not a.no_pad_rows,
                           adaptive_depth=not a.full_depth, node_cost=a.node_cost, couple=not a.no_couple,
                           refine=a.refine, cost_profile=_cost_profile(a.cost_profile))
    try:
        cfg.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not a.prompt.strip():
        raise UsageError("the prompt is empty")
    if a.dtype not in DTYPES:
        raise UsageError(f"unknown dtype {a.dtype!r}; choose one of {', '.join(DTYPES)}")
    if a.kernels not in BACKENDS:
        raise UsageError(f"unknown kernel backend {a.kernels!r}; choose one of {', '.join(BACKENDS)}")
    if a.trace is not None and not a.trace.parent.exists():
        raise UsageError(f"trace folder {a.trace.parent} does not exist")
    return cfg


def _cost_profile(name: str | None):
    """``--cost-profile``'s profile (None without it); a bad name or file is a UsageError."""
    if name is None:
        return None
    from .costprofile import load_profile

    try:
        return load_profile(name)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _engine_and_prompt(a, cfg: GenerationConfig):
    """(Engine, prompt token ids): target, drafter and datastore loaded, the prompt encoded and checked
    against the model's context; any failure a UsageError."""
    from .drafter_io import precheck_local_drafter
    from .engine import Engine
    from .loading import DTYPES, encode_prompt, load_default_datastore, load_default_drafter, load_target

    log = (lambda *x: print(*x, file=sys.stderr))
    try:
        precheck_local_drafter(a.drafter)
        target = load_target(a.model, DTYPES[a.dtype], a.device, progress=log)
        drafter = load_default_drafter(target, a.drafter, a.model)
        datastore = load_default_datastore(target, a.drafter, a.model) if drafter is not None else None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load: {exc}") from None
    if drafter is None and cfg.strategy != "ar":
        raise UsageError(f"strategy {cfg.strategy!r} needs a drafter: pass --drafter (or use --strategy ar)")
    try:
        ids = encode_prompt(target.tokenizer, a.prompt, a.raw)
        engine = Engine(target, drafter, kernels=a.kernels, datastore=datastore)
        if len(ids) >= target.max_positions:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {target.max_positions}")
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    return engine, ids


def _write_trace(path: Path, steps: list) -> None:
    """One JSON step record per line, written whole or not at all (temporary file, then rename)."""
    fd, tmp = tempfile.mkstemp(prefix=".trace-", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        for s in steps:
            fh.write(json.dumps(s.to_dict()) + "\n")
    os.replace(tmp, path)


def run_generate(a) -> int:
    cfg = _checked_config(a)
    engine, ids = _engine_and_prompt(a, cfg)
    if engine.unprobed(cfg):  # the engine's one probe: say so
        print("[bastion] timing this machine's verification costs (once per process, a few seconds)...",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        engine.prepare(cfg)
        print(f"[bastion] timed in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    steps = []
    for step in engine.generate(ids, cfg):
        steps.append(step)
        if not a.json:  # the reply as it grows; a stop token ends it unprinted (as in --json's text)
            texts = step.token_texts[:-1] if step.finish_reason == "stop token" else step.token_texts
            print("".join(texts), end="", flush=True)
    result = engine.summarize(steps, len(ids))
    if a.trace is not None:
        _write_trace(a.trace, steps)
    if a.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"\n\n[{result.strategy}] {len(result.token_ids)} tokens in {result.steps} rounds, "
              f"tau {result.tau:.2f}, {result.tokens_per_s:.1f} tok/s, decode {result.decode_s:.2f} s "
              f"({result.finish_reason})", file=sys.stderr)
        if cfg.cost_profile is not None:
            modeled = cfg.cost_profile.modeled_s(steps)
            print(f"[{result.strategy}] trees sized for {cfg.cost_profile.name}: mean tree "
                  f"{result.mean_tree_size:.1f}, modeled {len(result.token_ids) / modeled:.1f} tok/s there", file=sys.stderr)
    return 0


def _report_parser(sub) -> None:
    r = sub.add_parser("report", help="draw a benchmark folder's results.md and plots again from its saved data")
    r.add_argument("folder", type=Path, help="a folder `bench` wrote (results.json, rounds.csv.gz)")


def run_report(a) -> int:
    from .report import redraw

    try:
        paths = redraw(a.folder)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(str(p) for p in paths))
    return 0


def _profile_parser(sub) -> None:
    r = sub.add_parser("profile", help="measure a cost profile (bastion/costprofile.py) from a benchmark folder")
    r.add_argument("folder", type=Path, help="a folder `bench` wrote on the host to profile")
    r.add_argument("--name", default=None, help="the profile's name (default: the folder's)")
    r.add_argument("--out", type=Path, default=None, help="write the JSON here (default: print it)")


def run_profile(a) -> int:
    from .costprofile import profile_from_bench

    try:
        profile = profile_from_bench(a.folder, a.name)
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"cannot measure a cost profile from {a.folder}: {exc}") from None
    if a.out is None:
        print(json.dumps(profile.to_dict(), indent=1))
        return 0
    if not a.out.parent.is_dir():
        raise UsageError(f"folder {a.out.parent} does not exist")
    tmp = a.out.with_name(f".{a.out.name}.tmp")  # whole or not at all
    profile.save(tmp)
    os.replace(tmp, a.out)
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bastion", description="Bastion: budget-aware tree speculative decoding")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _generate_parser(sub)
    _report_parser(sub)
    _profile_parser(sub)
    try:
        from .bench import add_parser as add_bench, run_bench
        add_bench(sub)
    except ImportError:
        run_bench = None
    a = ap.parse_args(argv)
    try:
        if a.cmd == "generate":
            return run_generate(a)
        if a.cmd == "report":
            return run_report(a)
        if a.cmd == "profile":
            return run_profile(a)
        return run_bench(a)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
