"""Pack what a lent GPU machine needs for ``scripts/gpu_train.sh`` into carry folders of at most 64 MiB.

A device call sends the repository (tracked and untracked files) plus the folders it names in
``carry``, 64 MiB in all, and the machine cannot download anything. The embedded target's GGUF alone
is 98 MB, so the payload is split over several calls, each copying its part to the machine's /tmp
while the machine stays warm (30 s between calls). This writes OUT/part1, OUT/part2, ... and prints,
for each, the command of its call (every call but the last only copies; the last assembles and runs).

    python scripts/gpu_payload.py --out .gpu --data data/replay --tree-mib 42

``--tree-mib``: what the repository itself weighs in a call (measure it: tracked and untracked files).
Packed: transformers' and gguf's wheels for the machine's Python 3.12 (pip download), the GGUF in
pieces, the drafter to start from (tar.xz, unless the repository tracks it: the shipped one travels
with the tree) and the data folders as token ids only (tar.xz, features dropped). OUT must be
ignored by git (add it to .git/info/exclude).

Fewer calls: the benchmark folders are most of the tracked tree and the machine needs none of them.
For the lease, take them out of the index and ignore them (``git rm -r -q --cached 'bench/results-*'``
and a line ``/bench/results-*/`` in .git/info/exclude: neither tracked nor untracked-unignored, they
stay behind), measure the tree again, and afterwards restore both (``git reset -q``, the line
removed). Session 43: 46 → 22 MiB of tree, three calls instead of seven.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bastion.embedded import gguf_path  # noqa: E402
from bastion.loading import DEFAULT_DRAFTER  # noqa: E402
from bastion.traindata import load_shards  # noqa: E402

MIB = 1 << 20
WHEELS = ("transformers==5.23.0", "gguf==0.19.0")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64")


def ids_only(folders: list[Path], dest: Path) -> None:
    """Each data folder as one shard of {ids, prompt_len} records and a meta.json with features off."""
    for folder in folders:
        meta = json.loads((folder / "meta.json").read_text())
        records = [{"ids": r["ids"].to(torch.int32).clone(), "prompt_len": int(r["prompt_len"])}
                   for r in load_shards(folder, ids_only=True)]
        out = dest / folder.name
        out.mkdir(parents=True)
        torch.save(records, out / "shard_00000.pt")
        (out / "meta.json").write_text(json.dumps(meta | {"features": False, "prompts": len(records)}))
        print(f"{folder}: {len(records)} sequences", file=sys.stderr)


def _tracked(folder: Path) -> bool:
    """Whether git tracks ``folder``'s files in this repository (then every device call sends them)."""
    out = subprocess.run(["git", "ls-files", "--", str(folder.resolve())], cwd=ROOT, capture_output=True, text=True)
    return out.returncode == 0 and any(line.endswith("model.safetensors") for line in out.stdout.splitlines())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data", type=Path, action="append", required=True, help="data folder (repeatable)")
    ap.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    ap.add_argument("--tree-mib", type=float, required=True, help="the repository's own size in a call")
    a = ap.parse_args()
    if a.out.exists() and any(a.out.iterdir()):
        ap.error(f"{a.out} is not empty")
    tracked = _tracked(a.drafter)
    budget = int((64 - a.tree_mib - 0.5) * MIB)  # half a MiB of slack
    if budget < 8 * MIB:
        ap.error(f"--tree-mib {a.tree_mib}: too little room left in a 64 MiB call")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp",
                        *[x for p in PLATFORMS for x in ("--platform", p)], "-d", str(tmp / "whl"), *WHEELS],
                       check=True)
        ids_only(a.data, tmp / "ids")
        small = []  # (name, path): files that must arrive before the last call
        packed = [("ids.tar.xz", tmp / "ids")]
        if not tracked:  # a drafter in the repository travels with the tree (gpu_setup_run.sh)
            packed.append(("drafter.tar.xz", a.drafter))
        for name, src in packed:
            with tarfile.open(tmp / name, "w:xz") as tar:
                tar.add(src, arcname="ids" if name == "ids.tar.xz" else "drafter",
                        filter=lambda t: None if t.name.endswith("datastore.safetensors") else t)
            small.append((name, tmp / name))
        small += [(w.name, w) for w in sorted((tmp / "whl").glob("*.whl"))]
        gguf = gguf_path().read_bytes()
        parts: list[list[tuple[str, bytes]]] = [[]]
        room = budget
        for name, path in small:  # the small files first, then the GGUF fills what is left, in pieces
            data = path.read_bytes()
            if len(data) > room:
                parts.append([])
                room = budget
            parts[-1].append((name, data))
            room -= len(data)
        piece = 0
        while gguf:
            if room < MIB:
                parts.append([])
                room = budget
            chunk, gguf = gguf[:room], gguf[room:]
            parts[-1].append((f"gguf.{piece:02d}", chunk))
            room -= len(chunk)
            piece += 1
        for i, files in enumerate(parts, 1):
            folder = a.out / f"part{i}"
            folder.mkdir(parents=True)
            for name, data in files:
                (folder / name).write_bytes(data)
            size = sum(len(d) for _, d in files) / MIB
            print(f"{folder}: {len(files)} files, {size:.1f} MiB")
    n = len(parts)
    copy = "mkdir -p /tmp/w && cp {p}/* /tmp/w/"
    print("\ncalls (carry the named folder; issue each within 30 s of the last one's end):")
    for i in range(1, n):
        print(f"  {i}. carry {a.out}/part{i}: {copy.format(p=f'{a.out}/part{i}')}")
    # a tracked drafter is not packed: the last call names it (gpu_setup_run.sh copies it from the tree)
    start = "" if not tracked else f"DRAFTER={a.drafter.resolve().relative_to(ROOT)} "
    print(f"  {n}. carry {a.out}/part{n}: {copy.format(p=f'{a.out}/part{n}')} && "
          f"{start}bash scripts/gpu_setup_run.sh /tmp/w $OUT")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
