"""Building the native CPU kernels: the C sources compiled with the system compiler into a per-user
cache (keyed by the sources, the flags and the CPU's features), and the ctypes signatures of the
library's functions. ``cpu_native`` loads the library and wraps its functions; nothing here runs at
import time."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_gemm.c")
# compiled together into one library: the kernels, the decoder layers that chain them (cpu_layer.c) and
# the sampler's uniform stream (cpu_noise.c)
SOURCES = (SOURCE, Path(__file__).with_name("cpu_layer.c"), Path(__file__).with_name("cpu_noise.c"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-lm"]


def _cpu_flags() -> str:
    # -march=native bakes in the build machine's instruction set: a cache shared between machines
    # (network home directories) must not hand an AVX-512 build to a CPU without it
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16 (``amx_bf16``), by its flags alone (no build). Only then
    does torch's bf16 autocast train faster than float32 on a CPU: without bf16 arithmetic it is
    emulated (a drafter training step ~20 s against ~1 s in float32 on an AVX2 EPYC), and with
    AVX512-BF16 alone its products still run below float32's (1.5 s against 0.77 on a 2-core Xeon,
    session 56)."""
    return "amx_bf16" in set(_cpu_flags().split())


def _cache_dir() -> Path:
    from ..embedded import default_cache_dir

    return default_cache_dir() / "kernels"


def build(cache_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile cpu_gemm.c (once per source, flags and CPU) and return the shared library's path.

    ``extra_flags`` follow ``-march=native`` (``-mno-avx512f`` builds the AVX2 code paths on an
    AVX-512 machine: the tests check every path this CPU can run, not only the one it picks)."""
    cc = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    flags = FLAGS[:2] + list(extra_flags) + FLAGS[2:]
    src = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha1(src + " ".join([cc] + flags).encode() + _cpu_flags().encode()).hexdigest()[:16]
    out_dir = cache_dir or _cache_dir()
    lib = out_dir / f"bastion_gemm_{key}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: a concurrent process never loads a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags[:-1], *map(str, SOURCES), "-o", tmp, flags[-1]], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-500:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the argument and result types of the library's functions (returns ``lib``)."""
    V, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.bastion_pack_f32.argtypes = [V, I64, I64, V, I]
    lib.bastion_pack_f32.restype = None
    lib.bastion_gemm_f32.argtypes = [V, I64, V, I64, I64, V, V, I]
    lib.bastion_gemm_f32.restype = None
    lib.bastion_gemm_panel.restype = I
    lib.bastion_gemm_bf16.argtypes = [V, I64, V, I64, I64, V, V, I]
    lib.bastion_gemm_bf16.restype = None
    lib.bastion_gemm_bf16_available.restype = I
    lib.bastion_gemm_h16.argtypes = [V, I64, V, I64, I64, V, V, I]
    lib.bastion_gemm_h16.restype = None
    for name in ("bastion_gemm_q4", "bastion_gemm_q8"):
        getattr(lib, name).argtypes = [V, I64, V, I64, I64, V, V, I]
        getattr(lib, name).restype = None
    lib.bastion_wide_rows.argtypes = [I, I64]
    lib.bastion_wide_rows.restype = I
    for name in ("bastion_pack_q4", "bastion_pack_q8"):
        getattr(lib, name).argtypes = [V, I64, I64, V, I]
        getattr(lib, name).restype = I64
    lib.bastion_attn_f32.argtypes = [V, I64, I64, V, I64, I64, V, I64, I64, V, I64, V, I64, I64, I64, I64, I64,
                                     ctypes.c_float, I]
    lib.bastion_attn_f32.restype = I
    lib.bastion_move_rows.argtypes = [V, V, V, I64, I64, I64, V, V, I64]
    lib.bastion_move_rows.restype = None
    lib.bastion_rms_norm_f32.argtypes = [V, I64, I64, V, ctypes.c_float, V]
    lib.bastion_rms_norm_f32.restype = None
    lib.bastion_rope_f32.argtypes = [V, I64, I64, I64, V, V, V]
    lib.bastion_rope_f32.restype = None
    lib.bastion_silu_f32.argtypes = [V, I64, I64, V]
    lib.bastion_silu_f32.restype = None
    lib.bastion_decoder_f32.argtypes = [V, I64, V, V, V, V, V, V, V, V, V, V, V, V, V, V, ctypes.c_float, I]
    lib.bastion_decoder_f32.restype = I
    lib.bastion_uniform_rows.argtypes = [V, I64, I64, V]
    lib.bastion_uniform_rows.restype = None
    lib.bastion_uniform_cells.argtypes = [V, I64, V, I64, V]
    lib.bastion_uniform_cells.restype = None
    return lib
