"""Launch the Bastion app: ``python app.py`` serves on 127.0.0.1:7860 (``--host``/``--port`` to change).

On Hugging Face Spaces the file is simply executed; Spaces sets GRADIO_SERVER_NAME/PORT, which
gradio reads when no host or port is given here.
"""

import argparse
import logging

from app.engine_glue import Runtime
from app.ui import create_app, launch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Serve the Bastion demo")
    ap.add_argument("--host", default=None, help="default 127.0.0.1 (or $GRADIO_SERVER_NAME)")
    ap.add_argument("--port", type=int, default=None, help="default 7860 (or $GRADIO_SERVER_PORT)")
    ap.add_argument("--model", default="embedded", help="'embedded', a local HF folder or a hub id")
    ap.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the short warm-up generation (run once the page is served)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        runtime = Runtime.load(a.model, a.device)  # once per process; every session shares it
    except (OSError, ValueError) as exc:  # a bad --model/--device: one line, no traceback, nothing served
        raise SystemExit(f"error: cannot load: {exc}") from None
    demo = create_app(runtime)
    if a.no_warmup:
        launch(demo, a.host, a.port)
        return
    # Serve first, then warm up (the latency probe is most of it): the page answers ~10 s sooner on a
    # 2-core CPU, a run sent meanwhile waits for the warm-up at the runtime's lock, and the probe's
    # timings are not disturbed by the server's own start-up.
    launch(demo, a.host, a.port, prevent_thread_lock=True)
    try:
        runtime.warmup()
    except Exception:  # noqa: BLE001 - the first run then pays the one-time costs itself
        logging.getLogger("app").exception("warm-up failed; serving without it")
    demo.block_thread()


if __name__ == "__main__":
    main()
