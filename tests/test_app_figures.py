"""The app's pure figure functions on hand-made step records (no model, no server)."""

import math
import random

import pytest

pytest.importorskip("plotly")

from app import figures  # noqa: E402


def make_step(parents: list[int], accepted: list[int], index: int = 3, strategy: str = "bastion",
              bonus: int = 99, truncated: bool = False) -> dict:
    """A step record shaped like Step.to_dict() plus the app's extras, with a trace of every node."""
    n = len(parents)
    depths = [0] * n
    for i, p in enumerate(parents):
        depths[i] = 0 if p < 0 else depths[p] + 1
    tokens = [10 + i for i in range(n)]
    marg = [1.0] + [0.5] * (n - 1)
    path = [0.5 ** d for d in depths]
    committed = [tokens[i] for i in accepted[1:]] + ([] if truncated else [bonus])
    s, trace = 1.0, []
    for i in range(1, n):
        s += path[i]
        trace.append({"node": i, "depth": depths[i], "token": tokens[i], "parent": parents[i], "p": path[i],
                      "expected": s, "cost": 0.01 + 0.001 * i, "throughput": s / (0.02 + 0.01 + 0.001 * i),
                      "added": True, "reason": "raises predicted throughput"})
    trace.append({"node": n, "depth": 1, "token": 7, "parent": 0, "p": 0.01, "expected": s + 0.01,
                  "cost": 0.01 + 0.001 * n, "throughput": 1.0, "added": False, "reason": "no gain"})
    return {"index": index, "strategy": strategy, "stop_reason": "next node lowers predicted throughput",
            "tree": {"tokens": tokens, "parents": parents, "depths": depths, "marginals": marg,
                     "path_probs": path, "ranks": [0] * n},
            "trace": trace, "accepted": accepted, "choices": [tokens[accepted[min(k, len(accepted) - 1)]]
                                                              for k in range(n)],
            "tokens": committed, "token_texts": [f"<t{t}>" for t in committed], "bonus": bonus,
            "expected_tokens": s, "predicted_verify_s": 0.01 + 0.001 * n, "measured_verify_s": 0.012,
            "round_overhead_s": 0.02, "overhead_s": 0.02, "root_cost_s": 0.01,
            "times": {"draft": 0.01, "build": 0.001, "verify": 0.012, "commit": 0.002},
            "context_len": 20, "generated": 5, "elapsed_s": 0.1, "clock_s": 0.1, "prefill_s": 0.01,
            "finished": False, "finish_reason": "", "texts": {str(t): f"tok{t}" for t in tokens + [bonus]}}


# a root with three children; the middle one has two children, one of which has a child
PARENTS = [-1, 0, 0, 0, 2, 2, 4]
ACCEPTED = [0, 2, 4, 6]


def random_parents(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [-1] + [rng.randrange(0, i) for i in range(1, n)]


@pytest.mark.parametrize("n,seed", [(1, 0), (2, 0), (16, 1), (128, 2), (300, 3), (300, 4)])
def test_tree_layout_has_no_overlaps_and_centres_children(n, seed):
    parents = random_parents(n, seed)
    depth, rows = figures.tree_layout(parents)
    by_depth: dict[int, list[float]] = {}
    for d, y in zip(depth, rows):
        by_depth.setdefault(d, []).append(y)
    for ys in by_depth.values():
        ys.sort()
        assert all(b - a >= 1.0 for a, b in zip(ys, ys[1:])), "two nodes of one depth overlap"
    kids = {}
    for i, p in enumerate(parents):
        if p >= 0:
            kids.setdefault(p, []).append(i)
            assert depth[i] == depth[p] + 1
    for p, ch in kids.items():  # a parent sits midway between its first and last child
        assert rows[p] == pytest.approx((rows[ch[0]] + rows[ch[-1]]) / 2)


def test_chain_layout_is_a_straight_line():
    depth, rows = figures.tree_layout([-1, 0, 1, 2, 3])
    assert depth == [0, 1, 2, 3, 4] and len(set(rows)) == 1


def _trace(fig, name):
    return next(t for t in fig.data if t.name == name)


def test_tree_figure_highlights_accepted_path_and_bonus():
    step = make_step(PARENTS, ACCEPTED)
    fig = figures.tree_figure(step)
    depth, rows = figures.tree_layout(PARENTS + [ACCEPTED[-1]])
    acc = _trace(fig, "accepted")
    assert sorted(zip(acc.x, acc.y)) == sorted((depth[i], -rows[i]) for i in ACCEPTED)
    assert len(_trace(fig, "rejected").x) == len(PARENTS) - len(ACCEPTED)
    bonus = _trace(fig, "bonus")
    assert bonus.marker.symbol == ("diamond",) and bonus.x == (depth[ACCEPTED[-1]] + 1,)
    bold = max(fig.data, key=lambda t: t.line.width or 0 if t.mode == "lines" else 0)
    assert bold.line.width == 4 and len([x for x in bold.x if x is not None]) == 2 * (len(ACCEPTED) - 1)
    assert "tok16" in acc.text  # node text is the token
    hover = acc.hovertext[list(acc.x).index(depth[4])]
    assert "depth 2" in hover and "pop order 4" in hover and "path P (calibrated) = 0.25" in hover and "target chose" in hover
    assert "Round 3" in fig.layout.title.text and "3 accepted + bonus" in fig.layout.title.text


def test_tree_figure_without_committed_bonus():
    fig = figures.tree_figure(make_step(PARENTS, ACCEPTED, truncated=True))
    assert all(t.name != "bonus" for t in fig.data if t.mode != "lines")


def test_node_size_grows_with_path_confidence():
    fig = figures.tree_figure(make_step(PARENTS, ACCEPTED))
    acc = _trace(fig, "accepted")
    sizes = dict(zip(acc.x, acc.marker.size))
    assert sizes[0] > sizes[1] > sizes[2] > sizes[3]


def test_gain_cost_marker_at_chosen_size():
    step = make_step(PARENTS, ACCEPTED)
    fig = figures.gain_cost_figure(step)
    chosen = len(PARENTS)
    assert fig.layout.shapes and all(s.x0 == chosen for s in fig.layout.shapes)  # one line per panel
    assert any(a.text == f"stop: n = {chosen}" and a.x == chosen for a in fig.layout.annotations)
    assert "lowers predicted throughput" in fig.layout.title.text  # why it stopped
    s_trace = _trace(fig, "S_n expected tokens (open: not taken)")
    assert s_trace.x[0] == 1 and s_trace.y[0] == 1.0
    assert list(s_trace.y[1:]) == pytest.approx([d["expected"] for d in step["trace"]])
    assert s_trace.marker.symbol[-1] == "circle-open"  # the rejected candidate
    assert _trace(fig, "committed (actual)").y == (len(step["tokens"]),)
    assert _trace(fig, "measured verify").y == (pytest.approx(12.0),)
    thr = _trace(fig, "predicted tok/s = S_n/(T+C(n))")
    assert thr.y[0] == pytest.approx(1.0 / (0.02 + 0.01))


def test_padded_rounds_say_how_many_rows_were_verified():
    step = make_step(PARENTS, ACCEPTED)
    n = len(PARENTS)
    plain_gain, plain_tree = figures.gain_cost_figure(step), figures.tree_figure(step)
    assert "rows" not in plain_tree.layout.title.text
    assert not any("rows" in a.text for a in plain_gain.layout.annotations)
    step["rows"] = n + 3
    assert f"verified as {n + 3} rows" in figures.tree_figure(step).layout.title.text
    assert any(a.text == f"stop: n = {n}, verified as {n + 3} rows" for a in figures.gain_cost_figure(step).layout.annotations)


def test_gain_cost_for_a_chain_uses_recorded_costs():
    step = make_step([-1, 0, 1, 2], [0, 1], strategy="chain")
    step["trace"], step["cost_curve"] = [], [0.01, 0.011, 0.012, 0.013]
    pts = figures.gain_cost_points(step)
    assert pts["n"] == [1, 2, 3, 4]
    assert pts["S"] == pytest.approx([1.0, 1.5, 1.75, 1.875])
    assert figures.gain_cost_figure(step).layout.shapes[0].x0 == 4


def test_gain_cost_of_an_ar_round_is_one_point():
    step = make_step([-1], [0], strategy="ar")
    step["trace"] = []
    assert figures.gain_cost_points(step)["n"] == [1]


def test_speed_and_stage_figures_report_measured_speedup_and_time_per_token():
    ar = [dict(make_step([-1], [0], index=i, strategy="ar"), clock_s=0.1 * (i + 1)) for i in range(6)]
    main = [dict(make_step(PARENTS, ACCEPTED, index=i), clock_s=0.1 * (i + 1)) for i in range(2)]
    fig = figures.speed_figure(ar, main)
    # AR: 6 tokens in 0.6 s; main: 8 tokens in 0.2 s
    assert "speedup 4.00×" in fig.layout.title.text and "τ = 4.00" in fig.layout.title.text
    assert [t.name for t in fig.data] == ["AR baseline", "bastion"]
    assert math.isclose(fig.data[1].y[-1], 8 / 0.2)
    bars = figures.stages_figure(ar, main).data
    assert [b.name for b in bars] == list(figures.STAGES)
    assert math.isclose(sum(b.x[0] for b in bars), 1e3 * 0.025)  # AR: 25 ms of stages per token
    assert figures.speed_figure(ar, []).layout.title.text == "tokens/s so far (decode)"  # no speedup without both
    assert figures.stages_figure([], []).layout.annotations


def test_latency_and_cost_figures_draw_curves_and_mark_round():
    steps = [make_step(PARENTS, ACCEPTED, index=i) for i in range(4)]
    curves = {"here": ([1, 2, 3], [0.01, 0.02, 0.03]), "H200": ([1, 2, 3], [1e-4, 1e-4, 2e-4])}
    fig = figures.latency_figure(steps, 2)
    assert [t.name for t in fig.data] == ["predicted", "measured"]
    assert fig.layout.shapes[0].x0 == 2
    cost = figures.cost_figure(steps, 2, curves)
    assert [t.name for t in cost.data] == ["here", "H200", "measured (all rounds)"]
    assert list(cost.data[0].y) == [10.0, 20.0, 30.0]  # ms
    assert cost.layout.yaxis.type == "log" and "round 2" in cost.layout.title.text
    assert {1, 2, 5, 10, 20} <= set(cost.layout.yaxis.tickvals) and "20" in cost.layout.yaxis.ticktext


def test_copied_nodes_are_squares_with_their_own_hover_and_gain_series():
    step = make_step(PARENTS, ACCEPTED)
    n = len(PARENTS)
    last = n - 1
    step["tree"]["ranks"][last] = -1  # the last node came from prompt lookup ...
    step["tree"]["ranks"][last - 1] = -2  # ... the one before from the datastore
    step["trace"] = [d for d in step["trace"] if d["node"] not in (last - 1, last)] + [
        {"node": last - 1, "depth": 1, "token": 10 + last - 1, "parent": PARENTS[last - 1], "p": 0.5, "expected": 2.9,
         "cost": 0.019, "throughput": 51.0, "added": True, "reason": "datastore: kept (raises predicted throughput)",
         "source": "datastore"},
        {"node": last, "depth": 1, "token": 10 + last, "parent": PARENTS[last], "p": 0.4, "expected": 3.0,
         "cost": 0.02, "throughput": 50.0, "added": True, "reason": "lookup: kept (raises predicted throughput)", "source": "lookup"},
        {"node": last + 1, "depth": 2, "token": 5, "parent": last, "p": 0.1, "expected": 3.1,
         "cost": 0.021, "throughput": 49.0, "added": False, "reason": "lookup: no gain", "source": "lookup"}]
    fig = figures.tree_figure(step)
    symbols = [sym for t in fig.data if t.mode == "markers+text" for sym in t.marker.symbol]
    assert symbols.count("square") == 2 and "2 nodes from prompt lookup or the datastore" in fig.layout.title.text
    hovers = [h for t in fig.data if t.mode == "markers+text" for h in t.hovertext]
    assert sum("prompt lookup" in h for h in hovers) == 1 and sum("datastore:" in h for h in hovers) == 1
    pts = figures.gain_cost_points(step)
    assert pts["lookup"]["n"] == [last, last + 1, last + 2] and pts["lookup"]["added"] == [True, True, False]
    assert last + 1 not in pts["n"] and last not in pts["n"]  # the drafter's curve keeps its own points only
    names = [t.name for t in figures.gain_cost_figure(step).data]
    assert "S_n with copied nodes (lookup, datastore)" in names


def test_calibration_figure_plots_observed_rates_and_fitted_curves():
    from bastion.calibration import AcceptanceCalibrator
    from bastion.tree import DraftTree

    cal = AcceptanceCalibrator(decay=1.0)
    for i in range(200):  # depth-1 nodes at q = 0.8 accepted half the time: overconfident
        tree = DraftTree.root_only(0)
        tree.add(1, 0, 0.8, 0.8, 0)
        cal.observe(tree, tree.marginals, [0, 1] if i % 2 else [0])
    qs = [i / 10 for i in range(11)]
    data = {"temperature": 1.0, "points": cal.reliability(), "qs": qs,
            "curves": {str(d): cal.curve(d, qs) for d in cal.depth_groups}}
    fig = figures.calibration_figure(data)
    names = [t.name for t in fig.data]
    assert names == ["calibrated drafter (g = q)", "depth 1: observed", "depth 1: fitted g(q)"]
    obs, fit = fig.data[1], fig.data[2]
    assert math.isclose(obs.x[0], 0.8) and math.isclose(obs.y[0], 0.5) and "of 200 tested" in obs.hovertext[0]
    assert 0.45 < fit.y[8] < 0.6 and fit.y[8] < 0.8  # g(0.8) pulled from 0.8 toward the observed 0.5
    assert "T = 1" in fig.layout.title.text and "κ" not in fig.layout.title.text
    assert "κ = 0.70" in figures.calibration_figure({**data, "path_scale": 0.7}).layout.title.text
    assert figures.calibration_figure(None).layout.annotations  # nothing yet: a message, no crash
    assert fig.layout.xaxis.title.text == "drafter confidence q"
    assert "coupled" in figures.calibration_figure({**data, "coupled": True}).layout.xaxis.title.text


def test_tokens_html_colours_by_origin_and_escapes():
    steps = [make_step(PARENTS, ACCEPTED, index=0), make_step([-1], [0], index=1)]
    out = figures.tokens_html(steps, selected=1)
    assert out.count('class="tok acc"') == 3 and out.count('class="tok bonus"') == 2
    assert "&lt;t12&gt;" in out and "<t12>" not in out
    assert 'title="round 1 · bonus token' in out and "outline:2px" in out


def test_empty_inputs_do_not_crash():
    assert figures.speed_figure([], []).layout.annotations
    assert "appears here" in figures.tokens_html([])
    assert figures.token_label("\n") == "⏎" and figures.token_label("  ") == "␣␣"
