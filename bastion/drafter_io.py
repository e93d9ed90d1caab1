"""Saving and loading drafters as folders in the published DFlash layout (``config.json`` +
``model.safetensors``), local or from the hub, checked against their target before any weights move."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .drafter import DFlashDrafter, DrafterConfig, check_draft_vocab
from .files import staged_folder

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def save_drafter(drafter: DFlashDrafter, folder, dtype: torch.dtype | None = None, carry: tuple[Path, ...] = ()) -> None:
    """Write config.json + model.safetensors (DFlash layout); written to a temp folder, then renamed.
    ``carry``: files copied into the folder beside them (``fit --export`` carries its ``--init``
    folder's datastore, so an exported folder drafts with all three sources, as the shipped one)."""
    from safetensors.torch import save_file

    with staged_folder(Path(folder), ".drafter-") as tmp:
        for path in carry:
            shutil.copyfile(path, tmp / Path(path).name)
        state = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).contiguous().cpu()
                 for k, v in drafter.state_dict().items() if not k.startswith("rotary.")}
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(drafter.cfg.to_hf_dict(), indent=2))
        tmp.chmod(0o755)  # mkdtemp makes it private; a saved model is an ordinary folder
        (tmp / WEIGHTS_FILE).chmod(0o644)


def _hub_like(name_or_path) -> bool:
    """Whether a name that is no local folder could be a hub repo id (owner/name, not a path)."""
    name = str(name_or_path)
    return "/" in name and not name.startswith((".", "/"))


def resolve_drafter_folder(name_or_path, local_files_only: bool = False):
    """A local folder as is; otherwise a hub repo id fetched with huggingface_hub (network needed)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    if local_files_only or not _hub_like(name_or_path):
        raise FileNotFoundError(f"drafter folder {name_or_path} does not exist")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors"]))


def drafter_files(folder: Path) -> tuple[Path, Path]:
    """(config, weights) of a drafter folder; FileNotFoundError naming the first one missing."""
    paths = (folder / CONFIG_FILE, folder / WEIGHTS_FILE)
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"drafter folder {folder} has no {p.name}")
    return paths


def precheck_local_drafter(name_or_path: str | None) -> None:
    """Raise FileNotFoundError now for a named local drafter folder that is missing or lacks a file, so
    a command fails before loading its target (seconds) rather than after; hub ids pass (they resolve,
    and are checked, when the drafter loads)."""
    if name_or_path is not None and (Path(name_or_path).exists() or not _hub_like(name_or_path)):
        drafter_files(resolve_drafter_folder(name_or_path, local_files_only=True))


def check_compatible(cfg: DrafterConfig, target_hidden: int, target_vocab: int, target_layers: int) -> None:
    """Raise ValueError naming the first mismatch between a drafter config and its target."""
    if cfg.hidden_size != target_hidden:
        raise ValueError(f"drafter hidden_size {cfg.hidden_size} != target hidden size {target_hidden}")
    if cfg.vocab_size != target_vocab:
        raise ValueError(f"drafter vocab_size {cfg.vocab_size} != target vocabulary {target_vocab}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target_layers]
    if bad:
        raise ValueError(f"drafter target_layer_ids {bad} out of range for a {target_layers}-layer target")
    if not 0 <= cfg.mask_token_id < target_vocab:
        raise ValueError(f"drafter mask_token_id {cfg.mask_token_id} outside the vocabulary ({target_vocab})")
    if cfg.block_size < 2:
        raise ValueError(f"drafter block_size {cfg.block_size} must be at least 2")
    if cfg.draft_vocab_size is not None and not 1 <= cfg.draft_vocab_size <= target_vocab:
        raise ValueError(f"drafter draft_vocab_size {cfg.draft_vocab_size} outside [1, {target_vocab}]")
    if not 0 <= cfg.refine_passes <= cfg.block_size - 2:
        raise ValueError(f"drafter refine_passes {cfg.refine_passes} outside [0, block_size − 2 = {cfg.block_size - 2}]")


def load_drafter(name_or_path, target_hidden: int, target_vocab: int, target_layers: int,
                 dtype: torch.dtype = torch.float32, device="cpu", local_files_only: bool = False) -> DFlashDrafter:
    """Load a DFlash-layout folder (or hub id), checking it against the target before any weights move."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg_path, w_path = drafter_files(resolve_drafter_folder(name_or_path, local_files_only))
    try:
        cfg = DrafterConfig.from_hf_dict(json.loads(cfg_path.read_text()))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg_path} is not valid JSON: {exc}") from None
    check_compatible(cfg, target_hidden, target_vocab, target_layers)
    try:
        state = load_file(str(w_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{w_path} is not a readable safetensors file: {exc}") from None
    # Some exports prefix every name with "model."; the layout is otherwise the same.
    state = {k.removeprefix("model."): v for k, v in state.items()}
    drafter = DFlashDrafter(cfg)
    expected = {k for k in drafter.state_dict() if not k.startswith("rotary.")}
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"{w_path} does not match its config: missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}")
    for k, v in state.items():
        ref = drafter.state_dict()[k]
        if tuple(v.shape) != tuple(ref.shape):
            raise ValueError(f"{w_path}: tensor {k} has shape {tuple(v.shape)}, config implies {tuple(ref.shape)}")
    if "draft_vocab" in state:
        try:
            check_draft_vocab(state["draft_vocab"], cfg.vocab_size)
        except ValueError as exc:
            raise ValueError(f"{w_path}: {exc}") from None
    drafter.load_state_dict(state, strict=False)
    return drafter.to(device=device, dtype=dtype).eval()
