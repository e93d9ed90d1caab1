"""The app in a real browser (Debian's Chromium through Playwright), on tiny random models.

Run as a script with the real embedded model to refresh the README screenshots:

    nice -n 15 .venv/bin/python tests/test_app_browser.py --screenshots assets
"""

import argparse
import socket
import sys
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync"]
TIMEOUT_MS = 300_000  # waits that end as soon as the page is ready; generous for a busy shared machine
pytestmark = pytest.mark.browser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(runtime):
    from app.ui import create_app, launch

    demo = create_app(runtime)
    _, url, _ = launch(demo, "127.0.0.1", free_port(), prevent_thread_lock=True, quiet=True)
    return demo, url


def open_browser(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)


def run_prompt(page, prompt: str, timeout_ms: int) -> None:
    """Type a prompt, press Run, wait until the tree is drawn and the run has finished."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.fill("#prompt textarea", prompt)
    for attempt in range(3):
        # a click that lands before the page's event handlers are connected does nothing (seen once
        # per few runs on a loaded machine, then the wait below hung): click again if nothing started
        page.click("#run-btn")
        try:
            page.wait_for_function("/running|measuring|finished|stopped/.test(document.querySelector('#stats')"
                                   "?.innerText || '')", timeout=20000)
            break
        except PlaywrightTimeout:
            if attempt == 2:
                raise
    page.wait_for_selector("#tree-plot .js-plotly-plot .scatterlayer .points path", timeout=timeout_ms)
    page.wait_for_function("document.querySelector('#stats')?.innerText.includes('status: finished')",
                           timeout=timeout_ms)


def open_calibration(page) -> None:
    """Unfold the (closed) calibration accordion and wait for its plot."""
    page.get_by_text("Drafter calibration: confidence vs acceptance").click()
    page.wait_for_selector("#calibration-plot .js-plotly-plot .scatterlayer .points path", timeout=TIMEOUT_MS)


PLOT_PAIRS = (("tree", "gain"), ("speed", "stages"), ("latency", "cost"))


def stacked_js(upper: str, lower: str) -> str:
    """A JS expression: plot ``lower`` starts below the bottom of plot ``upper`` (ids without '-plot')."""
    return (f"document.querySelector('#{lower}-plot').getBoundingClientRect().top >= "
            f"document.querySelector('#{upper}-plot').getBoundingClientRect().bottom")


def stacked(page, upper: str, lower: str) -> bool:
    return page.evaluate(stacked_js(upper, lower))


def tree_title(page) -> str:
    return page.locator("#tree-plot .gtitle").first.text_content()


def scrub_to(page, index: int) -> None:
    page.locator("#scrubber input[type=range]").fill(str(index))
    page.wait_for_function(f"document.querySelector('#tree-plot .gtitle')?.textContent.startsWith('Round {index}:')",
                           timeout=TIMEOUT_MS)


@pytest.fixture(scope="module")
def tiny_app():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent: install Debian's chromium to run the browser tests")
    pytest.importorskip("playwright")
    from test_app_api import tiny_runtime

    runtime = tiny_runtime()
    forward = runtime.engine.target.forward_tree

    def paced(*args, **kwargs):  # ~15 ms a round, so a 512-token run outlasts the Stop click on any machine
        time.sleep(0.015)
        return forward(*args, **kwargs)

    runtime.engine.target.forward_tree = paced
    demo, url = serve(runtime)
    yield url
    demo.close()


def test_page_runs_a_prompt_and_scrubs_rounds(tiny_app, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = open_browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(tiny_app, wait_until="load")
        page.wait_for_selector("#run-btn", timeout=TIMEOUT_MS)
        page.click("#run-btn")  # empty prompt: a message in the page, no run
        page.wait_for_function("document.querySelector('#message')?.innerText.includes('Please enter a prompt')",
                               timeout=TIMEOUT_MS)
        run_prompt(page, "hello browser", TIMEOUT_MS)
        assert page.locator("#output-text span.tok").count() > 0
        assert "round" in page.locator("#output-text span.tok").first.get_attribute("title")
        last = int(page.locator("#scrubber input[type=number]").input_value())
        assert last >= 1 and tree_title(page).startswith(f"Round {last}:")
        page.screenshot(path=str(tmp_path / "after_run.png"), full_page=True)
        assert not any(stacked(page, a, b) for a, b in PLOT_PAIRS)  # side by side on a wide page
        assert "speedup" in page.locator("#speed-plot .gtitle").first.text_content()
        open_calibration(page)
        assert "Drafter calibration" in page.locator("#calibration-plot .gtitle").first.text_content()
        scrub_to(page, 0)
        page.locator("#tree-plot").screenshot(path=str(tmp_path / "round0_tree.png"))
        page.click("#export-btn")
        page.wait_for_selector("#export-file a", timeout=TIMEOUT_MS)
        bad = tmp_path / "foreign.json"
        bad.write_text('{"hello": "world"}')
        with page.expect_file_chooser() as chooser:
            page.click("#upload-btn")
        chooser.value.set_files(str(bad))
        page.wait_for_function("document.querySelector('#message')?.innerText.includes('Cannot load')",
                               timeout=TIMEOUT_MS)
        assert tree_title(page).startswith("Round 0:")  # the bad file changed nothing
        page.screenshot(path=str(tmp_path / "after_bad_upload.png"), full_page=True)
        # on a phone-wide page the plots of a row stack and the run table keeps one line per cell
        page.set_viewport_size({"width": 420, "height": 900})
        page.wait_for_function(stacked_js("tree", "gain"), timeout=10000)  # the page has re-flowed
        assert all(stacked(page, a, b) for a, b in PLOT_PAIRS)
        header = page.locator("#stats th").first.bounding_box()
        assert header["height"] < 3 * page.locator("#stats td").first.bounding_box()["height"]
        assert page.evaluate("getComputedStyle(document.querySelector('#stats th')).whiteSpace") == "nowrap"
        page.screenshot(path=str(tmp_path / "narrow.png"), full_page=True)
        browser.close()
    assert all((tmp_path / f).stat().st_size > 10000 for f in ("after_run.png", "round0_tree.png", "narrow.png"))


def test_stop_cancels_and_the_session_stays_usable(tiny_app, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = open_browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(tiny_app, wait_until="load")
        page.wait_for_selector("#run-btn", timeout=TIMEOUT_MS)
        page.locator("#max-new-tokens input[type=number]").fill("512")
        page.locator("#max-new-tokens input[type=number]").press("Enter")
        page.locator("#baseline input[type=checkbox]").uncheck()  # straight to the strategy's rounds
        page.fill("#prompt textarea", "a long one")
        page.click("#run-btn")
        page.wait_for_function("document.querySelector('#stats')?.innerText.includes('running')", timeout=TIMEOUT_MS)
        page.click("#stop-btn")
        page.wait_for_function("document.querySelector('#message')?.innerText.includes('Stopped')", timeout=TIMEOUT_MS)
        assert "status: stopped" in page.inner_text("#stats")
        page.screenshot(path=str(tmp_path / "stopped.png"), full_page=True)
        page.locator("#max-new-tokens input[type=number]").fill("8")
        page.locator("#max-new-tokens input[type=number]").press("Enter")
        run_prompt(page, "short one", TIMEOUT_MS)  # the same session runs again
        assert page.inner_text("#message").strip() == ""
        browser.close()


# ----------------------------------------------------------------------------- README screenshots
def shrink_png(path: Path, limit: int = 400_000) -> None:
    """Quantise to a 256-colour palette (and halve if still too big): plots survive it well."""
    from PIL import Image

    img = Image.open(path).convert("RGB")
    while True:
        img.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
        if path.stat().st_size <= limit:
            return
        img = img.resize((img.width * 3 // 4, img.height * 3 // 4), Image.Resampling.LANCZOS)


def widest_round(page) -> int:
    """The round to show: the largest tree among those that accepted at least two draft tokens (a
    tree with branches and rejected nodes teaches more than a straight accepted chain), read off
    the tree plot's title round by round; the first such round on a tie."""
    import re

    rounds = int(page.locator("#scrubber input[type=range]").get_attribute("max"))
    best = (False, 0, 0)
    for i in range(rounds + 1):
        scrub_to(page, i)
        nodes, accepted = map(int, re.search(r"tree of (\d+) nodes?, (\d+) accepted", tree_title(page)).groups())
        best = max(best, (accepted >= 2, nodes, -i))
    return -best[2]


def screenshots(folder: Path, prompt: str) -> None:
    """A real run with the embedded model (Bastion if the drafter is there, else AR)."""
    from playwright.sync_api import sync_playwright

    from app.engine_glue import Runtime

    runtime = Runtime.load()
    runtime.warmup()
    demo, url = serve(runtime)
    with sync_playwright() as p:
        browser = open_browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url, wait_until="load")
        page.wait_for_selector("#run-btn", timeout=TIMEOUT_MS)
        run_prompt(page, prompt, 600000)
        scrub_to(page, widest_round(page))
        page.screenshot(path=str(folder / "screenshot_app.png"), full_page=True)
        names = ["screenshot_app.png"]
        if runtime.has_drafter:  # an AR round's "tree" is one root and its bonus: not worth a picture
            page.locator("#tree-plot").screenshot(path=str(folder / "screenshot_tree.png"))
            open_calibration(page)
            page.locator("#calibration-plot").screenshot(path=str(folder / "screenshot_calibration.png"))
            names += ["screenshot_tree.png", "screenshot_calibration.png"]
        browser.close()
    demo.close()
    for name in names:
        shrink_png(folder / name)
        print(folder / name, (folder / name).stat().st_size, "bytes")


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
    ap = argparse.ArgumentParser()
    ap.add_argument("--screenshots", type=Path, required=True, help="folder to write the PNGs into")
    ap.add_argument("--prompt", default="Why do leaves change color in autumn?")
    a = ap.parse_args()
    screenshots(a.screenshots, a.prompt)
