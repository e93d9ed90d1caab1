"""Layout and event wiring of the Bastion app, kept apart from the handlers they call.

``create_app(runtime)`` builds the page around an injected :class:`Runtime` (tests pass one on tiny
random models); ``launch`` serves it. Model work (the Run button and the ``/generate`` API) shares
one queue slot (concurrency id "model", limit 1); redraws from session state run beside it.
"""

from __future__ import annotations

import json

import gradio as gr

from bastion.loading import EVAL_PROMPTS

from .engine_glue import THIS_MACHINE, Runtime, whatif_devices
from .figures import empty_figure, tokens_html
from .handlers import VIEW_FIELDS, Handlers

TITLE = "Bastion: budget-aware tree speculative decoding"
INTRO = (f"# {TITLE}\nA block-diffusion drafter proposes per-depth marginals; a draft tree grows best-first and "
         "stops where one more node would lower predicted throughput S_n / (T_d + T_o + C(n)), with C(n) from an "
         "online-calibrated roofline; Bastion also hangs copied branches on the tree when they pay (squares: "
         "prompt lookup copies from the context, the datastore from what the model wrote after the same words "
         "in other replies). The target verifies the whole tree in one forward and the output stays exactly "
         "the target's (lossless).")
MAX_UPLOAD = "20mb"
PLOT_MIN_PX = 380  # two plots of a row side by side down to ~800 px of page, stacked below (phones)
SMALL_PLOT_MIN_PX = 300  # the speed row sits in the right column (3/5 of the page)
# The run table keeps one line per cell and scrolls sideways on a narrow screen (its headers had
# wrapped a letter a line at 420 px).
CSS = "#stats table { display: block; overflow-x: auto; } #stats th, #stats td { white-space: nowrap; }"


def load_prompts() -> dict[str, list[str]]:
    """Chat / code / math example prompts from assets/eval_prompts.json (none if the file is absent)."""
    try:
        data = json.loads(EVAL_PROMPTS.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: [p for p in v if isinstance(p, str)] for k, v in data.items() if isinstance(v, list)}


def _inputs(prompts: dict, limits, default_strategy: str) -> dict:
    c = {"prompt": gr.Textbox(label="Prompt", lines=4, max_lines=12, elem_id="prompt",
                              placeholder="Ask something, or pick an example below")}
    with gr.Tabs():
        for kind in ("chat", "code", "math"):
            if prompts.get(kind):
                with gr.Tab(f"{kind} examples"):
                    gr.Examples([[p] for p in prompts[kind]], inputs=[c["prompt"]], label=None,
                                examples_per_page=4)
    c["strategy"] = gr.Radio([("Bastion (budget-aware tree)", "bastion"), ("DFlash chain", "chain"),
                              ("Fixed tree (budget N)", "fixed"), ("AR (no drafter)", "ar")],
                             value=default_strategy, label="Strategy", elem_id="strategy")
    c["budget"] = gr.Slider(1, limits.max_nodes, value=32, step=1, label="Fixed-tree budget N (draft nodes)")
    with gr.Row():
        c["temperature"] = gr.Slider(0.0, limits.max_temperature, value=0.0, step=0.05, label="Temperature")
        c["top_p"] = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p")
    with gr.Row():
        c["max_new_tokens"] = gr.Slider(1, limits.max_new_tokens, value=96, step=1, label="Max new tokens",
                                         elem_id="max-new-tokens")
        c["seed"] = gr.Number(0, precision=0, minimum=0, label="Seed")
    c["baseline"] = gr.Checkbox(True, label="Measure AR baseline first (reused while prompt and settings repeat)",
                                elem_id="baseline")
    with gr.Row():
        c["run"] = gr.Button("Run", variant="primary", elem_id="run-btn")
        c["stop"] = gr.Button("Stop", variant="stop", elem_id="stop-btn")
    c["message"] = gr.Markdown(elem_id="message")
    return c


def _layout(handlers: Handlers, prompts: dict) -> dict:
    rt = handlers.runtime
    c = {"banner": gr.Markdown(handlers.banner(), elem_id="banner")}
    with gr.Row():
        with gr.Column(scale=2, min_width=340):
            c.update(_inputs(prompts, rt.limits, "bastion" if rt.has_drafter else "ar"))
        with gr.Column(scale=3):
            c["text"] = gr.HTML(tokens_html([]), label="Output", elem_id="output-text")
            c["stats"] = gr.Markdown(elem_id="stats")
            with gr.Row():
                c["speed"] = gr.Plot(empty_figure("speed against AR"), label="Speed against AR", scale=3,
                                     min_width=SMALL_PLOT_MIN_PX, elem_id="speed-plot")
                c["stages"] = gr.Plot(empty_figure("time per stage"), label="Time per stage", scale=2,
                                      min_width=SMALL_PLOT_MIN_PX, elem_id="stages-plot")
    c["scrubber"] = gr.Slider(0, 1, value=0, step=1, interactive=False, elem_id="scrubber",
                              label="Round (redraws from session state, no model run)")
    with gr.Row():
        c["tree"] = gr.Plot(empty_figure("draft tree"), label="Draft tree", scale=3, min_width=PLOT_MIN_PX,
                            elem_id="tree-plot")
        c["gain"] = gr.Plot(empty_figure("gain vs cost"), label="Gain vs cost", scale=2, min_width=PLOT_MIN_PX,
                            elem_id="gain-plot")
    with gr.Accordion("Latency model and what-if hardware", open=True):
        c["device"] = gr.Dropdown(whatif_devices(), value=THIS_MACHINE, label="What-if hardware",
                                  info="re-plan the shown round's tree under a host's measured costs or a GPU's roofline",
                                  elem_id="device")
        with gr.Row():
            c["latency"] = gr.Plot(empty_figure("latency model"), label="Latency model", min_width=PLOT_MIN_PX,
                                   elem_id="latency-plot")
            c["cost"] = gr.Plot(empty_figure("C(n)"), label="Verification cost C(n)", min_width=PLOT_MIN_PX,
                                elem_id="cost-plot")
        with gr.Row():
            c["whatif"] = gr.Plot(empty_figure("what-if hardware"), label="What-if", scale=3, min_width=PLOT_MIN_PX,
                                  elem_id="whatif-plot")
            with gr.Column(scale=2, min_width=PLOT_MIN_PX):
                c["whatif_md"] = gr.Markdown()
    with gr.Accordion("Drafter calibration: confidence vs acceptance", open=False):
        c["calibration"] = gr.Plot(empty_figure("drafter calibration"), label="Drafter calibration",
                                   elem_id="calibration-plot")
    with gr.Row():
        c["export"] = gr.Button("Export run as JSON", elem_id="export-btn")
        c["export_file"] = gr.File(label="Run file", interactive=False, visible=False, elem_id="export-file")
        c["upload"] = gr.UploadButton("Load a run JSON (replay, no model)", file_types=[".json"], type="filepath",
                                      elem_id="upload-btn")
    c["state"] = gr.State(None)
    return c


def _wire(handlers: Handlers, c: dict) -> None:
    view = [c[name] for name in VIEW_FIELDS]
    settings = [c[k] for k in ("prompt", "strategy", "budget", "temperature", "top_p", "max_new_tokens", "seed",
                               "baseline", "device", "state")]
    c["run"].click(handlers.run, settings, view, api_name="run", api_visibility="undocumented",
                   concurrency_id="model", concurrency_limit=1, show_progress="minimal")
    # no `cancels`: Stop only flags the run, whose generator ends after drawing the final view itself
    c["stop"].click(handlers.stopped, [c["state"]], view, api_visibility="private")
    redraw = dict(fn=handlers.show_round, inputs=[c["state"], c["scrubber"], c["device"]], outputs=view,
                  show_progress="hidden", trigger_mode="always_last")
    c["scrubber"].input(**redraw, api_name="show_round", api_visibility="undocumented")
    c["device"].input(**redraw, api_visibility="private")
    c["export"].click(handlers.export, [c["state"]], [c["export_file"]], api_name="export",
                      api_visibility="undocumented")
    c["upload"].upload(handlers.load, [c["upload"], c["device"]], view, api_visibility="private")
    gr.api(handlers.generate, api_name="generate", concurrency_id="model", concurrency_limit=1)


QUEUE_POLL_S = 0.02  # see calm_queue


def create_app(runtime: Runtime) -> gr.Blocks:
    """The whole page around one shared Runtime; every session keeps its own run in gr.State."""
    handlers = Handlers(runtime)
    empty_figure("warm-up")  # plotly builds its validators on first use: pay that at start, not in a handler
    # analytics off: Gradio's default would contact api.gradio.app (a version check when the page is
    # built, telemetry at launch); the app runs offline and sends nothing anywhere
    with gr.Blocks(title=TITLE, delete_cache=(3600, 3600), analytics_enabled=False) as demo:  # files live an hour
        gr.Markdown(INTRO)
        c = _layout(handlers, load_prompts())
        _wire(handlers, c)
        demo.load(handlers.on_load, None, [c["banner"], c["strategy"]], api_visibility="private")
    demo.queue(default_concurrency_limit=4, max_size=64)
    calm_queue(demo)
    return demo


def calm_queue(demo: gr.Blocks, poll_s: float = QUEUE_POLL_S) -> None:
    """Let Gradio's queue look for new events every ``poll_s`` instead of every millisecond.

    Gradio (6.x, not on Windows) polls its event queue every 1 ms and its progress updates every
    10 ms, idle or not: ~1,100 wake-ups a second of the server's event-loop thread. On a 2-core CPU
    each wake-up preempts one of the engine's two OpenMP threads, and every parallel region of the
    forward then waits at its barrier for it. Measured on the 2-core Xeon (the page's run event three
    times, 64 tokens, AR baseline on, the two settings alternated twice; bench/NOTES.md): AR
    55.6–62.5 tok/s polling every 1 ms against 64.2–69.8 every 20 ms — the in-process speed (67.8–70.2
    that hour) — and Bastion 151–167 against 168–182 on the code prompt. A new event then waits at most
    ``poll_s`` to start. The attributes are Gradio's own (no public setting exists); a Gradio without
    them is left as it is.
    """
    queue = getattr(demo, "_queue", None)
    for name in ("sleep_when_free", "progress_update_sleep_when_free"):
        value = getattr(queue, name, None)
        if isinstance(value, (int, float)):
            setattr(queue, name, max(value, poll_s))


def launch(demo: gr.Blocks, host: str | None = None, port: int | None = None, **kwargs):
    """Serve the app; host/port None defer to GRADIO_SERVER_NAME/PORT (set by Spaces), else 127.0.0.1:7860."""
    return demo.launch(server_name=host, server_port=port, max_file_size=MAX_UPLOAD, footer_links=["api", "gradio"], css=CSS,
                       run_history=False, state_session_capacity=100,  # a run can hold a few MB
                       **kwargs)
