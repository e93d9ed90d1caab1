"""The repository stays small: no large binaries beyond the shipped drafter, and room left for a GPU call.

A call to a lent GPU machine sends the whole working tree plus what it carries, 64 MiB in all, and
``scripts/gpu_payload.py`` needs room beside the tree for the wheels, the data and the embedded GGUF
in pieces. Benchmark folders accumulate session after session; this fails before they crowd it out.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREE_LIMIT_MIB = 48  # leaves 16 MiB per GPU call for the payload
FILE_LIMIT_MIB = 20  # the drafter's weights (16.1 MiB) are the one large file


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def test_tracked_files_leave_room_for_a_gpu_call():
    sizes = {p: p.stat().st_size for p in tracked_files()}
    total = sum(sizes.values()) / 2**20
    biggest = sorted(sizes, key=sizes.get, reverse=True)[:5]
    assert total <= TREE_LIMIT_MIB, (
        f"tracked files weigh {total:.1f} MiB (limit {TREE_LIMIT_MIB}): prune or compress old bench/ folders; "
        f"largest: {', '.join(f'{p.relative_to(ROOT)} {sizes[p] / 2**20:.1f} MiB' for p in biggest)}")


def test_no_large_file_but_the_drafter():
    files = tracked_files()
    big = [f"{p.relative_to(ROOT)} ({p.stat().st_size / 2**20:.1f} MiB)" for p in files
           if p.stat().st_size > FILE_LIMIT_MIB * 2**20]
    assert not big, f"files over {FILE_LIMIT_MIB} MiB: {', '.join(big)}"
    uncompressed_logs = [str(p.relative_to(ROOT)) for p in files if p.name == "rounds.csv"]
    assert not uncompressed_logs, f"commit per-round logs as rounds.csv.gz (bastion/report.py): {uncompressed_logs}"
