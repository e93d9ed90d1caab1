"""Verification kernels behind one dispatcher.

``get_kernels("auto", device)`` returns the Triton implementation on CUDA when Triton imports and
the torch reference otherwise; "torch" and "triton" pin a backend (tests run "triton" on the CPU
under Triton's interpreter, which the *caller* enables by setting TRITON_INTERPRET=1 before
anything imports triton).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import reference

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class Kernels:
    """The three verification operations of one backend (signatures as in :mod:`.reference`)."""

    name: str
    node_choice: Callable[..., torch.Tensor]
    tree_walk: Callable[..., tuple[list[int], int]]
    tree_mask: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    filter_thresholds: Callable[..., torch.Tensor | None] = reference.filter_thresholds
    # node_choice takes noise= (a request's reference.GumbelRows): a backend that materialises the
    # noise reuses rows across rounds; one that hashes in registers (Triton) has nothing to reuse
    reuses_noise: bool = False


TORCH = Kernels("torch", reference.node_choice_torch, reference.tree_walk_torch, reference.tree_mask_torch,
                reuses_noise=True)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # triton missing or broken: fall back, the caller asked for "auto"
        return False
    return True


def get_kernels(backend: str = "auto", device: torch.device | str = "cpu") -> Kernels:
    """Pick a backend: "auto" = Triton on CUDA when available, else torch."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "torch" or (backend == "auto" and (device.type != "cuda" or not triton_available())):
        return TORCH
    if not triton_available():
        raise RuntimeError("kernel backend 'triton' requested but triton cannot be imported")
    from . import triton_kernels  # imported lazily: importing triton is slow and optional

    triton_kernels.launch_device(device)  # CPU data without a GPU or the interpreter: fail here, not mid-run
    return triton_kernels.KERNELS
