"""Pure figure builders: JSON step records (see app.engine_glue) in, plotly figures or HTML out.

Nothing here touches a model, gradio or session state, so any round of a live, stopped or imported
run redraws the same way. Sizes n count tree nodes including the root, as in C(n) and S_n.
"""

from __future__ import annotations

import html
import math
import textwrap

import plotly.graph_objects as go
from plotly.subplots import make_subplots

COLORS = {"accepted": "#2a9d8f", "rejected": "#adb5bd", "bonus": "#e76f51", "root": "#264653",
          "predicted": "#457b9d", "measured": "#e63946", "ar": "#8d99ae", "main": "#2a9d8f",
          "draft": "#8ecae6", "build": "#ffb703", "verify": "#219ebc", "commit": "#fb8500"}
STAGES = ("draft", "build", "verify", "commit")
FONT = dict(family="Inter, system-ui, sans-serif", size=12)


def _base_layout(fig: go.Figure, title: str, height: int, legend_y: float = -0.2) -> go.Figure:
    # legends go under the plot: above it they collide with titles and subplot titles
    fig.update_layout(title=dict(text=title, font=dict(size=14)), height=height, font=FONT,
                      margin=dict(l=55, r=25, t=60, b=40), template="plotly_white",
                      legend=dict(orientation="h", yanchor="top", y=legend_y, x=0, font=dict(size=11)))
    return fig


def empty_figure(message: str, height: int = 320) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font=dict(size=14, color="#6c757d"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _base_layout(fig, "", height)


def token_label(text: str, limit: int = 10) -> str:
    """A short visible form of a token: line breaks and blanks made visible, long tokens cut."""
    shown = text.replace("\n", "⏎").replace("\t", "⇥")
    if not shown.strip():
        shown = "␣" * max(1, min(len(shown), 3))
    return shown if len(shown) <= limit else shown[:limit - 1] + "…"


def _text(step: dict, token: int) -> str:
    return step.get("texts", {}).get(str(token), str(token))


# ----------------------------------------------------------------------------- draft tree
def tree_layout(parents: list[int]) -> tuple[list[int], list[float]]:
    """Tidy layout: x = depth; leaves get consecutive rows in depth-first (pop) order and a parent
    sits midway between its first and last child, so same-depth nodes are always >= 1 row apart."""
    n = len(parents)
    kids: list[list[int]] = [[] for _ in range(n)]
    depth = [0] * n
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
            depth[i] = depth[p] + 1
    rows = [0.0] * n
    next_row = 0
    stack = [(0, False)] if n else []
    while stack:  # iterative post-order: children are placed before their parent
        node, done = stack.pop()
        if not kids[node]:
            rows[node], next_row = float(next_row), next_row + 1
        elif done:
            rows[node] = (rows[kids[node][0]] + rows[kids[node][-1]]) / 2
        else:
            stack.append((node, True))
            stack.extend((k, False) for k in reversed(kids[node]))
    return depth, rows


def node_status(step: dict) -> list[str]:
    """'accepted' / 'rejected' per tree node, plus a trailing 'bonus' node when the bonus was committed."""
    n = len(step["tree"]["tokens"])
    accepted = set(step["accepted"])
    status = ["accepted" if i in accepted else "rejected" for i in range(n)]
    if len(step["tokens"]) == len(step["accepted"]):  # not cut by a stop token or the length limit
        status.append("bonus")
    return status


def _hover(step: dict, i: int, status: str) -> str:
    tree = step["tree"]
    if status == "bonus":
        return (f"<b>{html.escape(repr(_text(step, step['bonus'])))}</b> (id {step['bonus']})<br>"
                "bonus token: the target's own choice after the accepted path")
    choice = step["choices"][i] if i < len(step.get("choices", [])) else None
    rank = tree.get("ranks", [0] * (i + 1))[i] if i > 0 else 0
    source = (f"prompt lookup: copied from earlier context, rate r = {tree['marginals'][i]:.3g}" if rank == -1
              else f"datastore: what the model wrote after these words elsewhere, rate r = {tree['marginals'][i]:.3g}"
              if rank == -2 else f"drafter q = {tree['marginals'][i]:.3g}"
              + (" (re-weighted for this parent by the datastore's n-grams)" if step.get("conditioned") else ""))
    lines = [f"<b>{html.escape(repr(_text(step, tree['tokens'][i])))}</b> (id {tree['tokens'][i]})",
             f"depth {tree['depths'][i]} · pop order {i}",
             f"{source} · path P (calibrated) = {tree['path_probs'][i]:.3g}"]
    if choice is not None:
        lines.append(f"target chose here: {html.escape(repr(_text(step, choice)))}")
    lines.append(status)
    return "<br>".join(lines)


def tree_figure(step: dict) -> go.Figure:
    """The round's draft tree, depth left to right; bold edges mark the accepted path."""
    tree = step["tree"]
    status = node_status(step)
    parents = list(tree["parents"]) + ([step["accepted"][-1]] if status[-1] == "bonus" else [])
    depth, rows = tree_layout(parents)
    probs = list(tree["path_probs"]) + ([1.0] if status[-1] == "bonus" else [])
    labels = [token_label(_text(step, t)) for t in tree["tokens"]] + \
             ([token_label(_text(step, step["bonus"]))] if status[-1] == "bonus" else [])
    fig = go.Figure()
    for kind, width, dash, color in (("rejected", 1, "solid", COLORS["rejected"]),
                                     ("accepted", 4, "solid", COLORS["accepted"]),
                                     ("bonus", 3, "dot", COLORS["bonus"])):
        xs, ys = [], []
        for i in range(1, len(parents)):
            if status[i] == kind:
                xs += [depth[parents[i]], depth[i], None]
                ys += [-rows[parents[i]], -rows[i], None]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(width=width, color=color, dash=dash),
                                 hoverinfo="skip", showlegend=False))
    leaves = max(rows) + 1 if rows else 1
    small = leaves > 40
    # a label right of a node would sit on the edges to its children: internal nodes get theirs above
    inner = {p for p in parents if p >= 0}
    ranks = list(tree.get("ranks", [])) + [0] * (len(parents) - len(tree.get("ranks", [])))
    for kind in ("rejected", "accepted", "bonus"):
        idx = [i for i, s in enumerate(status) if s == kind]
        if not idx:
            continue
        fig.add_trace(go.Scatter(
            x=[depth[i] for i in idx], y=[-rows[i] for i in idx], mode="markers+text", name=kind,
            text=[labels[i] for i in idx],
            textposition=["top center" if i in inner else "middle right" for i in idx],
            textfont=dict(size=9 if small else 11, color="#212529"),
            marker=dict(size=[7 + 18 * math.sqrt(probs[i]) for i in idx], color=COLORS[kind],
                        opacity=[0.9 if kind != "rejected" else 0.45 + 0.55 * probs[i] for i in idx],
                        line=dict(width=1, color="#343a40"),
                        # squares: nodes proposed by prompt lookup or the datastore, not by the drafter
                        symbol=["diamond" if kind == "bonus" else "square" if ranks[i] < 0 else "circle"
                                for i in idx]),
            hovertext=[_hover(step, i, kind) for i in idx], hoverinfo="text"))
    n_acc = len(step["accepted"]) - 1
    n_look = sum(1 for r in ranks[1:len(tree["tokens"])] if r < 0)
    title = (f"Round {step['index']}: tree of {len(tree['tokens'])} nodes, {n_acc} accepted"
             f"{' + bonus' if status[-1] == 'bonus' else ''} ({step['strategy']})"
             + (f"<br><sup>squares: {n_look} nodes from prompt lookup or the datastore</sup>" if n_look else "")
             + (f"<br><sup>verified as {step['rows']} rows: padding to a cheaper row count</sup>"
                if step.get("rows", 0) > len(tree["tokens"]) else ""))
    fig.update_xaxes(title="depth", dtick=1, range=[-0.4, max(depth) + 1.2], zeroline=False)
    fig.update_yaxes(visible=False, range=[-leaves + 0.3, 0.7])
    fig = _base_layout(fig, title, int(min(1100, max(360, 60 + 18 * leaves))))
    fig.update_layout(legend=dict(y=1.0, yanchor="bottom", x=1.0, xanchor="right"))
    return fig


# ----------------------------------------------------------------------------- gain vs cost
def gain_cost_points(step: dict) -> dict:
    """Per tree size n in pop order: S_n, predicted C(n), predicted throughput, and whether the rule took it.

    The root (n = 1, S = 1) comes first; a strategy without a decision trace (chain) uses the tree's
    cumulative path confidences and the recorded C(1..n).
    """
    overhead = float(step.get("overhead_s") or step.get("round_overhead_s") or 0.0)
    rows = []
    if step.get("root_cost_s") is not None:
        rows.append((1, 1.0, float(step["root_cost_s"]), True))
    lookup = []
    if step.get("trace"):
        rows += [(d["node"] + 1, d["expected"], d["cost"], d["added"]) for d in step["trace"]
                 if d.get("source", "draft") == "draft"]
        lookup = [(d["node"] + 1, d["expected"], d["cost"], d["added"]) for d in step["trace"]
                  if d.get("source", "draft") != "draft"]  # prompt lookup and the datastore
    elif step.get("cost_curve"):
        total = 0.0
        rows = []
        for k, (p, c) in enumerate(zip(step["tree"]["path_probs"], step["cost_curve"])):
            total += p
            rows.append((k + 1, total, c, True))
    n, s, c, added = (list(col) for col in zip(*rows)) if rows else ([], [], [], [])
    thr = [si / (overhead + ci) if overhead + ci > 0 else 0.0 for si, ci in zip(s, c)]
    return {"n": n, "S": s, "C": c, "throughput": thr, "added": added, "overhead": overhead,
            "lookup": {"n": [r[0] for r in lookup], "S": [r[1] for r in lookup], "C": [r[2] for r in lookup],
                       "added": [r[3] for r in lookup]}}


def gain_cost_figure(step: dict, title: str | None = None) -> go.Figure:
    """S_n and predicted throughput (top), predicted C(n) (bottom); a line where the tree stopped.
    ``step["cost_label"]`` names the cost curve where it is not plain C(n) (a measured host's re-plan
    prices v(n) + b·n: verification plus that host's per-node build and commit time)."""
    pts = gain_cost_points(step)
    cost_name = step.get("cost_label", "predicted C(n)")
    cost_sym = cost_name.removeprefix("predicted ")
    if not pts["n"]:
        return empty_figure("no size decisions in this round")
    chosen = len(step["tree"]["tokens"])
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.58, 0.42], vertical_spacing=0.06,
                        specs=[[{"secondary_y": True}], [{}]])
    sym = ["circle" if a else "circle-open" for a in pts["added"]]
    fig.add_trace(go.Scatter(x=pts["n"], y=pts["S"], name="S_n expected tokens (open: not taken)", mode="lines+markers",
                             marker=dict(symbol=sym, size=6), line=dict(color=COLORS["accepted"])), row=1, col=1)
    fig.add_trace(go.Scatter(x=pts["n"], y=pts["throughput"], name=f"predicted tok/s = S_n/(T+{cost_sym})",
                             mode="lines", line=dict(color=COLORS["predicted"], dash="dot")),
                  row=1, col=1, secondary_y=True)
    fig.add_trace(go.Scatter(x=pts["n"], y=[1e3 * c for c in pts["C"]], name=cost_name, mode="lines+markers",
                             marker=dict(symbol=sym, size=5), line=dict(color=COLORS["predicted"])), row=2, col=1)
    if pts["lookup"]["n"]:  # the prompt-lookup branch, sized after the drafter's tree by the same rule
        lk = pts["lookup"]
        lsym = ["square" if a else "square-open" for a in lk["added"]]
        fig.add_trace(go.Scatter(x=lk["n"], y=lk["S"], name="S_n with copied nodes (lookup, datastore)", mode="lines+markers",
                                 marker=dict(symbol=lsym, size=7), line=dict(color=COLORS["bonus"])), row=1, col=1)
        fig.add_trace(go.Scatter(x=lk["n"], y=[1e3 * c for c in lk["C"]], name=f"{cost_sym} with copied nodes",
                                 mode="lines+markers", marker=dict(symbol=lsym, size=6), line=dict(color=COLORS["bonus"]),
                                 showlegend=False), row=2, col=1)
    if step.get("tokens"):
        fig.add_trace(go.Scatter(x=[chosen], y=[len(step["tokens"])], name="committed (actual)", mode="markers",
                                 marker=dict(symbol="star", size=15, color=COLORS["measured"])), row=1, col=1)
    if step.get("measured_verify_s"):
        fig.add_trace(go.Scatter(x=[chosen], y=[1e3 * step["measured_verify_s"]], name="measured verify",
                                 mode="markers", marker=dict(symbol="diamond", size=12, color=COLORS["measured"])),
                      row=2, col=1)
    fig.add_vline(x=chosen, line=dict(color=COLORS["bonus"], width=2, dash="dash"))
    rows = int(step.get("rows") or chosen)  # row padding: C(n) is the cost of the cheaper row count it runs as
    fig.add_annotation(text=f"stop: n = {chosen}" + (f", verified as {rows} rows" if rows > chosen else ""), x=chosen, y=1.0, xref="x", yref="paper", yanchor="bottom",
                       showarrow=False, font=dict(size=11, color=COLORS["bonus"]),
                       xanchor="left" if chosen < max(pts["n"]) * 0.6 else "right")
    fig.update_yaxes(title_text="tokens", row=1, col=1, secondary_y=False)
    fig.update_yaxes(title_text="tok/s", row=1, col=1, secondary_y=True, showgrid=False)
    fig.update_yaxes(title_text="ms", row=2, col=1)
    fig.update_xaxes(title_text="tree size n (pop order, root included)", row=2, col=1)
    title = title or f"Round {step['index']}: gain vs cost"
    reason = "<br>".join(textwrap.wrap(html.escape(step.get("stop_reason", "")), 70)[:2])
    title += f" (T = {1e3 * pts['overhead']:.3g} ms)<br><sup>{reason}</sup>"
    fig = _base_layout(fig, title, 470)
    fig.update_layout(margin=dict(t=80), legend=dict(y=-0.16))
    return fig


# ----------------------------------------------------------------------------- speed against AR
def _rate_series(records: list[dict]) -> tuple[list[float], list[float]]:
    """(decode seconds, cumulative tokens/s) after every round."""
    xs, ys, total = [], [], 0
    for r in records:
        total += len(r["tokens"])
        t = float(r.get("clock_s", r.get("elapsed_s", 0.0)))
        if t > 0:
            xs.append(t)
            ys.append(total / t)
    return xs, ys


def _ms_per_token(records: list[dict]) -> list[float]:
    tokens = max(1, sum(len(r["tokens"]) for r in records))
    return [1e3 * sum(r["times"][k] for r in records) / tokens for k in STAGES]


def _speed_title(baseline: list[dict], steps: list[dict]) -> str:
    if baseline and steps:
        ar, main = _rate_series(baseline)[1], _rate_series(steps)[1]
        if ar and main and ar[-1] > 0:
            tau = sum(len(r["tokens"]) for r in steps) / len(steps)
            # two short lines: one long line was cut off in a phone-wide plot
            return (f"speedup {main[-1] / ar[-1]:.2f}×, τ = {tau:.2f}<br><sup>{steps[0]['strategy']} "
                    f"{main[-1]:.1f} tok/s vs AR {ar[-1]:.1f} tok/s</sup>")
    return "tokens/s so far (decode)"


def _runs(baseline: list[dict], steps: list[dict]) -> list[tuple[str, list[dict]]]:
    named = (("AR baseline", baseline), (steps[0]["strategy"] if steps else "", steps))
    return [(name, recs) for name, recs in named if recs]


# Each of the speed and latency panels is a figure of its own: the page puts two figures of a row side
# by side and stacks them on a phone-wide screen, while two subplots of one figure stay side by side
# and their titles ran into each other there (session 48's 420-px screenshots).
def speed_figure(baseline: list[dict], steps: list[dict]) -> go.Figure:
    """Cumulative decode tokens/s of the AR baseline and of the chosen strategy after every round;
    the title states the final speedup and the strategy's τ (tokens per target forward)."""
    if not baseline and not steps:
        return empty_figure("run a prompt to measure speed")
    fig = go.Figure()
    for name, recs in _runs(baseline, steps):
        xs, ys = _rate_series(recs)
        color = COLORS["ar"] if recs is baseline else COLORS["main"]
        fig.add_trace(go.Scatter(x=xs, y=ys, name=name, mode="lines", line=dict(color=color, width=3)))
    fig.update_xaxes(title_text="decode time (s)")
    fig.update_yaxes(title_text="tokens/s so far")
    return _base_layout(fig, _speed_title(baseline, steps), 340)


def stages_figure(baseline: list[dict], steps: list[dict]) -> go.Figure:
    """Milliseconds per generated token of each run, split into the round's stages (stacked bars)."""
    runs = _runs(baseline, steps)
    if not runs:
        return empty_figure("run a prompt to see where the time goes")
    fig = go.Figure()
    for k, stage in enumerate(STAGES):
        fig.add_trace(go.Bar(y=[name for name, _ in runs], x=[_ms_per_token(recs)[k] for _, recs in runs],
                             name=stage, orientation="h", marker_color=COLORS[stage]))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="ms / token")
    fig.update_yaxes(automargin=True)
    # the legend lower than elsewhere: at -0.2 it overlapped this figure's axis title
    return _base_layout(fig, "ms per token by stage", 340, legend_y=-0.3)


# ----------------------------------------------------------------------------- latency model
def latency_figure(steps: list[dict], index: int) -> go.Figure:
    """Predicted (before the round, by the calibrated model) against measured verification time per
    round; a dotted line marks round ``index``."""
    rounds = [r["index"] for r in steps]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=rounds, y=[1e3 * r["predicted_verify_s"] for r in steps], name="predicted",
                             mode="lines+markers", marker=dict(size=4), line=dict(color=COLORS["predicted"])))
    fig.add_trace(go.Scatter(x=rounds, y=[1e3 * r["measured_verify_s"] for r in steps], name="measured",
                             mode="lines+markers", marker=dict(size=4), line=dict(color=COLORS["measured"])))
    fig.add_vline(x=index, line=dict(color="#6c757d", dash="dot"))
    fig.update_xaxes(title_text="round")
    fig.update_yaxes(title_text="verify ms")
    return _base_layout(fig, "Verify time: predicted vs measured", 380)


def cost_figure(steps: list[dict], index: int, curves: dict[str, tuple[list, list]]) -> go.Figure:
    """C(n), the predicted verification time of an n-node tree, at round ``index``'s context for each
    device in ``curves`` ({name: (sizes, seconds)}), with every round's measured (size, time) point."""
    fig = go.Figure()
    dashes = iter(("solid", "dash", "dot", "dashdot"))
    for name, (ns, secs) in curves.items():
        fig.add_trace(go.Scatter(x=ns, y=[1e3 * s for s in secs], name=name, mode="lines",
                                 line=dict(dash=next(dashes, "solid"), width=2)))
    fig.add_trace(go.Scatter(x=[len(r["tree"]["tokens"]) for r in steps],
                             y=[1e3 * r["measured_verify_s"] for r in steps], name="measured (all rounds)", mode="markers",
                             marker=dict(color=COLORS["measured"], size=6, opacity=0.5)))
    fig.update_xaxes(title_text="tree size n")
    # 1-2-5 ticks: plotly's own log ticks crowded the axis with small digits once one stalled
    # verification stretched the range past a decade
    ticks = [m * 10 ** e for e in range(-1, 4) for m in (1, 2, 5)]
    fig.update_yaxes(title_text="ms (log)", type="log", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])
    return _base_layout(fig, f"C(n) at round {index}'s context", 380)


# ----------------------------------------------------------------------------- calibration
_GROUP_COLORS = ("#264653", "#2a9d8f", "#e9c46a", "#f4a261", "#e76f51", "#6d597a")


def calibration_figure(cal: dict | None) -> go.Figure:
    """Reliability of the drafter's confidences under the run's acceptance rule.

    ``cal`` as from Runtime.calibration: points {depths_from, q, rate, count} per depth group and bin,
    ``qs`` and per group the fitted g(q) the tree builder multiplies (bastion/calibration.py), and
    ``path_scale`` κ, the correction of their products (optional).
    """
    if not cal or not cal.get("points"):
        return empty_figure("no calibration data yet (run a drafting strategy)")
    groups = [int(g) for g in cal["curves"]]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="calibrated drafter (g = q)",
                             line=dict(color="#adb5bd", dash="dash")))
    for k, first in enumerate(groups):
        last = groups[k + 1] - 1 if k + 1 < len(groups) else None
        label = f"depth {first}" if last == first else f"depth {first}–{last}" if last else f"depth ≥ {first}"
        color = _GROUP_COLORS[k % len(_GROUP_COLORS)]
        pts = [p for p in cal["points"] if p["depths_from"] == first]
        if not pts:
            continue
        fig.add_trace(go.Scatter(
            x=[p["q"] for p in pts], y=[p["rate"] for p in pts], mode="markers", name=f"{label}: observed",
            legendgroup=label, marker=dict(color=color, size=[6 + 5 * math.log10(1 + p["count"]) for p in pts],
                                           opacity=0.7),
            hovertext=[f"{label}<br>mean q {p['q']:.2f} → accepted {p['rate']:.0%} of {p['count']:.0f} tested"
                       for p in pts], hoverinfo="text"))
        fig.add_trace(go.Scatter(x=cal["qs"], y=cal["curves"][str(first)], mode="lines", name=f"{label}: fitted g(q)",
                                 legendgroup=label, line=dict(color=color, width=2)))
    # T > 0: the tree ranks the drafter's q mixed with the target's own noise (bastion/coupling.py)
    fig.update_xaxes(title_text="coupled confidence ½ q + ½ softmax(log q / T + G)" if cal.get("coupled")
                     else "drafter confidence q", range=[0, 1.02])
    fig.update_yaxes(title_text="P(accepted | parent accepted)", range=[0, 1.02])
    title = (f"Drafter calibration at T = {cal.get('temperature', 0):g}: below the diagonal the drafter is "
             "overconfident; trees are ranked by the fitted g(q)")
    if cal.get("path_scale") is not None:  # older exported runs lack it
        title += f", every path's P × κ = {cal['path_scale']:.2f}"
    return _base_layout(fig, title, 460)


# ----------------------------------------------------------------------------- text
_SPAN = {"acc": "background:#d8f3dc;border-bottom:2px solid #2a9d8f;",
         "bonus": "background:#ffe8d6;border-bottom:2px solid #e76f51;"}


def tokens_html(steps: list[dict], selected: int | None = None, sep: str = "") -> str:
    """The generated text, one span per token coloured by how it came; hover shows the round."""
    out = []
    for s in steps:
        n_acc = len(s["accepted"]) - 1
        spans = []
        for j, text in enumerate(s["token_texts"]):
            kind = "acc" if j < n_acc else "bonus"
            what = "accepted draft token" if kind == "acc" else "bonus token (target's own)"
            spans.append(f'<span class="tok {kind}" style="{_SPAN[kind]}" title="round {s["index"]} · {what}">'
                         f'{html.escape(text)}</span>')
        ring = "outline:2px solid #264653;" if s["index"] == selected else ""
        out.append(f'<span class="round" data-round="{s["index"]}" style="margin-right:1px;{ring}">'
                   f'{"".join(spans)}</span>')
    legend = (f'<div style="font-size:12px;color:#6c757d;margin-bottom:6px"><span style="{_SPAN["acc"]}">'
              f'accepted draft</span> <span style="{_SPAN["bonus"]}">bonus (target)</span> · hover a token for '
              f'its round{" · outlined: the round shown below" if selected is not None else ""}</div>')
    body = sep.join(out) if out else '<span style="color:#adb5bd">the output appears here</span>'
    return (f'<div class="bastion-text">{legend}<div style="white-space:pre-wrap;line-height:1.7;'
            f'font-size:15px">{body}</div></div>')
