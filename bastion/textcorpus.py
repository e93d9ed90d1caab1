"""Offline text as training material for the drafter: chunks of documents every machine has.

Self-distilled replies (``traindata.make_data``) cost a generation each — ~1,600 an hour on two CPU
cores — and the drafter trained on them generalises poorly for want of many more distinct contexts
(bench/NOTES.md, sessions 19–29). Any text gives contexts at the price of one forward: placed as the
assistant's reply to a request, the target's greedy choice after every token is a label (``greedy``
records, ``distill.make_batch``), valid at depth k while the text has followed the target's own
choices through the k − 1 tokens before it.

Sources (:func:`text_files`): files or folders (``*.md``, ``*.rst``, ``*.txt``, ``*.py`` and
``METADATA``), and two names that need no path — ``stdlib`` (the Python standard library's modules)
and ``packages`` (the descriptions of every installed Python distribution, their READMEs).
:func:`text_chunks` cuts them at line ends into pieces of at most ``max_tokens`` tokens, each with a
request that fits its kind of file.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

TEXT_SUFFIXES = (".md", ".rst", ".txt", ".py")
NAMED_SOURCES = ("stdlib", "packages")

# requests per kind of file; {name} is the module, package or document
_REQUESTS = {
    "py": ("Write the Python module {name}.", "Show me Python code for the module `{name}`.",
           "Implement {name} in Python."),
    "readme": ("Write the README of the Python package {name}.", "Describe the Python package {name}.",
               "What is {name} and how do I use it?"),
    "doc": ("Write the document {name}.", "Explain {name}.", "Write documentation about {name}."),
}


@dataclass(frozen=True)
class TextChunk:
    """One piece of a document: the request it answers and its text (at most ``max_tokens`` tokens)."""

    request: str
    text: str
    source: str  # the file it came from (for the data folder's meta, and for reading failures)


def text_files(sources: list[str]) -> list[Path]:
    """The files named by ``sources``: a file itself, a folder's text files (recursively, sorted), or a
    named source (``stdlib``, ``packages``). Raises ValueError for a path that does not exist, and
    when nothing is found at all."""
    files: list[Path] = []
    for src in sources:
        if src == "stdlib":
            root = Path(sysconfig.get_paths()["stdlib"])
            files += [p for p in sorted(root.rglob("*.py"))
                      if not {"test", "tests", "idle_test", "site-packages"} & set(p.relative_to(root).parts)]
        elif src == "packages":
            seen = set()
            for dist in metadata.distributions():
                path = getattr(dist, "_path", None)
                if path is not None and (Path(path) / "METADATA").is_file() and str(path) not in seen:
                    seen.add(str(path))
                    files.append(Path(path) / "METADATA")
            files.sort()
        else:
            p = Path(src)
            if p.is_file():
                files.append(p)
            elif p.is_dir():
                files += [q for q in sorted(p.rglob("*"))
                          if q.is_file() and (q.suffix in TEXT_SUFFIXES or q.name == "METADATA")]
            else:
                raise ValueError(f"text source {src!r}: no such file or folder (or name one of {', '.join(NAMED_SOURCES)})")
    if not files:
        raise ValueError(f"no text files in {', '.join(sources)} (looked for {', '.join(TEXT_SUFFIXES)} and METADATA)")
    return files


def _kind_and_body(path: Path, text: str) -> tuple[str, str, str]:
    """(kind, name, body): a METADATA file's body is its description after the header block."""
    if path.name == "METADATA":
        head, _, body = text.partition("\n\n")
        name = next((line.split(":", 1)[1].strip() for line in head.splitlines() if line.startswith("Name:")),
                    path.parent.name)
        return "readme", name, body
    if path.suffix == ".py":
        return "py", path.stem if path.stem != "__init__" else path.parent.name, text
    return "doc", path.stem.replace("_", " "), text


def text_chunks(files: list[Path], tokenizer, max_tokens: int = 256, min_tokens: int = 32,
                exclude: set[str] | None = None, seed: int = 0, limit: int | None = None,
                per_file: int | None = None) -> list[TextChunk]:
    """Every file cut at line ends into chunks of ``min_tokens``..``max_tokens`` tokens (a longer
    line is cut at a token; shorter leftovers dropped), each with a request for its kind drawn
    from a seeded generator; duplicate chunks, chunks holding an ``exclude`` string (the evaluation
    prompts) and files that are not UTF-8 are skipped. ``per_file``: at most that many of a file's
    chunks, a seeded sample (so that a limited list spans many files). In file order, stopping after
    the file that brings the count to ``limit``; shuffle afterwards."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"chunk sizes must satisfy 1 ≤ min_tokens ≤ max_tokens, got {min_tokens}, {max_tokens}")
    rng = random.Random(seed)
    seen: set[bytes] = set()
    out: list[TextChunk] = []
    mine: list[TextChunk] = []  # the current file's chunks

    def emit(lines: list[str], kind: str, name: str, path: Path) -> None:
        text = "".join(lines).strip("\n")
        if not text.strip() or len(tokenizer(text, add_special_tokens=False)["input_ids"]) < min_tokens:
            return
        key = hashlib.sha1(text.encode()).digest()
        if key in seen or (exclude and any(e in text for e in exclude)):
            return
        seen.add(key)
        mine.append(TextChunk(rng.choice(_REQUESTS[kind]).format(name=name), text, str(path)))

    for path in files:
        if limit is not None and len(out) >= limit:
            break
        try:
            raw = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        kind, name, body = _kind_and_body(path, raw)
        lines, used = [], 0
        for line in body.splitlines(keepends=True):
            ids = tokenizer(line, add_special_tokens=False)["input_ids"]
            n = len(ids)
            if n > max_tokens:  # one very long line: its own chunk, cut at a token
                emit(lines, kind, name, path)
                emit([tokenizer.decode(ids[:max_tokens])], kind, name, path)
                lines, used = [], 0
                continue
            if used + n > max_tokens:
                emit(lines, kind, name, path)
                lines, used = [], 0
            lines.append(line)
            used += n
        emit(lines, kind, name, path)
        if per_file is not None and len(mine) > per_file:
            keep = sorted(rng.sample(range(len(mine)), per_file))
            mine[:] = [mine[i] for i in keep]
        out.extend(mine)
        mine.clear()
    return out
