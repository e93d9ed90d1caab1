"""The benchmark harness: every strategy on every prompt of a suite, in one process.

    python -m bastion bench --prompts assets/eval_prompts.json --strategies ar,chain,fixed:32,bastion

**Order.** One short warm-up run per strategy (not recorded), then for each prompt and each repeat
every strategy in turn, the turn starting one place later on every prompt: drift of a shared machine
(heat, other jobs) hits all strategies alike and none always runs first. AR always runs: it is the
reference for speedup and token equality. One engine serves every strategy, as in a serving process:
its online calibration of the verification cost C(n) — the host's, whatever the strategy — carries
over from run to run, while the draft and host times T_d and T_o that the throughput rule adds to it
are each strategy's own (``LatencyModel.overheads``), so no strategy plans with another's.

**Two drafters** (``--drafter-b DIR``): a second engine on the same target, with that drafter and the
datastore stored beside it, runs every strategy whose name ends in ``@b`` (``bastion@b``, ``chain@b``)
in the same interleaved turns — an A/B of drafters whose ratios share one run's machine.

**Timing** is decode tokens/s with the prefill excluded. Engine: :attr:`Step.elapsed_s` (the clock
starts after the prefill of prompt[:-1]; every generated token counts). transformers' ``generate``
(``--hf-baselines``): a streamer stamps each batch of tokens as it comes out; the first batch follows
the prefill forward, so the rate is (tokens after the first batch) / (time from first to last batch).

**Aggregates** pool repeats and prompts: tokens/s = Σ tokens / Σ decode s; τ = Σ tokens / Σ rounds;
mean tree size = Σ nodes / Σ rounds (root included); speedup_vs_ar = mean over prompts of
tokens/s ÷ AR's tokens/s on that prompt; match_ar = fraction of prompts whose token ids equal AR's in
every repeat; latency_error = median |predicted − measured| / measured verify time over rounds ≥ 10
of every run (as ``GenerationResult.latency_error``); peak_rss_mb = the largest resident set of a run,
per run on Linux (the kernel's high-water mark is reset before each run), else the process's peak.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from .drafter_io import precheck_local_drafter
from .engine import Engine
from .bench_strategies import BenchError, Strategy, parse_strategies
from .costprofile import CostProfile, load_profile
from .bench_runs import linear_mode, peak_memory, reset_peak_memory, run_engine, run_hf, shown_path
from .kernels import cpu_native
from .kernels.cpu_linear import MODES
from .probe import set_drafter_products
from .report import BenchOutput, Run, load_average, machine_info, markdown, tabulate, write_report

DEFAULT_STRATEGIES = "ar,chain,fixed:16,fixed:32,fixed:64,bastion"
PROMPT_LOOKUP_TOKENS = 10
WARMUP_TOKENS = 8




@dataclass(frozen=True)
class PromptCase:
    category: str
    index: int       # position within its category
    text: str
    ids: list[int]   # encoded prompt (chat template applied by the CLI)


def read_prompts(path: Path, limit: int | None = None) -> dict[str, list[str]]:
    """{category: [prompt, ...]} from a JSON object; keys whose value is not a list are ignored."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchError(f"prompt file {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise BenchError(f"prompt file {path} is not valid JSON ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchError(f"cannot read prompt file {path} ({exc})") from None
    if not isinstance(data, dict):
        raise BenchError(f"prompt file {path} must hold a JSON object {{category: [prompt, ...]}}")
    suite = {}
    for category, prompts in data.items():
        if not isinstance(prompts, list):
            continue
        bad = [i for i, p in enumerate(prompts) if not isinstance(p, str) or not p.strip()]
        if bad:
            raise BenchError(f"prompt file {path}: {category}[{bad[0]}] is not a non-empty string")
        if prompts:
            suite[category] = prompts[:limit]
    if not suite:
        raise BenchError(f"prompt file {path} holds no prompts (expected {{category: [prompt, ...]}})")
    return suite


# --------------------------------------------------------------------- the suite
def run_suite(engine: Engine, cases: list[PromptCase], strategies: list[Strategy], max_new_tokens: int = 128,
              temperature: float = 0.0, repeats: int = 1, seed: int = 0, command: str = "",
              progress: bool = True, engine_b: Engine | None = None, profile: CostProfile | None = None) -> BenchOutput:
    """Run every strategy on every case (order in the module docstring) and tabulate the results;
    ``engine_b`` (on ``engine``'s target) runs the strategies named ``NAME@b``; ``profile`` sizes every
    engine strategy's trees with another host's costs and prices their rounds (bastion/costprofile.py)."""
    if not cases or strategies[0].name != "ar":
        raise ValueError("run_suite needs prompts and AR as the first strategy")
    if engine_b is not None and engine_b.target is not engine.target:
        raise ValueError("engine_b must decode with engine's target: one model serves every strategy")
    if engine_b is None and any(s.drafter_b for s in strategies):
        raise ValueError("strategies named NAME@b need engine_b")
    device = engine.target.device
    rows: list[dict] = []
    resettable = True

    def measure(case: PromptCase, s: Strategy, n: int, sink: list[dict], tag: dict) -> Run:
        nonlocal resettable
        resettable = reset_peak_memory(device) and resettable
        if s.kind == "hf":
            lookup = PROMPT_LOOKUP_TOKENS if s.name == "hf_prompt_lookup" else None
            run = run_hf(engine, case.ids, n, temperature, seed, lookup)
        else:
            cfg = replace(s.config(n, temperature, seed), cost_profile=profile)
            run = run_engine(engine_b if s.drafter_b else engine, case.ids, cfg, sink, tag)
        run.peak_rss_mb, run.peak_gpu_mb = peak_memory(device)
        return run

    machine = machine_info(device, engine.target.dtype)
    bar = tqdm(total=len(strategies) * (1 + len(cases) * repeats), file=sys.stderr, unit="run",
               disable=not progress, dynamic_ncols=True)
    for s in strategies:
        bar.set_description(f"warm-up {s.name}")
        measure(cases[0], s, min(WARMUP_TOKENS, max_new_tokens), [], {})
        bar.update()
    runs: dict[tuple[int, str], list[Run]] = {}
    for i, case in enumerate(cases):
        shift = i % len(strategies)
        for r in range(repeats):
            for s in strategies[shift:] + strategies[:shift]:
                bar.set_description(f"{case.category}[{case.index}] {s.name}")
                tag = {"strategy": s.name, "category": case.category, "prompt": case.index, "repeat": r}
                runs.setdefault((i, s.name), []).append(measure(case, s, max_new_tokens, rows, tag))
                bar.update()
    bar.close()
    _machine_after_run(machine, engine, engine_b, resettable)
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "repeats": repeats, "seed": seed,
                "warmup_tokens": WARMUP_TOKENS, "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
                "timing": "decode tokens/s, prefill excluded (generate(): streamer stamps after the first batch)"}
    if profile is not None:
        settings["cost_profile"] = profile.to_dict()
    return BenchOutput({"machine": machine, "command": command, "settings": settings,
                        **tabulate(cases, [s.name for s in strategies], runs)}, rows)


def _machine_after_run(machine: dict, engine: Engine, engine_b: Engine | None, resettable: bool) -> None:
    """What the run left to record about the machine: the load, the row padding and product paths the
    probes chose, and how peak memory was measured."""
    machine["load_average_end"] = load_average()
    # the row padding the engine measured during the warm-ups (None when no strategy drafted)
    machine["row_padding"] = engine.padding.to_dict() if engine.padding is not None else None
    # the row counts whose exact 4/8-bit products ran on the 512-bit path, as the last probe left them
    # (the mask is the kernel library's, shared by engine and engine_b; None: nothing was chosen)
    for key, q8 in (("wide_rows", False), ("wide_rows_q8", True)):
        wide = cpu_native.wide_rows(q8) if engine.wide_rows is not None else None
        machine[key] = None if wide is None else [r + 1 for r in range(16) if wide >> r & 1]
    machine["linear"] = linear_mode(engine.target.model)
    if engine.drafter is not None and isinstance(engine.drafter, torch.nn.Module):
        machine["drafter_linear"] = linear_mode(engine.drafter)
    if engine_b is not None:
        machine["row_padding_b"] = engine_b.padding.to_dict() if engine_b.padding is not None else None
        if isinstance(engine_b.drafter, torch.nn.Module):
            machine["drafter_linear_b"] = linear_mode(engine_b.drafter)
    machine["peak_memory"] = ("per run: VmHWM reset through /proc/self/clear_refs" if resettable
                              else "process lifetime peak (getrusage)")


# --------------------------------------------------------------------- command line
def add_parser(sub) -> None:
    from .loading import EVAL_PROMPTS

    b = sub.add_parser("bench", help="benchmark strategies on a prompt suite",
                       description="Run every strategy on every prompt, interleaved; write results.json, "
                                   "results.md, rounds.csv.gz and PNG plots.")
    b.add_argument("--prompts", type=Path, default=EVAL_PROMPTS, help="JSON {category: [prompt, ...]}")
    b.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated: ar, chain, fixed:N, bastion, bastion:always (draft gate off), "
                   "bastion:raw (uncalibrated surrogate), bastion:nolookup (no prompt-lookup branch), bastion:nods (no "
                   "datastore branch), bastion:nocond (no n-gram re-weighting of the tree's children), "
                   "bastion:drafter (the drafter's marginals alone), bastion:copies (no draft: prompt lookup and the datastore "
                   "alone), bastion:nodecost (the host's build + commit "
                   "time per tree node priced in the throughput rule), bastion:fulldepth (drafts the whole "
                   "block every round); "
                   "a bastion name ending in :minN grows at least N draft nodes a round, the gate off (the trees "
                   "of a host where verification is cheap); "
                   "a drafting name ending in :nopad verifies trees without row padding, one ending in @b "
                   "decodes with --drafter-b")
    b.add_argument("--hf-baselines", action="store_true",
                   help="add transformers' generate() greedy and prompt-lookup decoding")
    b.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per request (default 128)")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    b.add_argument("--seed", type=int, default=0, help="random stream of T > 0, the same for every strategy")
    b.add_argument("--repeats", type=int, default=1, help="runs of each strategy on each prompt")
    b.add_argument("--limit-per-category", type=int, default=None, help="first N prompts of each category")
    b.add_argument("--out", type=Path, default=None, help="output folder (default bench/out-DATE-TIME)")
    b.add_argument("--model", default="embedded", help="'embedded', a local HF folder or a hub id")
    b.add_argument("--drafter", default=None, help="DFlash drafter folder or hub id (default: the shipped one)")
    b.add_argument("--drafter-b", default=None,
                   help="a second drafter folder (its datastore beside it) for the strategies named NAME@b, "
                        "as in --strategies ar,bastion,bastion@b: an A/B of drafters within one run")
    b.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or float64")
    b.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when visible, else cpu)")
    b.add_argument("--kernels", default="auto", help="auto|torch|triton")
    b.add_argument("--linear", choices=("native", "native-f32", "fast", "stock"), default="native",
                   help="few-row CPU products for every strategy, the HF baselines included: native = the packed "
                        "kernel of kernels.cpu_native (torch's routines where it cannot be built), exact 4/8-bit "
                        "panels for weights that are losslessly Q4_1 / Q8_0 (the embedded model's); native-f32 = "
                        "the same on float32 panels only; fast = "
                        "torch's few-row routines (kernels.cpu_linear); stock = F.linear everywhere (ablations)")
    b.add_argument("--drafter-linear", choices=(*MODES, "auto"), default=None,
                   help="the drafter's products (default: auto with --linear native — the engine's probe times "
                        "native-bf16 and native-f32 drafts on this host and keeps the faster, a draft being only "
                        "a proposal — else --linear's)")
    b.add_argument("--drafter-linear-b", choices=(*MODES, "auto"), default=None,
                   help="the products of --drafter-b's drafter (default: --drafter-linear's): with the same "
                        "folder as --drafter, an A/B of the drafter's arithmetic within one run")
    b.add_argument("--cost-profile", default=None,
                   help="size every engine strategy's trees with another host's measured costs (a name under "
                        "bastion/profiles, e.g. h100-s43, or a file from `python -m bastion profile`) and report the "
                        "time that profile prices the rounds at beside the measured one (bastion/costprofile.py)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run_bench(a, engine: Engine | None = None, encode: Callable[[str], list[int]] | None = None,
              engine_b: Engine | None = None) -> int:
    """The ``bench`` subcommand. ``engine``, ``engine_b`` (for ``NAME@b``) and ``encode`` (prompt text →
    ids) may be injected (tests); otherwise the model named by ``a.model`` is loaded, after every input
    check has passed."""
    try:
        return _bench(a, engine, encode, engine_b)
    except BenchError as exc:  # handled here: under `python -m`, __main__'s UsageError is another class
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _bench(a, engine: Engine | None, encode: Callable[[str], list[int]] | None, engine_b: Engine | None) -> int:
    from .kernels import BACKENDS
    from .loading import DTYPES, encode_prompt

    strategies = parse_strategies(a.strategies, a.hf_baselines)
    for flag, value in (("--max-new-tokens", a.max_new_tokens), ("--repeats", a.repeats),
                        ("--limit-per-category", 1 if a.limit_per_category is None else a.limit_per_category)):
        if value < 1:
            raise BenchError(f"{flag} must be a positive integer, got {value}")
    if not math.isfinite(a.temperature):
        raise BenchError(f"--temperature must be a finite number, got {a.temperature}")
    for s in strategies:
        if s.kind != "hf":
            try:
                s.config(a.max_new_tokens, a.temperature, a.seed).validate()
            except ValueError as exc:
                raise BenchError(str(exc)) from None
    b_names = [s.name for s in strategies if s.drafter_b]
    if b_names and a.drafter_b is None and engine_b is None:
        raise BenchError(f"{', '.join(b_names)} run on a second drafter: pass --drafter-b DIR")
    if getattr(a, "drafter_linear_b", None) and a.drafter_b is None:
        raise BenchError("--drafter-linear-b sets the products of --drafter-b's drafter: pass --drafter-b DIR "
                         "(the same folder as --drafter for an A/B of the arithmetic alone)")
    if a.drafter_b is not None and not b_names:
        raise BenchError("--drafter-b is only read by strategies named NAME@b: add some, as in "
                         "--strategies ar,bastion,bastion@b")
    if a.dtype not in DTYPES:
        raise BenchError(f"unknown dtype {a.dtype!r}; choose one of {', '.join(DTYPES)}")
    if a.kernels not in BACKENDS:
        raise BenchError(f"unknown kernel backend {a.kernels!r}; choose one of {', '.join(BACKENDS)}")
    try:
        profile = load_profile(a.cost_profile) if getattr(a, "cost_profile", None) else None
    except (OSError, ValueError) as exc:
        raise BenchError(str(exc)) from None
    suite = read_prompts(a.prompts, a.limit_per_category)
    out_dir = a.out or Path("bench") / datetime.now().strftime("out-%Y%m%d-%H%M%S")
    if out_dir.exists() and not out_dir.is_dir():
        raise BenchError(f"--out {out_dir} exists and is not a folder")
    if engine is None:  # a drafter folder that is not there fails now, not after the target has loaded
        for name, flag in ((a.drafter, ""), (a.drafter_b, " --drafter-b")):
            try:
                precheck_local_drafter(name)
            except FileNotFoundError as exc:
                raise BenchError(f"cannot load{flag}: {exc}") from None

    engine = engine or _load_engine(a, strategies, DTYPES[a.dtype])
    if b_names and engine_b is None:
        engine_b = _load_engine_b(a, engine)
    encode = encode or (lambda text: encode_prompt(engine.target.tokenizer, text))
    cases = [PromptCase(c, i, text, list(encode(text))) for c, prompts in suite.items() for i, text in enumerate(prompts)]
    limit = engine.target.max_positions
    for case in cases:
        if len(case.ids) + a.max_new_tokens >= limit:
            raise BenchError(f"prompt {case.category}[{case.index}] has {len(case.ids)} tokens: with "
                             f"--max-new-tokens {a.max_new_tokens} it exceeds the model's context of {limit}")
    out = run_suite(engine, cases, strategies, a.max_new_tokens, a.temperature, a.repeats, a.seed,
                    _command(a, out_dir), progress=not a.no_progress, engine_b=engine_b, profile=profile)
    paths = write_report(out, out_dir)
    print(markdown(out.results, out.rounds))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def _load_engine(a, strategies: list[Strategy], dtype: torch.dtype) -> Engine:
    from .loading import load_target

    log = (lambda *x: print(*x, file=sys.stderr))
    try:
        target = load_target(a.model, dtype, a.device, progress=log, linear=a.linear)
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot load: {exc}") from None
    engine = _engine_on(a, target, a.drafter, "")
    needy = [s.name for s in strategies if s.kind not in ("ar", "hf") and not s.drafter_b]
    if engine.drafter is None and needy:
        raise BenchError(f"{', '.join(needy)} need a drafter: pass --drafter (or bench ar and the hf baselines only)")
    return engine


def _load_engine_b(a, engine: Engine) -> Engine:
    """The engine of ``--drafter-b`` on ``engine``'s target (each request captures its own drafter's
    feature layers: :meth:`Engine.generate`)."""
    return _engine_on(a, engine.target, a.drafter_b, " --drafter-b", getattr(a, "drafter_linear_b", None))


def _engine_on(a, target, drafter_name: str | None, flag: str, mode: str | None = None) -> Engine:
    """An engine on ``target`` with the named drafter (the shipped one for the embedded model when None)
    and the datastore stored beside it, the drafter's products in ``mode`` (default :func:`drafter_linear`'s)."""
    from .loading import load_default_datastore, load_default_drafter

    try:
        drafter = load_default_drafter(target, drafter_name, a.model)
        datastore = load_default_datastore(target, drafter_name, a.model) if drafter is not None else None
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot load{flag}: {exc}") from None
    if drafter is not None:
        set_drafter_products(drafter, mode or drafter_linear(a))
    return Engine(target, drafter, kernels=a.kernels, datastore=datastore)


def drafter_linear(a) -> str:
    """The drafter's linear mode: ``--drafter-linear``, else ``auto`` (the probe's choice of bf16 or
    float32 panels, :func:`probe.tune_drafter_products`) with ``--linear native`` and ``--linear``'s
    own mode otherwise (ablations keep the drafter alike)."""
    if getattr(a, "drafter_linear", None):
        return a.drafter_linear
    return "auto" if a.linear.startswith("native") else a.linear


def _command(a, out_dir: Path) -> str:
    """The command line that reproduces this run, every setting spelled out."""
    argv = ["python", "-m", "bastion", "bench", "--prompts", shown_path(a.prompts), "--strategies", a.strategies,
            "--max-new-tokens", str(a.max_new_tokens), "--temperature", str(a.temperature), "--seed", str(a.seed),
            "--repeats", str(a.repeats), "--model", a.model, "--dtype", a.dtype, "--kernels", a.kernels,
            "--linear", a.linear, "--drafter-linear", drafter_linear(a)]
    for flag, value in (("--limit-per-category", a.limit_per_category), ("--drafter", a.drafter),
                        ("--drafter-b", a.drafter_b), ("--drafter-linear-b", getattr(a, "drafter_linear_b", None)),
                        ("--device", a.device), ("--cost-profile", getattr(a, "cost_profile", None))):
        if value is not None:
            argv += [flag, str(value)]
    if a.hf_baselines:
        argv.append("--hf-baselines")
    return shlex.join(argv + ["--out", str(out_dir)])
