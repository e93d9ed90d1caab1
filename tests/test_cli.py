"""The command-line contract, on the embedded SmolLM2 target (slow) and on bad input (fast)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "bastion", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,msg", [
    (["--prompt", "   "], "empty"), (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"), (["--prompt", "hi", "--top-p", "0"], "top_p"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p"), (["--prompt", "hi", "--budget", "0"], "budget"),
    (["--prompt", "hi", "--strategy", "beam"], "unknown strategy"),
    (["--prompt", "hi", "--model", "/no/such/model"], "neither a local folder"),
    (["--prompt", "hi", "--kernels", "cuda"], "kernel backend"),
    (["--prompt", "hi", "--device", "gpu0"], "unknown device"),
    (["--prompt", "hi", "--refine", "-1"], "refine must be >= 0"),
    (["--prompt", "hi", "--strategy", "ar", "--refine", "2"], "only drafting strategies refine"),
])
def test_bad_input_is_one_line_and_exit_2(args, msg, tmp_path):
    trace = tmp_path / "t.jsonl"
    r = cli("generate", *args, "--trace", str(trace), timeout=600)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and msg in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not trace.exists()


@pytest.mark.parametrize("folder,msg", [("/no/such/drafter", "does not exist"), (str(ROOT / "tests"), "has no config.json")])
def test_a_missing_drafter_folder_fails_before_the_target_loads(folder, msg):
    r = cli("generate", "--prompt", "hi", "--drafter", folder)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: cannot load: drafter folder") and msg in r.stderr
    assert "Loading weights" not in r.stderr and "converting" not in r.stderr, r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_a_gpu_request_without_a_gpu_is_one_line_before_any_loading(tmp_path):
    """--device cuda on a CPU-only machine, and the compiled Triton kernels on CPU tensors (no interpreter):
    each a one-line error before the model loads, not a traceback from inside torch or the first round."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for args, msg in ((["--device", "cuda"], "no CUDA GPU is visible"), (["--kernels", "triton"], "Triton kernels need")):
        r = subprocess.run([sys.executable, "-m", "bastion", "generate", "--prompt", "hi", *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and "error:" in r.stderr and msg in r.stderr, r.stderr
        assert "Loading weights" not in r.stderr or args[0] == "--kernels", r.stderr


@pytest.mark.slow
def test_embedded_model_end_to_end(tmp_path):
    trace = tmp_path / "trace.jsonl"
    prompt = "Write a Python function that adds two numbers."
    r = cli("generate", "--prompt", prompt, "--max-new-tokens", "40", "--json", "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("text", "token_ids", "strategy", "steps", "tau", "tokens_per_s", "decode_s"):
        assert key in out
    assert out["strategy"] == "bastion" and out["text"].strip() and 1 <= len(out["token_ids"]) <= 40
    records = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(records) == out["steps"] and records[-1]["finished"]
    assert sum(len(x["tokens"]) for x in records) == len(out["token_ids"])
    ar = json.loads(cli("generate", "--prompt", prompt, "--max-new-tokens", "40", "--json", "--strategy", "ar").stdout)
    assert ar["token_ids"] == out["token_ids"] and ar["tau"] == 1.0
    # the default drafts only the depths its trees reach (at least 8); --full-depth the whole block
    drafted = [len(x["draft_logq"]) for x in records if x.get("draft_logq")]
    assert drafted and drafted[0] == 15 and all(8 <= d <= 15 for d in drafted) and min(drafted) < 15
    # plain output streams the reply's text and, at the stop token, ends without printing it
    plain = cli("generate", "--prompt", prompt, "--max-new-tokens", "40", "--strategy", "ar")
    assert plain.returncode == 0 and plain.stdout.strip() == ar["text"].strip(), (plain.stdout, ar["text"])
    assert "<|im_end|>" not in plain.stdout
    # the one probe of a drafting run is announced on stderr (seconds of silence otherwise); AR has none
    assert "timing this machine's verification costs" in r.stderr
    assert "timing this machine" not in plain.stderr
    full_trace = tmp_path / "full.jsonl"
    full = json.loads(cli("generate", "--prompt", prompt, "--max-new-tokens", "40", "--json", "--full-depth",
                          "--trace", str(full_trace)).stdout)
    assert full["token_ids"] == ar["token_ids"]
    assert all(len(x["draft_logq"]) == 15 for x in map(json.loads, full_trace.read_text().splitlines())
               if x.get("draft_logq"))
    # --node-cost prices the host's per-node work (a GPU's lever): same tokens, as every strategy
    priced = json.loads(cli("generate", "--prompt", prompt, "--max-new-tokens", "40", "--json", "--node-cost").stdout)
    assert priced["token_ids"] == ar["token_ids"]
