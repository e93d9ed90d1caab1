"""Writing a folder all at once: built in a temporary sibling, renamed into place when complete."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged_folder(target: Path, prefix: str) -> Iterator[Path]:
    """Yield a new empty folder beside ``target`` (named ``prefix…``, private as ``mkdtemp`` makes it);
    when the block ends without an error it replaces ``target`` (removed first if it exists). On an
    error the temporary folder is removed and ``target`` stays as it was, so an interrupted writer
    never leaves a half-written folder behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
