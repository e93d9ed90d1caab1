#!/usr/bin/env bash
# GPU check of the Triton verification kernels, in one short call on a CUDA machine:
#   1. tests/test_kernels.py and tests/test_gpu.py on the GPU (compiled Triton vs the torch
#      references; every strategy equal to AR and one sampled stream for all strategies on CUDA;
#      a live-feature training run),
#   2. scripts/gpu_kernel_bench.py: every kernel timed against its torch reference at
#      n in {16, 64, 256}, V in {49152, 151936}; prints a markdown table, fails on a mismatch.
# Usage: scripts/gpu_check.sh   (PYTHON=/path/to/python to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

has_cuda() { "$1" -c 'import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
else
    PY=""
    for candidate in .venv/bin/python python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 && has_cuda "$candidate"; then PY="$candidate"; break; fi
    done
fi
if [[ -z "$PY" ]] || ! has_cuda "$PY"; then
    echo "gpu_check: no python with CUDA torch and triton found (set PYTHON=...)" >&2
    exit 2
fi
# The kernels must be compiled here, not interpreted.
unset TRITON_INTERPRET

"$PY" - <<'EOF'
import torch, triton
print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
EOF

echo "== kernel and engine tests on CUDA =="
status=0
timeout 200 "$PY" -m pytest tests/test_kernels.py tests/test_gpu.py -q -p no:cacheprovider || status=1

echo "== kernel timings =="
timeout 60 "$PY" scripts/gpu_kernel_bench.py --iters 10 --repeats 3 || status=1
exit $status
