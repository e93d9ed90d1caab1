"""Event handlers: generators for model work, plain functions for redraws from session state.

Every handler returns or yields a :class:`View`; ``View.values()`` lists the outputs in the order
``ui.py`` wires them (:data:`VIEW_FIELDS`), and untouched outputs are ``gr.skip()``. Nothing is
kept between calls except the run dict the session passes in and out (``gr.State``).
"""

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import gradio as gr

from bastion.config import STRATEGIES, GenerationConfig
from bastion.engine import TOPK_RECORDED

from . import figures
from .engine_glue import THIS_MACHINE, Runtime, cost_curves, measured_hosts, replan
from .state import export_run, load_run, new_run, reusable_baseline, run_summary, text_of

log = logging.getLogger(__name__)
# Streaming text refresh. Figures are drawn once a run ends, never while it is timed: on a 2-core
# machine the browser's drawing of them competes with the model, and redrawing them once a second cut
# Bastion's measured speed in the page by ~45% (session 48: 1.15-1.47x AR against 2.03-2.23x without,
# the same code prompt four times each in headless Chromium; 2.0-2.2x through the API, no browser).
TEXT_EVERY_S = 0.25
STRATEGY_NAMES = {"bastion": "Bastion", "chain": "DFlash chain", "fixed": "Fixed tree", "ar": "AR"}


@dataclass
class View:
    """One update of the page; a field left at gr.skip() leaves that component as it is."""

    text: Any = field(default_factory=gr.skip)
    stats: Any = field(default_factory=gr.skip)
    message: Any = field(default_factory=gr.skip)
    tree: Any = field(default_factory=gr.skip)
    gain: Any = field(default_factory=gr.skip)
    speed: Any = field(default_factory=gr.skip)
    stages: Any = field(default_factory=gr.skip)
    latency: Any = field(default_factory=gr.skip)
    cost: Any = field(default_factory=gr.skip)
    whatif: Any = field(default_factory=gr.skip)
    whatif_md: Any = field(default_factory=gr.skip)
    calibration: Any = field(default_factory=gr.skip)
    scrubber: Any = field(default_factory=gr.skip)
    state: Any = field(default_factory=gr.skip)

    def values(self) -> list:
        return [getattr(self, name) for name in VIEW_FIELDS]


VIEW_FIELDS = tuple(f.name for f in dataclasses.fields(View))


def error_box(message: str) -> str:
    return f"⚠️ **{message}**" if message else ""


def warn(message: str) -> str:
    """A short toast plus the same text for the page's message box (toasts alone are easy to miss)."""
    gr.Warning(message, duration=6)
    return error_box(message)


def _int(value, name: str, lo: int, hi: int) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not number.is_integer() or not lo <= number <= hi:
        raise ValueError(f"{name} must be a whole number from {lo} to {hi}, got {value!r}")
    return int(number)


def _float(value, name: str, lo: float, hi: float, open_low: bool = False) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if math.isnan(number) or number > hi or number < lo or (open_low and number <= lo):
        raise ValueError(f"{name} must be in {'(' if open_low else '['}{lo}, {hi}], got {value!r}")
    return number


def parse_settings(runtime: Runtime, prompt, strategy, budget, temperature, top_p, max_new_tokens,
                   seed) -> tuple[dict, GenerationConfig]:
    """Check what the user (or an API caller) sent; every problem is a ValueError with a plain message."""
    lim = runtime.limits
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("Please enter a prompt.")
    if len(prompt) > lim.max_prompt_chars:
        raise ValueError(f"The prompt has {len(prompt)} characters; the limit is {lim.max_prompt_chars}.")
    if strategy == "auto":
        strategy = "bastion" if runtime.refresh_drafter() else "ar"
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}.")
    if strategy != "ar" and not runtime.refresh_drafter():
        raise ValueError("No drafter is loaded (assets/drafter-smollm2-135m is absent), so only AR can run. "
                         + runtime.drafter_error)
    settings = {"strategy": strategy, "budget": _int(budget, "budget", 1, lim.max_nodes),
                "temperature": _float(temperature, "temperature", 0.0, lim.max_temperature),
                "top_p": _float(top_p, "top-p", 0.0, 1.0, open_low=True),
                "max_new_tokens": _int(max_new_tokens, "max new tokens", 1, lim.max_new_tokens),
                "seed": _int(seed, "seed", 0, 2**31 - 1), "max_nodes": lim.max_nodes, "min_nodes": 0, "lookahead": 8}
    cfg = GenerationConfig(strategy=strategy, max_new_tokens=settings["max_new_tokens"],
                           temperature=settings["temperature"],
                           top_p=settings["top_p"] if settings["top_p"] < 1.0 else None, seed=settings["seed"],
                           budget=settings["budget"], max_nodes=lim.max_nodes)
    return settings, cfg


def start_run(runtime: Runtime, prompt: str, settings: dict) -> tuple[dict, list[int]]:
    """A fresh run dict and the prompt's token ids (the length check needs the tokenizer)."""
    ids = runtime.encode(prompt)
    if len(ids) > runtime.limits.max_prompt_tokens:
        raise ValueError(f"The prompt is {len(ids)} tokens long; the limit is {runtime.limits.max_prompt_tokens}.")
    return new_run(prompt, len(ids), settings, runtime.model_info()), ids


def execute(runtime: Runtime, run: dict, ids: list[int], cfg: GenerationConfig, baseline: bool,
            previous: dict | None = None) -> Iterator[tuple[str, dict]]:
    """Measure AR on the same prompt and settings (or reuse this session's identical measurement),
    then run the chosen strategy; yields (phase, record) and appends each record to ``run``."""
    if baseline and cfg.strategy != "ar":
        run["baseline"] = reusable_baseline(previous, run)
        if run["baseline"]:
            run["message"] = "AR baseline reused: this session measured it for the same prompt and settings."
        for rec in ([] if run["baseline"] else runtime.stream(ids, dataclasses.replace(cfg, strategy="ar"))):
            run["baseline"].append(rec)
            yield "baseline", rec
    for rec in runtime.stream(ids, cfg):
        run["steps"].append(rec)
        yield "main", rec
    if cfg.strategy != "ar":
        run["calibration"] = runtime.calibration(cfg)
    run["status"] = "finished"


# ----------------------------------------------------------------------------- rendering
def _records(run: dict | None) -> list[dict]:
    return (run["steps"] or run["baseline"]) if run else []


def _sep(run: dict) -> str:
    return "" if run["model"].get("has_tokenizer", True) else " "


def _row(name: str, s: dict) -> str:
    err = "–" if s["latency_error"] is None else f"{100 * s['latency_error']:.0f}%"
    return (f"| {name} | {s['tokens']} | {s['rounds']} | {s['tau']:.2f} | **{s['tokens_per_s']:.1f}** | "
            f"{s['decode_s']:.2f} | {s['mean_tree_size']:.1f} | {err} |")


def stats_markdown(run: dict | None) -> str:
    """The measured numbers of both runs, the speedup, and the lossless check at T = 0."""
    if not run:
        return ""
    summary = run_summary(run)
    lines = ["| run | tokens | rounds | τ | tok/s | decode s | mean tree | C(n) error |",
             "|---|---|---|---|---|---|---|---|"]
    if summary["baseline"]:
        lines.append(_row("AR baseline", summary["baseline"]))
    if summary["main"]:
        lines.append(_row(STRATEGY_NAMES.get(summary["main"]["strategy"], "?"), summary["main"]))
    notes = [f"**status:** {run['status']}" + (f" ({_records(run)[-1].get('finish_reason')})"
                                                if _records(run) and _records(run)[-1].get("finish_reason") else "")]
    if summary["speedup"] is not None:
        notes.append(f"**measured speedup vs AR: {summary['speedup']:.2f}×** (same prompt, settings and machine)")
    if summary["identical_to_ar"] is not None:
        notes.append("✅ output identical to AR token for token (T = 0: lossless)" if summary["identical_to_ar"]
                     else "❌ output differs from AR at T = 0")
    shed = threads_note(run)
    if shed:
        notes.append(shed)
    if run.get("message"):
        notes.append(run["message"])
    return "\n".join(lines) + "\n\n" + " · ".join(notes)


def threads_note(run: dict) -> str:
    """'' unless some rounds ran on fewer CPU threads than others: the engine sheds threads while
    another process holds a core (bastion/threads.py), which changes what both runs measured."""
    counts = [r.get("threads", 0) for phase in ("baseline", "steps") for r in run[phase]]
    counts = [c for c in counts if c > 0]
    if not counts or min(counts) == max(counts):
        return ""
    fewer = sum(c < max(counts) for c in counts)
    return (f"⚠ {fewer} of {len(counts)} rounds ran on {min(counts)} instead of {max(counts)} CPU threads: another "
            "process held a core, and the engine sheds threads while verifications stall")


_TOPK_CAVEAT = (f" _(Runs record the drafter's top {TOPK_RECORDED} per depth and this round's tree used a lower "
                f"rank, so even on this machine the replay can differ from what ran.)_")
_CONDITIONED_CAVEAT = (" _(The re-plan gives every node of a depth the same candidates; the engine also re-weighted "
                       "each node's children by the datastore's n-grams, so even on this machine its tree can differ.)_")


def whatif_markdown(rec: dict, plan: dict | None, device: str) -> str:
    if plan is None:
        return ("_What-if re-planning needs the drafter's marginals; this round has none (an AR round, or a "
                "Bastion round whose draft the gate skipped)._")
    here = f"here it verified **{len(rec['tree']['tokens'])}** nodes (S = {rec['expected_tokens']:.2f})"
    measured = measured_hosts().get(device)
    where = ("this machine's calibrated model" if device == THIS_MACHINE else
             f"the costs measured on {measured.source} (T_d + a + b·n + v(n), bastion/costprofile.py)" if measured else
             f"the {device} roofline (bf16, α = 1)")
    return (f"Round {rec['index']} re-planned under {where}, T = {1e3 * plan['overhead_s']:.3g} ms: Bastion would "
            f"verify **{len(plan['tree']['tokens'])}** nodes (S = {plan['expected_tokens']:.2f} expected tokens, "
            f"predicted {plan.get('cost_label', 'C(n)').removeprefix('predicted ')} = "
            f"{1e3 * plan['predicted_verify_s']:.3g} ms); {here}, strategy {rec['strategy']}. "
            f"Stop: {plan['stop_reason']}." + (_TOPK_CAVEAT if max(rec["tree"]["ranks"]) >= TOPK_RECORDED else "")
            + (_CONDITIONED_CAVEAT if rec.get("conditioned") else ""))


def round_view(run: dict, index: int, device: str) -> View:
    """Everything that depends on the selected round: tree, gain/cost, latency panel, what-if, text outline."""
    records = _records(run)
    index = max(0, min(int(index), len(records) - 1))
    rec = records[index]
    plan = replan(rec, run["model"], device, run["settings"])
    max_n = max([len(r["tree"]["tokens"]) for r in records] + [len(plan["tree"]["tokens"]) if plan else 1] + [16])
    wf = (figures.gain_cost_figure(plan, f"What-if on {device}: round {index}") if plan
          else figures.empty_figure("no draft in this round (AR, or draft skipped)"))
    return View(text=figures.tokens_html(records, index, _sep(run)), tree=figures.tree_figure(rec),
                gain=figures.gain_cost_figure(rec),
                latency=figures.latency_figure(records, index),
                cost=figures.cost_figure(records, index, cost_curves(rec, run["model"], device, max_n)),
                whatif=wf, whatif_md=whatif_markdown(rec, plan, device))


def full_view(run: dict, device: str, index: int | None = None) -> View:
    records = _records(run)
    index = len(records) - 1 if index is None else index
    view = round_view(run, index, device)
    view.speed = figures.speed_figure(run["baseline"], run["steps"])
    view.stages = figures.stages_figure(run["baseline"], run["steps"])
    view.calibration = figures.calibration_figure(run.get("calibration"))
    view.stats = stats_markdown(run)
    view.scrubber = gr.Slider(minimum=0, maximum=max(1, len(records) - 1), value=index, interactive=len(records) > 1,
                              label=f"Round (0–{len(records) - 1}; redraws from session state, no model run)")
    view.state = run
    return view


def live_view(run: dict, phase: str) -> View:
    """A cheap update while the model runs: the text so far and the progress line, no figures (a
    browser drawing them on the same CPU slows the run being measured; see TEXT_EVERY_S)."""
    records = run[phase if phase == "baseline" else "steps"]
    s = run_summary(run)["baseline" if phase == "baseline" else "main"]
    label = "① measuring the AR baseline (same prompt and settings)" if phase == "baseline" else \
        f"{'②' if run['baseline'] else ''} running {STRATEGY_NAMES[run['settings']['strategy']]}"
    view = View(text=figures.tokens_html(records, None, _sep(run)), state=run,
                stats=f"**{label}…** {s['tokens']} tokens in {s['rounds']} rounds, τ = {s['tau']:.2f}, "
                      f"{s['tokens_per_s']:.1f} tok/s")
    return view


def stopped_view(run: dict, device: str) -> View:
    """The page after Stop: the rounds so far stay browsable and exportable; the next Run starts afresh."""
    if not _records(run):
        return View(stats="stopped before the first round", message="", state=run)
    view = full_view(run, device)
    view.message = "Stopped. The rounds so far can be browsed and exported."
    return view


def _blank(message: str = "") -> View:
    empty = figures.empty_figure
    return View(text=figures.tokens_html([]), stats="", message=error_box(message), tree=empty("draft tree"),
                gain=empty("gain vs cost"), speed=empty("speed against AR"), stages=empty("time per stage"),
                latency=empty("latency model"), cost=empty("C(n)"), whatif=empty("what-if hardware"), whatif_md="",
                calibration=empty("drafter calibration"))


# ----------------------------------------------------------------------------- handlers
class Handlers:
    """The callbacks of one app, bound to the process-wide Runtime; all session data comes in as arguments."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def banner(self) -> str:
        """Model, device and drafter status (checked on every page load, so a new drafter shows up)."""
        rt = self.runtime
        if rt.refresh_drafter():
            drafter = f"DFlash drafter loaded (block size {rt.engine.drafter.block_size}): all strategies run."
        else:
            drafter = ("**No drafter found** (assets/drafter-smollm2-135m): only AR runs for now; the drafter is "
                       "picked up automatically once it is there. " + rt.drafter_error)
        return f"**Model:** {rt.describe()} · {drafter}"

    def on_load(self) -> tuple[str, str]:
        """Banner and default strategy for a new page: Bastion once a drafter is there, AR before."""
        banner = self.banner()
        return banner, "bastion" if self.runtime.has_drafter else "ar"

    def run(self, prompt, strategy, budget, temperature, top_p, max_new_tokens, seed, baseline, device,
            state) -> Iterator[list]:
        """Stream a run into the page: AR baseline first (unless off), then the chosen strategy."""
        try:
            settings, cfg = parse_settings(self.runtime, prompt, strategy, budget, temperature, top_p,
                                           max_new_tokens, seed)
            run, ids = start_run(self.runtime, prompt, settings)
        except ValueError as exc:
            yield View(message=warn(str(exc))).values()
            return
        yield dataclasses.replace(_blank(), state=run).values()
        last_text = 0.0
        try:
            for phase, rec in execute(self.runtime, run, ids, cfg, bool(baseline), state):
                if run["status"] != "running":  # Stop was pressed: the final view is drawn here, by the
                    yield stopped_view(run, device).values()  # one writer of the page (no race with Stop)
                    return
                now = time.perf_counter()
                if now - last_text >= TEXT_EVERY_S and not rec["finished"]:
                    yield live_view(run, phase).values()
                    last_text = now
        except (ValueError, RuntimeError) as exc:
            run["status"], run["message"] = "failed", f"generation stopped: {exc}"
        except Exception as exc:  # the handler boundary: the page gets a message, the log the traceback
            log.exception("generation failed")
            run["status"], run["message"] = "failed", f"generation failed ({exc.__class__.__name__}: {exc})"
        failed = warn(run["message"]) if run["status"] == "failed" else ""
        if not _records(run):
            yield View(message=failed, state=run).values()
            return
        view = full_view(run, device)
        view.message = failed
        yield view.values()

    def show_round(self, state, index, device) -> list:
        """Redraw a finished round from session state (scrubber, what-if selector): no model involved."""
        if not _records(state):
            return View().values()
        try:
            return round_view(state, index, device).values()
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            return View(message=warn(f"cannot draw round {index}: {exc}")).values()

    def stopped(self, state) -> list:
        """Stop: flag the running run; its generator draws the final view at its next round and ends.

        Nothing is drawn here: a view sent from this handler could reach the page before a live update
        the generator already had on its way, and the page would say "running" after a stop."""
        if isinstance(state, dict) and state.get("status") == "running":
            state["status"] = "stopped"
        return View().values()

    def export(self, state):
        """Write the session's run to a JSON file and show it for download."""
        if not _records(state):
            warn("Nothing to export yet: run a prompt first.")
            return gr.File(visible=False)
        return gr.File(export_run(state), visible=True)

    def load(self, path, device) -> list:
        """Replay an exported run without the model; a bad file leaves the session as it was."""
        if not path:
            return View().values()
        try:
            run = load_run(path)
            view = full_view(run, device)
        except ValueError as exc:
            return View(message=warn(f"Cannot load this file: {exc}")).values()
        except (KeyError, TypeError, IndexError, AttributeError) as exc:  # valid shape, inconsistent content
            return View(message=warn(f"Cannot replay this file: {exc.__class__.__name__}: {exc}")).values()
        view.message = (f"Replaying a run from {run.get('created', '?')} ({run['model'].get('name', '?')}): "
                        "no model runs.")
        return view.values()

    def generate(self, prompt: str, strategy: str = "auto", max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, budget: int = 32, baseline: bool = False) -> Iterator[dict]:
        """Generate with speculative decoding and stream one JSON record per round.

        Yields {"event": "step", "phase": "baseline"|"main", "text": text so far, "step": step record} per
        round, then {"event": "done", "text": final text, "stats": measured summary}. strategy: auto (bastion
        when a drafter is loaded, else ar), bastion, chain, fixed or ar; baseline: measure AR first.
        """
        try:
            settings, cfg = parse_settings(self.runtime, prompt, strategy, budget, temperature, top_p,
                                           max_new_tokens, seed)
            run, ids = start_run(self.runtime, prompt, settings)
            for phase, rec in execute(self.runtime, run, ids, cfg, bool(baseline)):
                yield {"event": "step", "phase": phase, "text": text_of(run[phase if phase == "baseline" else "steps"],
                                                                        _sep(run)), "step": rec}
        except (ValueError, RuntimeError) as exc:
            raise gr.Error(str(exc)) from None
        yield {"event": "done", "text": text_of(run["steps"], _sep(run)), "stats": run_summary(run),
               "prompt_tokens": run["prompt_tokens"], "settings": run["settings"]}
