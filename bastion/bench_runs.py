"""One measured run of the benchmark and what it records about the machine: a strategy through the
engine, transformers' own ``generate`` (the ``hf_*`` baselines, timed by a streamer), the peak memory
of a run, and what the linear layers run on."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers.generation import BaseStreamer

from .engine import Engine, GenerationConfig
from .kernels.cpu_linear import SkinnyLinear, exact_products
from .report import Run


def run_engine(engine: Engine, ids: list[int], cfg: GenerationConfig, rows: list[dict], tag: dict) -> Run:
    """One run of ``cfg`` on the prompt ids through the engine: its :class:`Run`, and one row per round
    (tree size, rows, context, tokens, predicted and measured verify time, threads, the T = T_d + T_o
    its decisions used, and its measured draft and host — build + commit — times) appended to ``rows``
    under ``tag`` — the benchmark's per-round log, ``rounds.csv.gz``."""
    steps = list(engine.generate(ids, cfg))
    res = engine.summarize(steps, len(ids))
    rows.extend(dict(tag, round=s.index, tree_size=len(s.tree), rows=s.rows, context=s.context_len, tokens=len(s.tokens),
                     predicted_s=s.predicted_verify_s, measured_s=s.measured_verify_s, threads=s.threads,
                     overhead_s=s.round_overhead_s, draft_s=s.times.draft, host_s=s.times.build + s.times.commit)
                for s in steps)
    errors = [abs(s.predicted_verify_s - s.measured_verify_s) / s.measured_verify_s
              for s in steps[10:] if s.measured_verify_s > 0]
    modeled = cfg.cost_profile.modeled_s(steps) if cfg.cost_profile is not None else None
    return Run(res.token_ids, res.steps, len(res.token_ids), res.decode_s, sum(len(s.tree) for s in steps),
               dict(res.stage_s), errors, modeled_s=modeled)


class _TokenClock(BaseStreamer):
    """Stamps each batch generate() streams: the prompt first, then one batch per target forward."""

    def __init__(self):
        self.marks: list[tuple[float, int]] = []

    def put(self, value):
        self.marks.append((time.perf_counter(), int(value.numel())))  # value is on the host: synchronised

    def end(self):
        pass


@contextmanager
def _feature_hooks_off(engine: Engine):
    """generate() should not pay for the hooks that capture the drafter's context features."""
    layers = list(engine.drafter.cfg.target_layer_ids) if engine.drafter is not None else []
    engine.target.set_feature_layers([])
    try:
        yield
    finally:
        engine.target.set_feature_layers(layers)


def run_hf(engine: Engine, ids: list[int], max_new_tokens: int, temperature: float, seed: int,
           lookup_tokens: int | None = None) -> Run:
    """transformers' own generate(): greedy (or plain sampling at T > 0), or prompt-lookup decoding
    proposing ``lookup_tokens`` tokens a step when that is set."""
    stop = sorted(engine.stop_ids)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, eos_token_id=stop or None,
              pad_token_id=stop[0] if stop else 0)
    if temperature > 0:
        kw.update(temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    if lookup_tokens:
        kw["prompt_lookup_num_tokens"] = lookup_tokens
    x = torch.tensor([ids], dtype=torch.long, device=engine.target.device)
    clock = _TokenClock()
    with _feature_hooks_off(engine), torch.inference_mode():
        out = engine.target.model.generate(x, attention_mask=torch.ones_like(x), streamer=clock, **kw)
    batches = clock.marks[1:]
    return Run(out[0, len(ids):].tolist(), len(batches), sum(n for _, n in batches[1:]),
               batches[-1][0] - batches[0][0])


def reset_peak_memory(device: torch.device) -> bool:
    """Reset the peak-memory marks; False where the RSS peak cannot be reset (not Linux)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # "5": reset the resident-set high-water mark
        return True
    except OSError:
        return False


def peak_memory(device: torch.device) -> tuple[float, float | None]:
    """(peak RSS MiB, peak CUDA memory allocated MiB or None)."""
    gpu = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024, gpu
    except OSError:
        pass
    import resource  # POSIX only; ru_maxrss is KiB on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 1024), gpu


def shown_path(path) -> str:
    """``path`` as a recorded command shows it: relative to the working directory when inside it (the
    default prompt file is the package's absolute path, which names one machine's folders)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def linear_mode(model: torch.nn.Module) -> str:
    """What the model's linear layers run on, for the machine record (a drafter's with the probe's
    timings when it chose them: :func:`probe.tune_drafter_products`)."""
    probe = getattr(model, "products_probe", None)
    how = _linear_mode(model)
    if probe and getattr(model, "tune_products", False):
        ms = ", ".join(f"{m} {t * 1e3:.2f} ms" for m, t in probe.items())
        how += f"; chosen by the engine's probe (median draft: {ms})"
    return how


def _linear_mode(model: torch.nn.Module) -> str:
    from .kernels import cpu_native

    layers = [m for m in model.modules() if isinstance(m, SkinnyLinear)]
    if not layers:
        return "stock: F.linear"
    if any(m.native for m in layers) and cpu_native.available():
        if any(m.low_precision for m in layers):
            how = "bf16 products" if cpu_native.bf16_available() else "bf16 weights widened to float32"
            return f"native-bf16: packed few-row kernel, {how} (kernels.cpu_native)"
        if not any(m.native and m.compress for m in layers):
            return "native-f32: packed few-row kernel, float32 panels (kernels.cpu_native)"
        exact = exact_products(model)
        return (f"native: packed few-row kernel, {exact} of {len(layers)} matrices in exact 4/8-bit panels "
                "(kernels.cpu_native)")
    why = cpu_native.unavailable_reason()
    return "fast: kernels.cpu_linear for few-row CPU fp32 products" + (f" (native unavailable: {why})" if why else "")
