"""The benchmark's report: results.json, results.md (README-ready tables), rounds.csv.gz and PNG plots.

Pure functions of a :class:`BenchOutput` (what :func:`bastion.bench.run_suite` returns), so a report
can be redrawn from a saved results.json without rerunning anything.
"""

from __future__ import annotations

import csv
import gzip
import json
import lzma
import os
import platform
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .bench import PromptCase

STAGES = ("draft", "build", "verify", "commit")


@dataclass
class Run:
    """One generation of one prompt by one strategy."""

    token_ids: list[int]
    rounds: int                  # target forwards: engine rounds, or generate()'s token batches
    decode_tokens: int           # tokens the decode time covers
    decode_s: float
    nodes: int | None = None     # Σ tree sizes, root included (engine only)
    stage_s: dict | None = None  # seconds per stage (engine only)
    errors: list[float] = field(default_factory=list)  # latency-model relative errors, rounds ≥ 10
    peak_rss_mb: float = 0.0
    peak_gpu_mb: float | None = None
    modeled_s: float | None = None  # the decode time a cost profile prices the rounds at (engine, --cost-profile)



def tabulate(cases: list[PromptCase], names: list[str], runs: dict[tuple[int, str], list[Run]]) -> dict:
    """results.json's strategies / categories / prompts sections from every run of every (case, strategy)."""
    speedup, match, prompts, modeled = {}, {}, [], {}
    for i, case in enumerate(cases):
        ref, ar_rate = runs[i, "ar"][0].token_ids, _rate(runs[i, "ar"])
        ar_modeled = _modeled_rate(runs[i, "ar"])
        entry = {"category": case.category, "index": case.index, "prompt": case.text,
                 "prompt_tokens": len(case.ids), "strategies": {}}
        for name in names:
            rs = runs[i, name]
            speedup[i, name] = _rate(rs) / ar_rate if ar_rate > 0 else None
            match[i, name] = all(r.token_ids == ref for r in rs)
            rate = _modeled_rate(rs)
            modeled[i, name] = rate / ar_modeled if rate is not None and ar_modeled else None
            stats = _pool(rs, [speedup[i, name]], [match[i, name]], [modeled[i, name]])
            stats["first_mismatch"] = next((_first_mismatch(r.token_ids, ref) for r in rs if r.token_ids != ref), None)
            stats["tokens_per_s_runs"] = [round(_rate([r]), 3) for r in rs]
            entry["strategies"][name] = stats
        prompts.append(entry)

    def group(idx: list[int]) -> dict:
        return {n: _pool([r for i in idx for r in runs[i, n]], [speedup[i, n] for i in idx], [match[i, n] for i in idx],
                         [modeled[i, n] for i in idx]) for n in names}

    categories = {c: group([i for i, x in enumerate(cases) if x.category == c])
                  for c in dict.fromkeys(x.category for x in cases)}
    return {"strategies": group(list(range(len(cases)))), "categories": categories, "prompts": prompts}


def _first_mismatch(ids: list[int], ref: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(ids, ref)) if x != y), min(len(ids), len(ref)))


def _rate(runs: list[Run]) -> float:
    seconds = sum(r.decode_s for r in runs)
    return sum(r.decode_tokens for r in runs) / seconds if seconds > 0 else 0.0


def _modeled_rate(runs: list[Run]) -> float | None:
    """Tokens per modeled second (a cost profile's price of the rounds); None unless every run has one."""
    if not runs or any(r.modeled_s is None for r in runs):
        return None
    seconds = sum(r.modeled_s for r in runs)
    return sum(r.decode_tokens for r in runs) / seconds if seconds > 0 else None


def _pool(runs: list[Run], speedups: list[float | None], matches: list[bool],
          modeled: list[float | None] | None = None) -> dict:
    """Statistics of a group of runs (definitions in bastion.bench's module docstring); with a cost
    profile, also the modeled tokens/s and the mean over prompts of the modeled rate ÷ AR's."""
    tokens, rounds = sum(len(r.token_ids) for r in runs), sum(r.rounds for r in runs)
    decode_s = sum(r.decode_s for r in runs)
    speedups = [s for s in speedups if s is not None]
    errors = [e for r in runs for e in r.errors]
    engine = all(r.stage_s is not None for r in runs)
    time_s = None
    if engine:
        time_s = {k: sum(r.stage_s[k] for r in runs) for k in STAGES}
        time_s["other"] = max(0.0, decode_s - sum(time_s.values()))  # loop, Step records, token texts
    gpu = [r.peak_gpu_mb for r in runs if r.peak_gpu_mb is not None]
    return {
        "tokens_per_s": _round(_rate(runs)), "speedup_vs_ar": _round(statistics.fmean(speedups) if speedups else None),
        "tau": _round(tokens / rounds if rounds else None), "match_ar": _round(statistics.fmean(matches)),
        "mean_tree_size": _round(sum(r.nodes for r in runs) / rounds if engine and rounds else None),
        "time_s": {k: _round(v, 6) for k, v in time_s.items()} if time_s else None,
        "time_fraction": {k: _round(v / decode_s) for k, v in time_s.items()} if time_s and decode_s > 0 else None,
        "latency_error": _round(statistics.median(errors) if errors else None),
        "peak_rss_mb": _round(max(r.peak_rss_mb for r in runs), 1), "peak_gpu_mb": _round(max(gpu), 1) if gpu else None,
        "tokens": tokens, "rounds": rounds, "decode_s": _round(decode_s, 6), "runs": len(runs),
    } | _modeled_stats(runs, modeled or [])


def _modeled_stats(runs: list[Run], modeled: list[float | None]) -> dict:
    rate, ratios = _modeled_rate(runs), [m for m in modeled if m is not None]
    if rate is None:
        return {}
    return {"modeled_tokens_per_s": _round(rate), "modeled_speedup_vs_ar": _round(statistics.fmean(ratios) if ratios else None)}


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


@dataclass
class BenchOutput:
    results: dict      # what results.json holds
    rounds: list[dict]  # one row per verified tree (engine strategies): rounds.csv.gz and the latency scatter


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine_info(device: torch.device, dtype: torch.dtype) -> dict:
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "device": str(device), "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "load_average_start": load_average()}


# --------------------------------------------------------------------- report
ROUND_FIELDS = ["strategy", "category", "prompt", "repeat", "round", "tree_size", "rows", "context", "tokens",
                "predicted_s", "measured_s", "threads", "overhead_s", "draft_s", "host_s"]


def write_report(out: BenchOutput, folder: Path) -> list[Path]:
    """results.json, results.md, rounds.csv.gz and the PNG plots in ``folder``; returns their paths.

    The per-round log is gzipped CSV (``pandas.read_csv`` and ``gzip.open(path, "rt")`` read it) with
    times in seconds to 0.1 µs: a 30-prompt run's ~30,000 rounds take ~170 KB instead of ~950 KB —
    result folders are kept in the repository, and a GPU call carries the whole working tree in 64 MiB."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "results.json", folder / "results.md", folder / "rounds.csv.gz"]
    paths[0].write_text(json.dumps(out.results, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(out.results, out.rounds), encoding="utf-8")
    with gzip.open(paths[2], "wt", newline="", compresslevel=9) as fh:
        writer = csv.DictWriter(fh, ROUND_FIELDS)
        writer.writeheader()
        writer.writerows({k: f"{v:.7f}" if isinstance(v, float) else v for k, v in r.items()} for r in out.rounds)
    return paths + plot_report(out, folder)


ROUND_INTS = frozenset({"prompt", "repeat", "round", "tree_size", "rows", "context", "tokens", "threads"})


def _open_text(path: Path, **kw):
    """``path`` opened for reading text, decompressed by its suffix (.gz, .xz) — older folders keep
    their results.json gzipped and their per-round log as xz (bench/NOTES.md)."""
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(path.suffix, open)
    return opener(path, "rt", **kw)


def read_rounds(path: Path) -> list[dict]:
    """rounds.csv.gz — or an archived folder's rounds.csv.xz — back as the dicts :func:`write_report`
    wrote (ints and floats restored)."""
    with _open_text(path, newline="") as fh:
        return [{k: v if k in ("strategy", "category") else int(v) if k in ROUND_INTS else float(v)
                 for k, v in row.items()} for row in csv.DictReader(fh)]


def redraw(folder: Path) -> list[Path]:
    """results.md and the PNG plots drawn again from a saved run's results.json and rounds.csv.gz (a newer
    report layout over an older run): nothing is rerun and the two data files are left as they are.
    The text is composed before anything is written (a folder that does not read changes nothing) and
    results.md is replaced only once the plots are drawn."""
    source = next((p for p in (folder / "results.json", folder / "results.json.gz") if p.is_file()), None)
    if source is None:  # older folders keep theirs gzipped (bench/NOTES.md)
        raise FileNotFoundError(f"{folder / 'results.json'} does not exist: not a benchmark folder")
    try:
        with _open_text(source, encoding="utf-8") as fh:
            results = json.load(fh)
        # older folders keep their per-round log as xz, a third smaller than gzip (bench/NOTES.md)
        log = next((p for p in (folder / "rounds.csv.gz", folder / "rounds.csv.xz") if p.is_file()), None)
        out = BenchOutput(results, read_rounds(log) if log else [])
        text = markdown(results, out.rounds)
    except (ValueError, KeyError, TypeError, OSError, EOFError) as exc:
        raise ValueError(f"{folder} holds no readable benchmark results ({type(exc).__name__}: {exc})") from None
    md = folder / "results.md"
    tmp = md.with_name(".results.md.tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        paths = plot_report(out, folder)
    except BaseException:
        tmp.unlink()
        raise
    os.replace(tmp, md)
    return [md, *paths]


def _cell(x, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown(results: dict, rounds: list[dict] | None = None) -> str:
    """A README-ready summary: settings, one row per strategy, speedup and τ per category, where an engine
    round's milliseconds go, Bastion against the chain and the best fixed budget, and — given the
    per-round log — the median verification time per row count."""
    m, s, groups = results["machine"], results["settings"], results["categories"]
    per_category = [p["category"] for p in results["prompts"]]
    counts = ", ".join(f"{c} {per_category.count(c)}" for c in groups)
    lines = [f"### Benchmark {m['date'][:10]}", "",
             f"- Machine: {m['gpu'] or m['cpu']}, {m['cores']} cores, {m['device']} {m['dtype']}, "
             f"torch {m['torch']}, transformers {m['transformers']}",
             f"- Command: `{results['command']}`",
             f"- Prompts: {len(results['prompts'])} ({counts}); max_new_tokens {s['max_new_tokens']}, "
             f"temperature {s['temperature']}, repeats {s['repeats']}; decode tokens/s, prefill excluded", "",
             "| strategy | tok/s | speedup vs AR | τ | mean tree | match AR | draft / build / verify / commit / other "
             "| latency err | peak RSS MiB |", "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for name, st in results["strategies"].items():
        frac = st["time_fraction"]
        split = " / ".join(f"{100 * frac[k]:.0f}%" for k in (*STAGES, "other")) if frac else "–"
        lines.append(f"| {name} | {st['tokens_per_s']:.1f} | {_cell(st['speedup_vs_ar'], '{:.2f}×')} | "
                     f"{_cell(st['tau'])} | {_cell(st['mean_tree_size'], '{:.1f}')} | {st['match_ar']:.0%} | "
                     f"{split} | {_cell(st['latency_error'], '{:.0%}')} | {st['peak_rss_mb']:.0f} |")
    lines += ["", "Speedup vs AR by category (mean over prompts of the tokens/s ratio):", "",
              "| strategy | " + " | ".join(groups) + " | all |", "|---|" + "---:|" * (len(groups) + 1)]
    for name, st in results["strategies"].items():
        cells = [_cell(g[name]["speedup_vs_ar"], "{:.2f}×") for g in groups.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_cell(st['speedup_vs_ar'], '{:.2f}×')} |")
    lines += ["", "τ by category (tokens per target forward):", "",
              "| strategy | " + " | ".join(groups) + " | all |", "|---|" + "---:|" * (len(groups) + 1)]
    for name, st in results["strategies"].items():
        cells = [_cell(g[name]["tau"]) for g in groups.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_cell(st['tau'])} |")
    if s["temperature"] > 0 and any(n.startswith("hf_") for n in results["strategies"]):
        lines += ["", "At T > 0 the hf_* baselines sample from transformers' own random stream: "
                      "their match with AR is not expected."]
    lines += _anatomy(results["strategies"]) + _versus(results["strategies"]) + _modeled_table(results)
    if rounds:
        lines += _rows_table(verify_by_rows(rounds))
    return "\n".join(lines) + "\n"


def _anatomy(strategies: dict) -> list[str]:
    """Milliseconds per round (one target forward) by stage: the split the main table gives in percent."""
    engine = {n: st for n, st in strategies.items() if st.get("time_s") and st.get("rounds") and st.get("decode_s")}
    if not engine:
        return []
    lines = ["", "Where a round goes (ms per round, one target forward each):", "",
             "| strategy | round | draft | build | verify | commit | other |", "|---|" + "---:|" * 6]
    for name, st in engine.items():
        ms = {k: 1e3 * v / st["rounds"] for k, v in st["time_s"].items()}
        lines.append(f"| {name} | {1e3 * st['decode_s'] / st['rounds']:.2f} | "
                     + " | ".join(f"{ms[k]:.2f}" for k in (*STAGES, "other")) + " |")
    return lines


def _modeled_table(results: dict) -> list[str]:
    """With ``--cost-profile``: each strategy's rounds priced by the profile (bastion/costprofile.py)."""
    profile = results["settings"].get("cost_profile")
    rows = {n: st for n, st in results["strategies"].items() if "modeled_tokens_per_s" in st}
    if not profile or not rows:
        return []
    lines = ["", f"Trees sized with the cost profile `{profile['name']}` ({profile.get('source', '')}); the τ and trees "
             "above are what its rule accepted here; the time below is the profile's price of each recorded round, a model, "
             "not a measurement:", "", "| strategy | modeled tok/s | modeled speedup vs AR | τ | mean tree |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {n} | {st['modeled_tokens_per_s']:.1f} | {_cell(st['modeled_speedup_vs_ar'], '{:.2f}×')} | "
              f"{_cell(st['tau'])} | {_cell(st['mean_tree_size'], '{:.1f}')} |" for n, st in rows.items()]
    return lines


def _versus(strategies: dict) -> list[str]:
    """Bastion's mean per-prompt speedup over AR divided by the chain's and by the best fixed budget's."""
    def speed(name: str) -> float | None:
        return strategies.get(name, {}).get("speedup_vs_ar")

    fixed = [n for n in strategies if n.startswith("fixed:") and speed(n)]
    if not speed("bastion") or not (speed("chain") or fixed):
        return []
    parts = [f"by the chain's, {speed('bastion') / speed('chain'):.2f}×"] if speed("chain") else []
    if fixed:
        best = max(fixed, key=speed)
        parts.append(f"by the best fixed budget's (`{best}`, {speed(best):.2f}× AR), {speed('bastion') / speed(best):.2f}×")
    return ["", "Bastion's mean speedup over AR divided " + "; ".join(parts) + "."]


def verify_by_rows(rounds: list[dict], least: int = 10) -> dict[int, dict]:
    """Per verified row count (padding included) with at least ``least`` rounds, pooled over strategies
    (a forward's cost depends on its rows, not on who drafted them): rounds, median measured and median
    predicted verification ms."""
    groups: dict[int, list[dict]] = {}
    for r in rounds:
        groups.setdefault(int(r["rows"]), []).append(r)
    return {n: {"rounds": len(g), "measured_ms": 1e3 * statistics.median(float(r["measured_s"]) for r in g),
                "predicted_ms": 1e3 * statistics.median(float(r["predicted_s"]) for r in g)}
            for n, g in sorted(groups.items()) if len(g) >= least}


def _rows_table(by_rows: dict[int, dict]) -> list[str]:
    if not by_rows:
        return []
    lines = ["", "Verification time by rows (every round with that many rows, all strategies; medians):", "",
             "| rows | rounds | measured ms | predicted ms |", "|---:|---:|---:|---:|"]
    lines += [f"| {n} | {v['rounds']} | {v['measured_ms']:.2f} | {v['predicted_ms']:.2f} |" for n, v in by_rows.items()]
    return lines


def plot_report(out: BenchOutput, folder: Path) -> list[Path]:
    """Three PNGs: speedup by category; τ vs mean tree size; predicted vs measured verify time."""
    from matplotlib import colormaps

    res = out.results
    color = {n: colormaps["tab10"](i % 10) for i, n in enumerate(res["strategies"])}
    title = f"{res['machine']['gpu'] or res['machine']['cpu']} · {res['machine']['date'][:10]}"
    paths = [folder / "speedup_by_category.png", folder / "tau_vs_tree_size.png", folder / "verify_latency.png"]
    _plot_speedup(res, color, title).savefig(paths[0], dpi=120)
    _plot_tau_vs_size(res, color, title).savefig(paths[1], dpi=120)
    _plot_latency(out, color, title).savefig(paths[2], dpi=120)
    return paths


def _plot_speedup(res: dict, color: dict, title: str):
    """Bars: each strategy's decode speedup over AR per category and over all prompts."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    groups = {**res["categories"], "all prompts": res["strategies"]}
    shown = [n for n in res["strategies"] if n != "ar"]
    width = 0.8 / max(1, len(shown))
    for j, n in enumerate(shown):
        ys = [g[n]["speedup_vs_ar"] or 0.0 for g in groups.values()]
        bars = ax.bar([k + (j - (len(shown) - 1) / 2) * width for k in range(len(groups))], ys, width, label=n,
                      color=color[n])
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2, rotation=90 if len(shown) > 3 else 0)
    ax.axhline(1.0, color="black", lw=1, ls="--", label="ar")
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel("decode speedup vs AR (×)")
    ax.set_title(f"Speedup by category — {title}", fontsize=10)
    ax.legend(fontsize=8, ncols=min(4, len(shown) + 1), loc="upper left")
    ax.set_ylim(0, max([1.3] + [1.3 * (g[n]["speedup_vs_ar"] or 0) for g in groups.values() for n in shown]))
    return fig


def _plot_tau_vs_size(res: dict, color: dict, title: str):
    """Scatter: τ against mean tree size, per strategy (large) and per category (small)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for n, st in res["strategies"].items():
        if st["mean_tree_size"] is None:
            continue
        cats = [g[n] for g in res["categories"].values()]
        ax.scatter([c["mean_tree_size"] for c in cats], [c["tau"] for c in cats], s=15, alpha=0.5, color=color[n])
        ax.scatter([st["mean_tree_size"]], [st["tau"]], s=60, color=color[n], edgecolors="black", label=n)
        ax.annotate(n, (st["mean_tree_size"], st["tau"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("mean tree size (nodes verified per round, root included)")
    ax.set_ylabel("τ (tokens per round)")
    ax.set_title(f"Acceptance vs tree size (large: all prompts, small: categories)\n{title}", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def _plot_latency(out: BenchOutput, color: dict, title: str):
    """Scatter, log-log: the latency model's predicted verification time against the measured one,
    every round of every engine strategy, with the diagonal."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 5.5), layout="constrained")
    ax = fig.add_subplot()
    for n in out.results["strategies"]:
        pts = [(r["predicted_s"] * 1e3, r["measured_s"] * 1e3) for r in out.rounds if r["strategy"] == n]
        if pts:
            err = out.results["strategies"][n]["latency_error"]
            ax.scatter(*zip(*pts), s=6, alpha=0.4, color=color[n], label=f"{n} (median err {_cell(err, '{:.0%}')})")
    values = [v for r in out.rounds for v in (r["predicted_s"], r["measured_s"]) if v > 0]
    if values:
        lo, hi = min(values) * 1e3 / 1.2, max(values) * 1e3 * 1.2
        ax.plot([lo, hi], [lo, hi], color="black", lw=1, ls="--", label="predicted = measured")
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("predicted verify time (ms)")
    ax.set_ylabel("measured verify time (ms)")
    ax.set_title(f"Latency model, every round (error: rounds ≥ 10)\n{title}", fontsize=10)
    ax.legend(fontsize=7, markerscale=2)
    return fig
