"""What the roofline needs to know: the target's shape and the device's peak rates.

For s tree tokens verified at context length c on a model with L layers, hidden h, n_q query heads,
n_kv key/value heads of size d (h_q = n_q·d, h_kv = n_kv·d), FFN width f and vocabulary V:

    FLOPs(s, c) = L·[2sh·h_q + 4sh·h_kv + 4s(c+s)·h_q + 2s·h_q·h + 6sh·f] + 2shV
    Bytes(s, c) = b·W + b·L·(2c·h_kv + 2s·h_kv) + b·[L·s·(6h + 3f) + L·n_q·s·(c+s) + sV]

(W = parameter count, b = bytes per element; the last bracket is activation traffic.) A device is
its peak matrix rate F for the dtype in use and its memory bandwidth B: data-sheet numbers for the
GPUs in :data:`KNOWN_DEVICES`, a short measurement anywhere else (:func:`measure_device`).
:mod:`bastion.latency` turns these into a calibrated prediction.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelSpec:
    """The shape numbers the roofline needs, read from a transformers config."""

    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    params: int
    bytes_per_elem: int

    @classmethod
    def from_config(cls, config, params: int | None = None, dtype: torch.dtype = torch.float32) -> "ModelSpec":
        h, nq = config.hidden_size, config.num_attention_heads
        d = getattr(config, "head_dim", None) or h // nq
        L, f, V = config.num_hidden_layers, config.intermediate_size, config.vocab_size
        nkv = getattr(config, "num_key_value_heads", None) or nq
        if params is None:  # embeddings + attention + MLP + norms (tied LM head counted once)
            params = V * h + L * (h * nq * d * 2 + h * nkv * d * 2 + 3 * h * f + 2 * h) + h
            if not getattr(config, "tie_word_embeddings", False):
                params += V * h
        return cls(L, h, nq, nkv, d, f, V, int(params), torch.tensor([], dtype=dtype).element_size())

    def flops(self, s: int, c: int) -> float:
        h, hq, hkv = self.hidden, self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = 2 * s * h * hq + 4 * s * h * hkv + 4 * s * (c + s) * hq + 2 * s * hq * h + 6 * s * h * self.ffn
        return float(self.layers * per_layer + 2 * s * h * self.vocab)

    def bytes(self, s: int, c: int) -> float:
        hkv = self.kv_heads * self.head_dim
        kv = self.layers * (2 * c * hkv + 2 * s * hkv)
        act = self.layers * s * (6 * self.hidden + 3 * self.ffn) + self.layers * self.q_heads * s * (c + s) + s * self.vocab
        return float(self.bytes_per_elem * (self.params + kv + act))


@dataclass(frozen=True)
class HardwareSpec:
    """Peak matrix rate (FLOP/s) for the dtype in use and memory bandwidth (bytes/s)."""

    name: str
    flops: float
    bandwidth: float


# Dense peak rates (bf16/fp16 tensor cores; fp32 without TF32) and HBM bandwidth, vendor data sheets.
KNOWN_DEVICES: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp32": 67e12, "bandwidth": 4.8e12},
    "H100": {"bf16": 989e12, "fp32": 67e12, "bandwidth": 3.35e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12, "bandwidth": 1.94e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12, "bandwidth": 0.864e12},
    "L4": {"bf16": 121e12, "fp32": 30.3e12, "bandwidth": 0.3e12},
    "A10G": {"bf16": 125e12, "fp32": 31.2e12, "bandwidth": 0.6e12},
    "RTX 4090": {"bf16": 165e12, "fp32": 82.6e12, "bandwidth": 1.008e12},
}


def known_device(name: str, dtype: torch.dtype = torch.bfloat16) -> HardwareSpec:
    for key, spec in KNOWN_DEVICES.items():
        if key.lower() in name.lower():
            rate = spec["fp32"] if dtype == torch.float32 else spec["bf16"]
            return HardwareSpec(key, rate, spec["bandwidth"])
    raise KeyError(f"no known spec for device {name!r}; known: {', '.join(KNOWN_DEVICES)}")


_MEASURED: dict[tuple[str, str], HardwareSpec] = {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_device(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> HardwareSpec:
    """Peak rate from one square matrix product and bandwidth from one large copy (best of 3).

    Takes well under a second; cached per (device, dtype) for the life of the process.
    """
    device = torch.device(device)
    key = (str(device), str(dtype))
    if key in _MEASURED:
        return _MEASURED[key]
    n = 1024 if device.type == "cpu" else 4096
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    src = torch.empty(32 * 2**20 if device.type == "cpu" else 256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best_mm = best_cp = math.inf
    torch.mm(a, b)
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        t1 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        t2 = time.perf_counter()
        best_mm, best_cp = min(best_mm, t1 - t0), min(best_cp, t2 - t1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
    spec = HardwareSpec(name, 2 * n**3 / best_mm, 2 * src.numel() / best_cp)  # a copy reads and writes
    _MEASURED[key] = spec
    return spec


def hardware_for(device: torch.device | str, dtype: torch.dtype) -> HardwareSpec:
    """A known data-sheet spec for a recognised GPU, otherwise a short measurement."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return known_device(torch.cuda.get_device_name(device), dtype)
        except KeyError:
            pass
    return measure_device(device, dtype)
