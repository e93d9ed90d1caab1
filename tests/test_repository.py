"""The repository stays small and readable: no large binaries beyond the shipped drafter, room left for a
GPU call, and modules and functions of the sizes ../shared/STYLE.md asks for.

A call to a lent GPU machine sends the whole working tree plus what it carries, 64 MiB in all, and
``scripts/gpu_payload.py`` needs room beside the tree for the wheels, the data and the embedded GGUF
in pieces. Benchmark folders accumulate session after session; this fails before they crowd it out.
"""

import ast
import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREE_LIMIT_MIB = 48  # leaves 16 MiB per GPU call for the payload
FILE_LIMIT_MIB = 20  # the drafter's weights (16.1 MiB) are the one large file
MODULE_LINES = 420  # STYLE: files under ~400 lines and functions under ~60
FUNCTION_LINES = 65


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



def test_modules_and_functions_stay_short():
    """Library and app code (not tests, benchmarks or scripts): every module and every function short
    enough to read at once; a module that outgrows it is split by what its parts do."""
    sources = sorted([*ROOT.glob("bastion/**/*.py"), *ROOT.glob("app/*.py"), ROOT / "app.py"])
    assert len(sources) > 30
    long_modules, long_functions = [], []
    for path in sources:
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        if len(text.splitlines()) > MODULE_LINES:
            long_modules.append(f"{name} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name} ({size} lines)")
    assert not long_modules, f"modules over {MODULE_LINES} lines: {', '.join(long_modules)}"
    assert not long_functions, f"functions over {FUNCTION_LINES} lines: {', '.join(long_functions)}"


def test_the_readmes_benchmark_tables_are_copied_from_their_runs():
    """Each benchmark table in the README sits under the command that made it, and that command's
    ``--out`` folder holds the same command and, line for line, the same table; the bold figures of the
    "Latest" paragraph are cells of its table. So a new run cannot leave old numbers in the README."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    commands = [i for i, line in enumerate(lines) if line.startswith("- Command: `python -m bastion bench ")]
    assert commands, "the README quotes no benchmark command"
    for i in commands:
        command = lines[i].split("`")[1]
        folder = ROOT / re.search(r"--out (\S+)", command).group(1)
        report = (folder / "results.md").read_text(encoding="utf-8").splitlines()
        assert f"- Command: `{command}`" in report, f"{folder.name}: the README's command is not the run's"
        table = list(itertools.takewhile(lambda s: s.startswith("|"), lines[i + 2:]))
        assert len(table) >= 3 and lines[i + 1] == "", f"no table under the command of {folder.name}"
        stale = [row for row in table if row not in report]
        assert not stale, f"README rows not in {folder.name}/results.md: {stale}"
    start = next(i for i, line in enumerate(lines) if line.startswith("**Latest"))
    table = itertools.takewhile(lambda s: s.startswith("|"), lines[commands[0] + 2:])
    cells = {c.strip() for row in table for c in row.split("|")}
    bold = re.findall(r"\*\*(\d+\.\d+)(?: tok/s|×)?\*\*", " ".join(lines[start:commands[0]]))
    assert bold, "the Latest paragraph names no figures"
    missing = [x for x in bold if x not in cells and f"{x}×" not in cells]
    assert not missing, f"the Latest paragraph's figures not in its table: {missing}"
