"""Session state and run files: a run is one JSON-able dict, the only thing a session keeps.

    {"format": "bastion-run", "version": 1, "created": ISO time,
     "prompt": str, "prompt_tokens": int, "settings": {strategy, budget, temperature, top_p, ...},
     "model": Runtime.model_info() (specs the what-if panel re-plans with),
     "baseline": [AR step records measured just before, same prompt and settings],
     "steps": [step records of the chosen strategy],
     "status": "running" | "finished" | "stopped" | "failed", "message": str}

Step records are described in app.engine_glue. The same dict is exported as JSON and, once
validated, imported to replay a run with no model loaded.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from bastion.records import Step
from bastion.hardware import HardwareSpec, ModelSpec

FORMAT, VERSION = "bastion-run", 1
STAGES = ("draft", "build", "verify", "commit")
MAX_IMPORT_BYTES = 20 * 2**20
EXPORT_DIR = Path(tempfile.gettempdir()) / "bastion-app"


def new_run(prompt: str, prompt_tokens: int, settings: dict, model_info: dict) -> dict:
    return {"format": FORMAT, "version": VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "prompt": prompt, "prompt_tokens": prompt_tokens, "settings": dict(settings), "model": model_info,
            "baseline": [], "steps": [], "status": "running", "message": ""}


def baseline_key(run: dict) -> list:
    """What the AR baseline depends on; the strategy and its tree budget do not matter to AR."""
    s = run["settings"]
    return [run["model"].get("name"), run["prompt"], s.get("temperature"), s.get("top_p"),
            s.get("max_new_tokens"), s.get("seed")]


def reusable_baseline(previous: dict | None, run: dict) -> list[dict]:
    """A complete AR baseline this session already measured for the same prompt and settings."""
    if not previous or not previous.get("baseline") or not previous["baseline"][-1].get("finished"):
        return []
    return previous["baseline"] if baseline_key(previous) == baseline_key(run) else []


def clock(record: dict) -> float:
    """Decode seconds so far: the engine-only clock when recorded, the engine's wall clock otherwise."""
    return float(record.get("clock_s", record.get("elapsed_s", 0.0)))


def summarize(records: list[dict]) -> dict | None:
    """Tokens, rounds, τ (bonus included), tokens/s over decode time, seconds per stage."""
    if not records:
        return None
    tokens = sum(len(r["tokens"]) for r in records)
    decode_s = clock(records[-1])
    errs = [abs(r["predicted_verify_s"] - r["measured_verify_s"]) / r["measured_verify_s"]
            for r in records if r["measured_verify_s"] > 0]
    return {"strategy": records[0]["strategy"], "tokens": tokens, "rounds": len(records),
            "tau": tokens / len(records), "decode_s": decode_s,
            "tokens_per_s": tokens / decode_s if decode_s > 0 else 0.0,
            "prefill_s": records[0].get("prefill_s", 0.0), "finish_reason": records[-1].get("finish_reason", ""),
            "stage_s": {k: sum(r["times"][k] for r in records) for k in STAGES},
            "mean_tree_size": statistics.fmean(len(r["tree"]["tokens"]) for r in records),
            "latency_error": statistics.median(errs) if errs else None}


def run_summary(run: dict) -> dict:
    """Both runs' summaries, the measured speedup, and whether T = 0 output matched AR token for token."""
    main, base = summarize(run["steps"]), summarize(run["baseline"])
    out = {"status": run["status"], "main": main, "baseline": base, "speedup": None, "identical_to_ar": None}
    if main and base and base["tokens_per_s"] > 0:
        out["speedup"] = main["tokens_per_s"] / base["tokens_per_s"]
        if run["settings"].get("temperature", 0) == 0 and run["steps"][-1].get("finished") \
                and run["baseline"][-1].get("finished"):
            out["identical_to_ar"] = token_ids(run["steps"]) == token_ids(run["baseline"])
    return out


def token_ids(records: list[dict]) -> list[int]:
    return [t for r in records for t in r["tokens"]]


def text_of(records: list[dict], sep: str = "") -> str:
    return sep.join(t for r in records for t in r["token_texts"])


# ----------------------------------------------------------------------------- files
def export_run(run: dict, folder: Path = EXPORT_DIR) -> str:
    """Write the run to a fresh JSON file and return its path (one file per export: no clobbering)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"bastion-run-{run['created'].replace(':', '')}-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps(run, separators=(",", ":")))
    return str(path)


def load_run(path: str | Path) -> dict:
    """Read and validate a run file; every problem becomes a ValueError with a readable message."""
    path = Path(path)
    if path.stat().st_size > MAX_IMPORT_BYTES:
        raise ValueError(f"the file is larger than {MAX_IMPORT_BYTES // 2**20} MB")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a JSON file ({exc.__class__.__name__}: {exc})") from None
    return validate_run(data)


def validate_run(data) -> dict:
    """Check structure and types deeply enough that every figure can be drawn from the result."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("this JSON is not a Bastion run export (no \"format\": \"bastion-run\")")
    if data.get("version") != VERSION:
        raise ValueError(f"unsupported run file version {data.get('version')!r} (this app reads {VERSION})")
    for key, kind in (("steps", list), ("baseline", list), ("settings", dict), ("model", dict)):
        if not isinstance(data.get(key), kind):
            raise ValueError(f"run file field {key!r} is missing or not a {kind.__name__}")
    if not data["steps"]:
        raise ValueError("the run has no rounds to show")
    try:
        ModelSpec(**data["model"]["spec"])
        HardwareSpec(**data["model"]["hardware"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"run file has no usable model/hardware spec ({exc})") from None
    for phase in ("baseline", "steps"):
        for i, rec in enumerate(data[phase]):
            try:
                _check_record(rec)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"{phase} round {i} is malformed: {exc}") from None
    if data.get("calibration") is not None:
        try:
            _check_calibration(data["calibration"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"run file field 'calibration' is malformed: {exc}") from None
    data.setdefault("prompt", "")
    data["status"] = str(data.get("status", "finished"))
    data.setdefault("message", "")
    return data


def _check_calibration(cal: dict) -> None:
    float(cal.get("temperature", 0.0))
    if cal.get("path_scale") is not None and not 0.0 < float(cal["path_scale"]) <= 1.0:
        raise ValueError(f"path_scale must lie in (0, 1], got {cal['path_scale']}")
    qs = [float(q) for q in cal["qs"]]
    for p in cal["points"]:
        int(p["depths_from"]), float(p["q"]), float(p["rate"]), float(p["count"])
    for first, curve in cal["curves"].items():
        int(first)
        if len(curve) != len(qs):
            raise ValueError(f"curve of depth {first} has {len(curve)} values for {len(qs)} q's")
        [float(g) for g in curve]


def _check_record(rec: dict) -> None:
    step = Step.from_dict(rec)  # validates the tree and every field's type
    n = len(step.tree)
    if not step.accepted or step.accepted[0] != 0 or any(not 0 <= a < n for a in step.accepted):
        raise ValueError("accepted nodes must start at the root and lie in the tree")
    if len(step.choices) != n:
        raise ValueError(f"{len(step.choices)} target choices for {n} nodes")
    if len(step.token_texts) != len(step.tokens):
        raise ValueError("token_texts and tokens differ in length")
    if not isinstance(rec.get("texts", {}), dict):
        raise ValueError("texts must map token ids to strings")
    if "calib" in rec:
        for key in ("compute", "memory"):
            float(rec["calib"][key]["alpha"]), float(rec["calib"][key]["beta"])
        padded = rec["calib"].get("padded", [])
        if not isinstance(padded, list) or any(not isinstance(m, int) or m < n for n, m in enumerate(padded, 1)):
            raise ValueError("calib.padded must list, for n = 1, 2, ..., a row count >= n")
    for key in ("clock_s", "overhead_s", "root_cost_s"):
        if key in rec:
            float(rec[key])
