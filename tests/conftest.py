"""Shared test setup: markers, and Triton's interpreter on machines without a GPU.

TRITON_INTERPRET must be set before anything imports triton, so it is set here, at the top of the
first module pytest loads; the library itself never reads environment variables.
"""

import os

# Tests use tiny models: one thread each avoids OpenMP oversubscription when several test
# processes (or a training job) share the machine's two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
