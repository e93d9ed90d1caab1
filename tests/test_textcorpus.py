"""Offline text as drafter training data: the chunker (``bastion.textcorpus``) and ``train text``."""

import json

import pytest
import torch

from bastion.textcorpus import TextChunk, text_chunks, text_files


class WordTokenizer:
    """One token per whitespace-separated word (a line's newline counts as one more): enough to check
    the chunker's sizes without a real vocabulary."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(range(len(text.split()) + text.count("\n")))}

    def decode(self, ids):
        return " ".join("w" for _ in ids)


def _write(folder, name, text):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_text_files_reads_files_folders_and_named_sources_and_refuses_what_is_not_there(tmp_path):
    a = _write(tmp_path, "docs/a.md", "alpha")
    b = _write(tmp_path, "docs/sub/b.py", "x = 1")
    m = _write(tmp_path, "docs/pkg-1.0.dist-info/METADATA", "Name: pkg\n\nbody")
    _write(tmp_path, "docs/image.png", "not text")
    assert text_files([str(tmp_path / "docs")]) == sorted([a, b, m])
    assert text_files([str(a)]) == [a]
    stdlib = text_files(["stdlib"])
    assert any(p.name == "json" or p.parent.name == "json" for p in stdlib)
    assert not any("test" in p.parts or "tests" in p.parts for p in stdlib)
    assert all(p.name == "METADATA" for p in text_files(["packages"]))
    with pytest.raises(ValueError, match="no such file or folder"):
        text_files([str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="no text files"):
        text_files([str(_write(tmp_path, "empty/x.png", "").parent)])


def test_chunks_stay_within_their_sizes_skip_duplicates_and_excluded_text_and_name_their_source(tmp_path):
    lines = [f"line {i} has five words\n" for i in range(40)]  # 6 tokens a line
    doc = _write(tmp_path, "guide.md", "".join(lines))
    same = _write(tmp_path, "copy.md", "".join(lines))  # its chunks repeat guide.md's: all skipped
    secret = _write(tmp_path, "secret.txt", "".join(lines[:8]) + "Write a haiku about rain.\n")
    meta = _write(tmp_path, "d/METADATA", "Metadata-Version: 2.1\nName: widgets\n\n"
                  + "".join(f"widget {i} is a small part\n" for i in range(10)))
    tok = WordTokenizer()
    chunks = text_chunks([doc, same, secret, meta], tok, max_tokens=30, min_tokens=12,
                         exclude={"Write a haiku about rain."}, seed=1)
    assert all(isinstance(c, TextChunk) for c in chunks)
    sizes = [len(tok(c.text)["input_ids"]) for c in chunks]
    assert all(12 <= n <= 30 for n in sizes), sizes
    assert len({c.text for c in chunks}) == len(chunks)
    assert {c.source for c in chunks} == {str(doc), str(meta)}  # the copy and the excluded text are gone
    assert sum(c.source == str(doc) for c in chunks) == 8  # 40 lines, 5 to a chunk (30 tokens)
    readme = [c for c in chunks if c.source == str(meta)]
    assert readme and all("widgets" in c.request for c in readme)  # the package's name, not "METADATA"
    assert "Name:" not in "".join(c.text for c in readme)  # the header block is not the README
    assert all("guide" in c.request for c in chunks if c.source == str(doc))
    few = text_chunks([doc], tok, max_tokens=30, min_tokens=12, per_file=3, seed=1)
    assert len(few) == 3 and all(c.text in {d.text for d in chunks} for c in few)
    assert len(text_chunks([doc, meta], tok, max_tokens=30, min_tokens=12, limit=2)) == 8  # whole files
    with pytest.raises(ValueError, match="min_tokens"):
        text_chunks([doc], tok, max_tokens=10, min_tokens=20)


def test_a_very_long_line_becomes_one_chunk_cut_at_max_tokens(tmp_path):
    doc = _write(tmp_path, "long.txt", "short line one two three four five six seven eight nine ten\n"
                 + " ".join(["word"] * 100) + "\n")
    chunks = text_chunks([doc], WordTokenizer(), max_tokens=40, min_tokens=5)
    assert [len(WordTokenizer()(c.text)["input_ids"]) for c in chunks] == [12, 40]


@pytest.mark.slow
def test_train_text_writes_greedy_records_of_the_embedded_target_and_resumes(tmp_path):
    """``train text`` on the embedded target: each record is the chat-templated request followed by
    the chunk's tokens, with the target's own greedy choice after every token and its features; a
    deleted shard is written again identically, other settings are refused, a missing source is an
    error before the target loads."""
    from bastion.loading import encode_prompt, load_target
    from bastion.train import main
    from bastion.traindata import load_shards

    src = _write(tmp_path, "src/notes.md",
                 "".join(f"Step {i}: add {i} to the total and print the running sum.\n" for i in range(60)))
    out = tmp_path / "text"
    args = ["text", "--source", str(src.parent), "--out", str(out), "--chunks", "3", "--batch", "2",
            "--max-tokens", "48", "--threads", "1"]
    assert main(args) == 0
    recs = load_shards(out)
    chunks = json.loads((out / "chunks.json").read_text())
    assert len(recs) == len(chunks) == 3 and len(list(out.glob("shard_*.pt"))) == 2
    target = load_target("embedded", torch.float32, "cpu")
    tok = target.tokenizer
    for r, (request, text) in zip(recs, chunks):
        prompt = encode_prompt(tok, request)
        assert r["ids"].tolist() == prompt + tok(text, add_special_tokens=False)["input_ids"][:48]
        assert r["prompt_len"] == len(prompt) and r["feats"].shape == (len(r["ids"]), 4 * target.hidden_size)
        with torch.no_grad():
            logits = target.model(input_ids=r["ids"].long()[None]).logits[0]
        assert torch.equal(r["greedy"].long(), logits.argmax(-1))
    (out / "shard_00000.pt").unlink()
    assert main(args) == 0
    again = load_shards(out)
    assert all(torch.equal(a["greedy"], b["greedy"]) and torch.equal(a["ids"], b["ids"]) for a, b in zip(recs, again))
    assert main(args[:-6] + ["--chunks", "4", "--batch", "2", "--max-tokens", "48", "--threads", "1"]) == 2
    with pytest.raises(SystemExit):
        main(["text", "--source", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
