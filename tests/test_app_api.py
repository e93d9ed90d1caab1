"""The app in-process on tiny random models: the /generate API, session isolation, bad input, replay."""

import json
import socket
import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

gr = pytest.importorskip("gradio")
from gradio_client import Client  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

from app.engine_glue import THIS_MACHINE, Runtime, replan  # noqa: E402
from app.handlers import (VIEW_FIELDS, Handlers, execute, full_view, parse_settings, round_view,  # noqa: E402
                          start_run, threads_note)
from app.state import export_run, load_run, run_summary  # noqa: E402
from app.ui import QUEUE_POLL_S, calm_queue, create_app, launch  # noqa: E402
from bastion.engine import Engine, GenerationConfig  # noqa: E402
from bastion.latency import RowPadding  # noqa: E402
from tiny import tiny_drafter, tiny_target  # noqa: E402

RECORD_KEYS = {"index", "tree", "trace", "accepted", "choices", "tokens", "token_texts", "bonus", "calib",
               "clock_s", "texts", "times", "predicted_verify_s", "measured_verify_s", "draft_logq"}


def tiny_runtime(drafter: bool = True) -> Runtime:
    target = tiny_target()
    return Runtime(Engine(target, tiny_drafter(target) if drafter else None), "tiny random llama")


class SharpDrafter:
    """A tiny drafter with peaked marginals (log q scaled, renormalised), so Bastion's trees stay small."""

    def __init__(self, inner, factor: float = 6.0):
        self.inner, self.cfg, self.block_size, self.factor = inner, inner.cfg, inner.block_size, factor

    def new_cache(self):
        return self.inner.new_cache()

    def extend_cache(self, cache, features):
        self.inner.extend_cache(cache, features)

    def draft(self, cache, root, embed, lm_head, vocab=None, depth=None):  # no draft vocabulary: vocab stays None
        return torch.log_softmax(self.factor * self.inner.draft(cache, root, embed, lm_head, None, depth), dim=-1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    demo = create_app(tiny_runtime())
    _, url, _ = launch(demo, "127.0.0.1", free_port(), prevent_thread_lock=True, quiet=True)
    yield url
    demo.close()


def test_the_app_sends_no_telemetry(monkeypatch):
    """Gradio's analytics are off whatever the environment says: building the page starts no version
    check and launching it posts nothing to api.gradio.app."""
    import gradio.analytics

    calls = []
    for name in ("version_check", "initiated_analytics", "launched_analytics", "_do_analytics_request"):
        monkeypatch.setattr(gradio.analytics, name, lambda *a, _n=name, **k: calls.append(_n))
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "True")
    demo = create_app(tiny_runtime())
    assert demo.analytics_enabled is False
    launch(demo, "127.0.0.1", free_port(), prevent_thread_lock=True, quiet=True)
    demo.close()
    assert calls == []


def test_the_queue_does_not_poll_every_millisecond():
    """Gradio's queue polls every 1 ms by default; on two cores those wake-ups stall the engine's
    OpenMP threads (AR ~12% slower served than in-process), so the app polls every QUEUE_POLL_S."""
    demo = create_app(tiny_runtime())
    queue = demo._queue
    assert QUEUE_POLL_S >= 0.01
    assert queue.sleep_when_free >= QUEUE_POLL_S and queue.progress_update_sleep_when_free >= QUEUE_POLL_S
    calm_queue(object())  # a Gradio without these attributes is left alone


def settings(runtime, prompt="hello", strategy="bastion", **kw):
    args = dict(budget=8, temperature=0.0, top_p=1.0, max_new_tokens=12, seed=0) | kw
    return parse_settings(runtime, prompt, strategy, args["budget"], args["temperature"], args["top_p"],
                          args["max_new_tokens"], args["seed"])


def test_generate_streams_step_records(server):
    client = Client(server, verbose=False)
    params = [p["parameter_name"] for p in client.view_api(return_format="dict", print_info=False)
              ["named_endpoints"]["/generate"]["parameters"]]
    assert params[0] == "prompt"
    job = client.submit(prompt="hello world", strategy="bastion", max_new_tokens=12, api_name="/generate")
    final = job.result(timeout=600)
    outputs = job.outputs()
    steps = [o for o in outputs if o["event"] == "step"]
    assert steps and RECORD_KEYS <= set(steps[0]["step"])
    assert [s["step"]["index"] for s in steps] == list(range(len(steps)))
    assert final["event"] == "done" and final["stats"]["main"]["tokens"] == 12
    assert sum(len(s["step"]["tokens"]) for s in steps) == 12
    assert final["text"] == steps[-1]["text"]


def test_generate_defaults_and_lossless_baseline(server):
    client = Client(server, verbose=False)
    assert client.predict(prompt="hi", api_name="/generate")["event"] == "done"  # every other setting defaulted
    out = client.predict(prompt="hi there", strategy="fixed", budget=6, max_new_tokens=10, baseline=True,
                         api_name="/generate")
    assert out["stats"]["baseline"]["tau"] == 1.0 and out["stats"]["identical_to_ar"] is True
    assert out["stats"]["speedup"] > 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt="   "), "enter a prompt"),
    (dict(prompt="x" * 5000), "characters"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top-p"),
    (dict(prompt="hi", max_new_tokens=100000), "max new tokens"),
    (dict(prompt="hi", strategy="beam"), "Unknown strategy"),
])
def test_generate_rejects_bad_input_with_a_message(server, kwargs, message):
    with pytest.raises(AppError, match=message):
        Client(server, verbose=False).predict(**kwargs, api_name="/generate")


def _run_ui(client: Client, prompt: str) -> None:
    client.predict(prompt, "bastion", 8, 0.0, 1.0, 10, 0, False, THIS_MACHINE, api_name="/run")


def test_two_sessions_do_not_see_each_others_runs(server):
    a, b = Client(server, verbose=False), Client(server, verbose=False)
    threads = [threading.Thread(target=_run_ui, args=(c, p)) for c, p in ((a, "alpha prompt"), (b, "beta"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)  # generous: the shared CI machine may be busy
    assert not any(t.is_alive() for t in threads)
    for client, prompt in ((a, "alpha prompt"), (b, "beta")):
        exported = client.predict(api_name="/export")
        path = exported["value"] if isinstance(exported, dict) else exported
        run = load_run(path)
        assert run["prompt"] == prompt and run["steps"]
    fresh = Client(server, verbose=False)  # a new session has nothing to redraw
    nothing = fresh.predict(0, THIS_MACHINE, api_name="/show_round")
    assert all(isinstance(x, dict) and x.get("__type__") == "update" for x in nothing)


def test_no_drafter_means_ar_only_until_one_appears():
    rt = tiny_runtime(drafter=False)
    with pytest.raises(ValueError, match="only AR"):
        settings(rt)
    assert settings(rt, strategy="auto")[1].strategy == "ar"
    drafter = tiny_drafter(rt.engine.target)
    rt.drafter_loader = lambda: drafter
    latency = rt.engine.latency
    assert settings(rt, strategy="auto")[1].strategy == "bastion"
    assert rt.engine.drafter is drafter and rt.engine.latency is latency  # calibration kept


def _full_run(rt, strategy="bastion", baseline=True, **kw):
    s, cfg = settings(rt, strategy=strategy, **kw)
    run, ids = start_run(rt, "a prompt for the tests", s)
    for _ in execute(rt, run, ids, cfg, baseline):
        pass
    return run


def test_replan_on_this_machine_reproduces_bastions_trees():
    target = tiny_target()
    rt = Runtime(Engine(target, SharpDrafter(tiny_drafter(target))), "tiny, peaked drafter")
    latency = rt.engine.latency  # a fixed calibration, so tree sizes do not depend on this machine's timing
    for s in range(1, 65):
        latency.observe(s, 20, 1e-3 + 2e-4 * s)
    latency.observe_overheads(1e-3, 1e-3)
    latency.observe = latency.observe_overheads = latency.observe_many = lambda *args, **kwargs: None
    # and a fixed (identity) row padding: the probe would time this machine and pad by what it saw
    rt.engine.padding = RowPadding.from_times([1e-3 * m for m in range(1, 17)])
    run = _full_run(rt, max_new_tokens=24, baseline=False)
    checked = 0
    for rec in run["steps"]:
        # the replay sees the recorded top-16 per depth with log q rounded to 4 digits: near-ties in a big
        # tree may pop in another order, so compare rounds with small, low-rank trees
        # (rounds whose draft the gate skipped have nothing to re-plan: replan gives None)
        if rec.get("draft_logq") and max(rec["tree"]["ranks"]) < 8 and len(rec["tree"]["tokens"]) < 40:
            tree = replan(rec, run["model"], THIS_MACHINE, run["settings"])["tree"]
            assert len(tree["tokens"]) == len(rec["tree"]["tokens"])
            assert sorted(zip(tree["depths"], tree["tokens"])) == sorted(zip(rec["tree"]["depths"], rec["tree"]["tokens"]))
            checked += 1
    assert checked
    last = [rec for rec in run["steps"] if rec.get("draft_logq")][-1]
    h200 = replan(last, run["model"], "H200", run["settings"])
    assert len(h200["tree"]["tokens"]) >= len(last["tree"]["tokens"])  # a flat roofline grows trees
    # a host a benchmark measured (bastion/profiles): the plan is priced with its costs, exactly as the
    # engine's --cost-profile sizes trees, and its v(n) joins the cost plot
    from app.engine_glue import cost_curves, measured_hosts, whatif_devices
    from app.handlers import whatif_markdown
    label = "h100-s43 (measured)"
    assert label in whatif_devices() and whatif_devices()[0] == THIS_MACHINE
    h100 = replan(last, run["model"], label, run["settings"])
    profile = measured_hosts()[label]
    assert h100["overhead_s"] == profile.overhead(True)
    assert h100["predicted_verify_s"] == profile.cost(len(h100["tree"]["tokens"]))
    assert len(h100["tree"]["tokens"]) >= len(last["tree"]["tokens"])  # 1 to 129 rows in 15–18 ms there
    curves = cost_curves(last, run["model"], label, 8)
    assert curves[f"{label}: v(n)"] == (list(range(1, 9)), [profile.verify(n) for n in range(1, 9)])
    assert "measured on results-s43-h100" in whatif_markdown(last, h100, label)
    assert "predicted v(n) + b·n = " in whatif_markdown(last, h100, label)
    from app.figures import gain_cost_figure  # the plot names what it prices there: v(n) + b·n, not C(n)
    names = {t.name for t in gain_cost_figure(h100).data}
    assert "predicted v(n) + b·n" in names and "predicted C(n)" not in names
    assert "predicted C(n)" in {t.name for t in gain_cost_figure(h200).data}


def test_export_import_roundtrip_and_bad_files(tmp_path):
    rt = tiny_runtime()
    run = _full_run(rt, strategy="chain", max_new_tokens=10)
    assert run_summary(run)["identical_to_ar"] is True
    handlers = Handlers(rt)
    view = dict(zip(VIEW_FIELDS, handlers.load(export_run(run, tmp_path), THIS_MACHINE)))
    assert view["state"]["steps"] == json.loads(json.dumps(run["steps"])) and "Replaying" in view["message"]
    assert run["calibration"]["points"] and view["calibration"] is not None  # the calibration plot comes back too
    broken = dict(run, steps=[dict(run["steps"][0], accepted=[0, 999])])
    bad_cal = dict(run, calibration=dict(run["calibration"], curves={"1": [0.5]}))
    bad_scale = dict(run, calibration=dict(run["calibration"], path_scale=3.0))
    bad = {"not json": "{oops", "foreign": json.dumps({"hello": 1}), "list": "[1, 2]",
           "broken": json.dumps(broken), "empty": json.dumps(dict(run, steps=[])), "calibration": json.dumps(bad_cal),
           "path scale": json.dumps(bad_scale)}
    for name, text in bad.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.warns(UserWarning):
            view = dict(zip(VIEW_FIELDS, handlers.load(str(path), THIS_MACHINE)))
        assert view["message"].startswith("⚠️") and view["state"] == gr.skip(), name


def test_stop_leaves_the_session_usable():
    rt = tiny_runtime()
    handlers = Handlers(rt)
    args = ("hello", "bastion", 8, 0.0, 1.0, 16, 0, True, THIS_MACHINE, None)
    gen = handlers.run(*args)
    first = [dict(zip(VIEW_FIELDS, next(gen))) for _ in range(2)]
    state = first[-1]["state"]
    assert all(v == gr.skip() for v in handlers.stopped(state))  # Stop only flags the run
    rest = [dict(zip(VIEW_FIELDS, v)) for v in gen]  # the generator draws the final view and ends
    assert not rt.lock.locked()
    assert rest[-1]["state"]["status"] == "stopped" and rest[-1]["message"].startswith("Stopped")
    assert rest[-1]["scrubber"] is not None
    assert all(v == gr.skip() for v in handlers.stopped(rest[-1]["state"]))  # nothing to stop: no change
    final = [dict(zip(VIEW_FIELDS, v)) for v in handlers.run(*args[:-1], state)][-1]
    assert final["state"]["status"] == "finished" and final["message"] == ""


def test_a_run_streams_text_and_draws_figures_only_once_it_ends(monkeypatch):
    """While rounds are timed the page gets the text and the progress line only: a browser drawing
    figures on the same CPU slowed the run it was showing (app.handlers.TEXT_EVERY_S)."""
    import app.handlers

    monkeypatch.setattr(app.handlers, "TEXT_EVERY_S", 0.0)  # a live update after every round
    views = [dict(zip(VIEW_FIELDS, v)) for v in Handlers(tiny_runtime()).run(
        "hello", "bastion", 8, 0.0, 1.0, 16, 0, True, THIS_MACHINE, None)]
    figure_fields = ("tree", "gain", "speed", "stages", "latency", "cost", "whatif", "calibration")
    live = views[1:-1]
    assert len(live) >= 16 and {v["stats"].split("**")[1][:1] for v in live} == {"①", "②"}  # baseline, then Bastion
    for v in live:
        assert v["text"] != gr.skip() and all(v[f] == gr.skip() for f in figure_fields)
    assert all(views[-1][f] != gr.skip() for f in figure_fields) and views[-1]["state"]["status"] == "finished"


def test_run_handler_shows_bad_settings_in_the_page():
    handlers = Handlers(tiny_runtime())
    with pytest.warns(UserWarning, match="whole number"):
        out = [dict(zip(VIEW_FIELDS, v)) for v in handlers.run("hi", "fixed", 2.5, 0, 1, 10, 0, False,
                                                                THIS_MACHINE, None)]
    assert len(out) == 1 and "budget" in out[0]["message"]


def test_bastion_run_probes_the_latency_slope_after_ar_rounds():
    from bastion.probe import PROBE_ROWS, PROBE_SIZES
    rt = tiny_runtime()
    ids = rt.encode("calibration")
    ar = list(rt.stream(ids, GenerationConfig(strategy="ar", max_new_tokens=6)))
    lat = rt.engine.latency
    assert len(lat.samples) == len(ar) and not lat.slope_identified()  # n = 1 only: C(n)'s slope unknown
    from app.engine_glue import calib_snapshot
    before = calib_snapshot(lat)  # the state the AR run left
    records = list(rt.stream(ids, GenerationConfig(strategy="bastion", max_new_tokens=6)))
    # the probe ran before the first round, off its clock, and the first round's decisions saw it
    padding = rt.engine.padding
    assert padding is not None and len(padding.padded) == PROBE_ROWS
    probed = set(padding.padded) | set(PROBE_SIZES)  # the row counts padding keeps, and the slope sizes
    assert len(lat.samples) == len(ar) + len(probed) + len(records) and lat.slope_identified()
    assert records[0]["calib"] != before and records[0]["calib"]["padded"] == padding.padded
    assert {s for s, _, _ in lat.samples} >= probed
    assert records[1]["calib"] != records[0]["calib"]  # each record carries the state its round used
    # and only once per engine: after an AR run long enough to push every probe sample out of the
    # window, the next Bastion run gets the probe's kept timings back instead of a new probe
    probes = []
    real_probe = rt.engine.probe_latency
    rt.engine.probe_latency = lambda *a, **k: (probes.append(1), real_probe(*a, **k))
    lat.window = len(probed)
    list(rt.stream(ids, GenerationConfig(strategy="ar", max_new_tokens=len(probed) + 2)))
    # (one size only: AR's single row, or the row count the probe's table pads it to on this host)
    assert len({s for s, _, _ in lat.samples}) == 1 and not lat.slope_identified()
    rt.engine.prepare(GenerationConfig(strategy="bastion"))
    assert probes == [] and lat.slope_identified() and {s for s, _, _ in lat.samples} == probed


def test_whatif_text_warns_when_the_engine_conditioned_the_tree():
    from app.handlers import whatif_markdown

    rec = {"index": 3, "tree": {"tokens": [1, 2, 3], "ranks": [0, 0, 1]}, "expected_tokens": 1.7, "strategy": "bastion"}
    plan = {"tree": {"tokens": [1, 2]}, "expected_tokens": 1.5, "overhead_s": 0.004, "predicted_verify_s": 0.03,
            "stop_reason": "no gain"}
    plain = whatif_markdown(rec, plan, THIS_MACHINE)
    assert "n-grams" not in plain and "**2** nodes" in plain
    assert "datastore's n-grams" in whatif_markdown({**rec, "conditioned": True}, plan, THIS_MACHINE)


def test_warmup_probes_and_a_run_sent_meanwhile_waits_for_it():
    """app.py warms up once the page is served: the warm-up probes the latency model under the lock,
    and a run that starts meanwhile waits for it, then runs whole (neither supersedes the other)."""
    rt = tiny_runtime()
    entered, release = threading.Event(), threading.Event()
    real_probe = rt.engine.probe_latency

    def slow_probe(*args, **kwargs):
        entered.set()
        release.wait(10)  # hold the warm-up inside its probe while the run below starts
        return real_probe(*args, **kwargs)

    rt.engine.probe_latency = slow_probe
    warm = threading.Thread(target=rt.warmup)
    warm.start()
    assert entered.wait(10) and rt.lock.locked()
    got = []
    runner = threading.Thread(target=lambda: got.extend(rt.stream(rt.encode("hi"), GenerationConfig(
        strategy="bastion", max_new_tokens=4))))
    runner.start()
    runner.join(0.3)
    assert runner.is_alive() and not got  # waiting at the lock
    release.set()
    warm.join(30)
    runner.join(30)
    assert not warm.is_alive() and not runner.is_alive()
    assert rt.engine.padding is not None and got and got[-1]["generated"] == 4


def test_every_engine_call_runs_on_one_thread_whoever_asks():
    """Gradio's worker threads take turns serving a run; the engine must not follow them (each thread
    that enters the native kernels gets its own OpenMP pool, timed apart from the probe's)."""
    rt = tiny_runtime()
    seen: list[str] = []
    real = rt.engine.generate

    def watched(*args, **kwargs):
        for step in real(*args, **kwargs):
            seen.append(threading.current_thread().name)
            yield step

    rt.engine.generate = watched
    ids = rt.encode("hello there")
    rt.warmup()
    for strategy in ("ar", "bastion"):  # each run from a fresh caller thread
        th = threading.Thread(target=lambda s=strategy: list(rt.stream(ids, GenerationConfig(strategy=s, max_new_tokens=4))))
        th.start()
        th.join()
    assert len(seen) >= 4 and len(set(seen)) == 1 and seen[0].startswith("bastion-engine"), set(seen)


def test_the_page_says_when_rounds_ran_on_fewer_threads():
    """A run whose rounds were on different thread counts (the engine shed threads under contention)
    says so beside the speedup; one thread count throughout (or records without it) says nothing."""
    def rec(threads):
        return {"threads": threads, "tokens": [1], "finished": True}
    run = {"baseline": [rec(2)] * 5, "steps": [rec(2), rec(1), rec(1)]}
    assert threads_note(run).startswith("⚠ 2 of 8 rounds ran on 1 instead of 2 CPU threads")
    assert threads_note({"baseline": [rec(2)] * 3, "steps": [rec(2)] * 4}) == ""
    assert threads_note({"baseline": [rec(0)] * 3, "steps": []}) == ""


def test_loading_runs_on_the_engine_thread(monkeypatch):
    """Runtime.load builds the target, drafter and engine on the engine's thread (as a drafter loaded
    later is): OpenMP work on a second thread made every later forward 2× slower (session 24)."""
    import bastion.loading as loading

    target = tiny_target("llama", dtype=torch.float32)
    seen = []

    def where(result):
        seen.append(threading.current_thread().name)
        return result

    monkeypatch.setattr(loading, "load_target", lambda model, dtype, device: where(target))
    monkeypatch.setattr(loading, "load_default_drafter", lambda t, d, m: where(None))
    monkeypatch.setattr(loading, "load_default_datastore", lambda t, d, m: where(None))
    rt = Runtime.load("embedded")
    assert rt.engine.target is target and not rt.has_drafter
    assert not rt.refresh_drafter()  # the loader again, still no drafter
    assert len(seen) == 3 and all(name.startswith("bastion-engine") for name in seen), seen
    assert threading.current_thread().name not in seen


class TorchCalls(TorchFunctionMode):
    """Records the torch functions called on the thread that entered it (the mode stack is per thread)."""

    METADATA = ("__get__", "is_floating_point", "size", "dim")  # reading a tensor's attributes computes nothing

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in self.METADATA:
            self.calls.append(getattr(func, "__qualname__", name))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_serving_threads_compute_nothing_with_torch(temperature):
    """A whole run as the page serves it — baseline, main run, calibration read, final view, a redrawn
    round — leaves no torch op on the serving thread: even the calibration plot's few small ops gave
    Gradio's long-lived worker thread an OpenMP team, and every later forward ran 2× slower (session 25)."""
    rt = tiny_runtime()
    rt.warmup()
    with TorchCalls() as seen:
        run = _full_run(rt, temperature=temperature)
        full_view(run, THIS_MACHINE)
        round_view(run, 1, THIS_MACHINE)
    assert run["status"] == "finished" and run["calibration"]["curves"] and len(run["steps"]) > 1
    assert not seen.calls, sorted(set(seen.calls))


@pytest.mark.parametrize("args,message", [(["--model", "/no/such/model"], "neither a local folder"),
                                          (["--device", "gpu0"], "unknown device")])
def test_app_refuses_a_bad_model_or_device_in_one_line(args, message):
    """`python app.py` with a model or device it cannot load: exit status 1, one `error:` line, no
    traceback, and no server started (the failure comes before `launch`)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "app.py", "--port", "7898", *args], cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "Running on" not in r.stdout + r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: cannot load:") and message in r.stderr, r.stderr
