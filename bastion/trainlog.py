"""A drafter's training log: the logs of a lineage of checkpoint folders, and their loss/accuracy plot.

``python -m bastion.train plot --ckpt RUN1 [--ckpt RUN2 ...] --out loss.png`` draws it.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_logs(ckpts: list[Path]) -> tuple[list[dict], list[int]]:
    """The logs of several checkpoint folders (a drafter's lineage: each run warm-started from the
    previous one's export), concatenated with steps renumbered; returns (log, steps where a run begins)."""
    log, starts = [], []
    for folder in ckpts:
        path = folder / "log.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        part = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        offset = log[-1]["step"] if log else 0
        if log:
            starts.append(offset)
        log += [{**x, "step": x["step"] + offset} for x in part]
    return log, starts


def plot_log(log: list[dict], path: Path, smooth: int = 25, starts: list[int] = ()) -> None:
    """Loss and per-depth accuracy curves (moving averages) as a PNG; dotted lines where a run began."""
    import matplotlib
    from matplotlib.figure import Figure

    matplotlib.use("Agg")
    steps = [x["step"] for x in log]

    def avg(vals):
        out, acc = [], 0.0
        for i, v in enumerate(vals):
            acc += v - (vals[i - smooth] if i >= smooth else 0.0)
            out.append(acc / min(i + 1, smooth))
        return out

    fig = Figure(figsize=(9, 3.6), dpi=110)
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(steps, avg([x["loss"] for x in log]), color="tab:blue")
    ax1.set(xlabel="step", ylabel="weighted block cross-entropy", title="training loss", yscale="log")
    for k in (0, 1, 3, 7):
        if len(log[-1]["acc"]) > k:
            ax2.plot(steps, avg([x["acc"][k] if len(x["acc"]) > k else float("nan") for x in log]), label=f"depth {k + 1}")
    ax2.plot(steps, avg([x["chain_len"] for x in log]), color="black", ls="--", label="accepted chain length")
    ax2.set(xlabel="step", ylabel="top-1 accuracy / tokens", title="per-depth accuracy (teacher forced)")
    ax2.legend(fontsize=8)
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))  # long lineages: step labels must not collide
        for x in starts:
            ax.axvline(x, color="gray", ls=":", lw=1)
    fig.tight_layout()
    fig.savefig(path)
