"""The retrieval datastore: proposals against a brute-force scan, persistence, bad files, the engine."""

import collections
import math
import random

import pytest
import torch

from bastion.datastore import FILE, Datastore
from bastion.engine import Engine, GenerationConfig
from tiny import tiny_drafter, tiny_target


def brute_force(seqs, context, ngrams, max_tokens, cap, min_share):
    """The documented rule, written as plainly as possible: longest suffix with an occurrence, its
    latest ``cap`` occurrences, then the frequency walk."""
    for n in sorted(ngrams, reverse=True):
        if len(context) < n:
            continue
        key = tuple(context[-n:])
        occ = [(si, e + 1) for si, s in enumerate(seqs) for e in range(n - 1, len(s) - 1) if tuple(s[e - n + 1:e + 1]) == key]
        if not occ:
            continue
        live = occ[-cap:]
        out = []
        for d in range(max_tokens):
            votes = collections.Counter(seqs[si][j + d] for si, j in live if j + d < len(seqs[si]))
            if not votes:
                break
            top = max(votes.values())
            tok = min(t for t, c in votes.items() if c == top)  # ties: the smallest id (torch.unique sorts)
            if d > 0 and (top < 2 or top < min_share * len(live)):
                break
            out.append(tok)
            live = [(si, j) for si, j in live if j + d < len(seqs[si]) and seqs[si][j + d] == tok]
        if out:
            return out, n
    return None


def test_proposals_match_a_brute_force_scan():
    rng = random.Random(0)
    for trial in range(150):
        vocab = rng.choice([3, 5, 9])
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 30))] for _ in range(rng.randint(1, 6))]
        kw = dict(ngrams=rng.choice([(3, 2), (2,), (4, 2, 1)]), cap=rng.choice([2, 5, 256]),
                  min_share=rng.choice([0.0, 0.3, 0.6]))
        ds = Datastore.from_sequences(seqs, vocab, **kw)
        for _ in range(10):
            context = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
            k = rng.randint(1, 8)
            got = ds.propose(context, k)
            want = brute_force(seqs, context, kw["ngrams"], k, kw["cap"], kw["min_share"])
            assert (got.tokens, got.ngram) == want if want else got is None, (trial, seqs, context, kw)


def test_walk_follows_the_majority_and_stops_at_reply_ends():
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7, 8], [9, 2, 3]]
    ds = Datastore.from_sequences(seqs, 10, ngrams=(2,), min_share=0.5)
    p = ds.propose([0, 2, 3], 5)
    # after "2 3": 4 (twice), 7 (once), and the end of the last reply (no vote); then 5 and 6 split 1:1
    assert p.tokens == [4] and p.ngram == 2
    assert Datastore.from_sequences(seqs, 10, ngrams=(2,), min_share=0.0).propose([2, 3], 5).tokens == [4]
    assert ds.propose([5, 5], 3) is None  # no occurrence
    assert ds.propose([2, 3], 0) is None
    one = Datastore.from_sequences([[1, 2, 3]], 10, ngrams=(2,))
    assert one.propose([1, 2], 5).tokens == [3]  # never runs past the reply's end into the separator


def test_save_and_load_round_trip_and_bad_files(tmp_path):
    ds = Datastore.from_sequences([[0, 49151, 7], [5, 5, 5, 5]], 49152)
    ds.save(tmp_path)
    back = Datastore.load(tmp_path, 49152)
    assert torch.equal(back.tokens, ds.tokens) and back.vocab_size == 49152
    assert back.propose([5, 5], 3).tokens == ds.propose([5, 5], 3).tokens == [5]
    with pytest.raises(ValueError, match="vocabulary of 49152 tokens; the target has 100"):
        Datastore.load(tmp_path, 100)
    with pytest.raises(FileNotFoundError, match="no datastore"):
        Datastore.load(tmp_path / "missing", 49152)
    (tmp_path / FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        Datastore.load(tmp_path, 49152)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Datastore.from_sequences([[1, 2, 10]], 10)
    assert not list(tmp_path.glob("*.tmp"))  # the atomic save left nothing behind


def test_datastore_file_is_compressed_and_the_first_format_still_loads(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from bastion.datastore import _OFFSET
    seqs = [[(7 * i + j) % 300 for j in range(40)] for i in range(200)]  # repetitive, like replies
    ds = Datastore.from_sequences(seqs, 49152)
    ds.save(tmp_path)
    with safe_open(str(tmp_path / FILE), framework="pt") as f:
        assert set(f.keys()) == {"tokens_zlib", "vocab_size"}
        assert f.metadata()["count"] == str(len(ds.tokens))
    assert (tmp_path / FILE).stat().st_size < 2 * len(ds.tokens) / 4  # int16 would take 2 bytes a token
    assert torch.equal(Datastore.load(tmp_path, 49152).tokens, ds.tokens)
    # a file written before the compression: the tokens as plain int16
    old = tmp_path / "v1"
    old.mkdir()
    save_file({"tokens": (ds.tokens - _OFFSET).to(torch.int16), "vocab_size": torch.tensor([49152])},
              str(old / FILE), metadata={"format": "bastion datastore v1"})
    assert torch.equal(Datastore.load(old, 49152).tokens, ds.tokens)
    # a damaged stream, and one whose header disagrees with it: a clear error, not a short datastore
    with safe_open(str(tmp_path / FILE), framework="pt") as f:
        packed, meta = f.get_tensor("tokens_zlib"), f.metadata()
    bad = packed.clone()
    bad[len(bad) // 2:] = 0
    save_file({"tokens_zlib": bad, "vocab_size": torch.tensor([49152])}, str(tmp_path / FILE), metadata=meta)
    with pytest.raises(ValueError, match="damaged datastore"):
        Datastore.load(tmp_path, 49152)
    save_file({"tokens_zlib": packed, "vocab_size": torch.tensor([49152])}, str(tmp_path / FILE),
              metadata=meta | {"count": "12"})
    with pytest.raises(ValueError, match="header says 12"):
        Datastore.load(tmp_path, 49152)


def test_default_datastore_is_found_beside_a_drafter_folder(tmp_path):
    from bastion.loading import load_default_datastore

    target = tiny_target("llama")
    assert load_default_datastore(target, str(tmp_path), "some/model") is None  # a folder without one
    assert load_default_datastore(target, "owner/hub-drafter", "some/model") is None
    Datastore.from_sequences([[1, 2, 3]], target.vocab_size).save(tmp_path)
    assert load_default_datastore(target, str(tmp_path), "some/model").vocab_size == target.vocab_size
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(target, None, datastore=Datastore.from_sequences([[1]], target.vocab_size + 1))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_with_a_datastore_is_lossless_and_accepts_retrieved_tokens(temperature):
    target = tiny_target("llama", dtype=torch.float64)
    prompt = [3, 5, 7, 11]
    cfg = dict(max_new_tokens=40, temperature=temperature, seed=5, lookup=False)
    plain = Engine(target, tiny_drafter(target), kernels="torch", stop_ids=set())
    ref = plain.run(prompt, GenerationConfig(strategy="ar", **cfg)).token_ids
    # the datastore holds another reply of the target that shares this one's text
    ds = Datastore.from_sequences([[1, 2] + ref], target.vocab_size)
    engine = Engine(target, tiny_drafter(target), kernels="torch", stop_ids=set(), datastore=ds)
    steps = list(engine.generate(prompt, GenerationConfig(strategy="bastion", **cfg)))
    assert [t for s in steps for t in s.tokens] == ref
    off = list(engine.generate(prompt, GenerationConfig(strategy="bastion", datastore=False, **cfg)))
    assert [t for s in off for t in s.tokens] == ref
    assert all(-2 not in s.tree.ranks for s in off) and not any(s.datastore_tokens for s in off)
    retrieved = [s for s in steps if -2 in s.tree.ranks]
    assert retrieved and all(s.datastore_tokens and s.datastore_rates for s in retrieved)
    assert any(d.source == "datastore" for s in steps for d in s.trace)
    if temperature == 0.0:  # a random drafter accepts ~nothing; the datastore's copies do
        assert sum(1 for s in steps for v in s.accepted[1:] if s.tree.ranks[v] == -2) >= 5
        assert len(steps) < len(off)
    for s in steps:  # the records replay
        from bastion.records import Step

        back = Step.from_dict(s.to_dict())
        assert back.datastore_tokens == s.datastore_tokens and back.tree.ranks == s.tree.ranks


def test_build_command_writes_the_datastore_from_training_shards(tmp_path, capsys):
    from bastion.datastore import main

    data = tmp_path / "data"
    data.mkdir()
    torch.save([{"ids": torch.tensor([1, 2, 3, 4]), "prompt_len": 2}, {"ids": torch.tensor([1, 2, 3, 5])}],
               data / "shard_00000.pt")
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "config.json").write_text('{"vocab_size": 10}')
    assert main(["--data", str(data), "--out", str(out)]) == 0
    assert "2 sequences, 8 tokens" in capsys.readouterr().out
    ds = Datastore.load(out, 10)
    assert ds.propose([1, 2], 3).tokens == [3]  # then 4 and 5 split: the walk stops
    assert main(["--data", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "no shards" in capsys.readouterr().err
    assert Datastore.load(out, 10).propose([7, 2], 3) is None
    # --extend appends new replies to the stored ones (whose shards may be gone)
    more = tmp_path / "more"
    more.mkdir()
    torch.save([{"ids": torch.tensor([7, 2, 3, 4]), "prompt_len": 1}], more / "shard_00000.pt")
    assert main(["--data", str(more), "--out", str(out), "--extend"]) == 0
    assert "1 sequences, 4 tokens after 2 kept sequences (8 tokens)" in capsys.readouterr().out
    ds = Datastore.load(out, 10)
    assert ds.tokens.tolist() == [1, 2, 3, 4, -1, 1, 2, 3, 5, -1, 7, 2, 3, 4, -1]
    assert ds.propose([7, 2], 3).tokens == [3]  # only the appended reply has (7, 2)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text('{"vocab_size": 10}')
    assert main(["--data", str(more), "--out", str(empty), "--extend"]) == 2  # nothing to extend
    assert "no datastore" in capsys.readouterr().err


def test_successor_counts_match_a_brute_force_count():
    rng = random.Random(3)
    seqs = [[rng.randrange(6) for _ in range(rng.randint(1, 30))] for _ in range(40)]
    ds = Datastore.from_sequences(seqs, 6)
    for prefix in [(a,) for a in range(6)] + [(a, b) for a in range(6) for b in range(6)]:
        n = len(prefix)
        # the index holds n+1-grams that have a token after them: a reply's last one is left out
        want = collections.Counter(s[e + 1] for s in seqs for e in range(n - 1, len(s) - 2)
                                   if tuple(s[e - n + 1:e + 1]) == prefix)
        counts, total = ds.successors(prefix)
        assert counts == dict(want) and total == sum(want.values())
        assert ds.successors(prefix) is ds.successors(prefix)  # kept per prefix
    with pytest.raises(ValueError, match="1 or 2 tokens"):
        ds.successors((1, 2, 3))


def test_ngram_prior_reweights_by_what_followed_and_keeps_the_mass():
    from bastion.datastore import NgramPrior

    # after (4, 5) the replies wrote 2 nine times and 3 once
    ds = Datastore.from_sequences([[4, 5, 2, 0]] * 9 + [[4, 5, 3, 0], [1, 1, 1]], 10)
    prior = NgramPrior(ds, beta=0.5)
    logq = [math.log(0.3), math.log(0.3), math.log(0.2)]
    out = prior.condition(4, 5, logq, [3, 2, 7])
    assert out[1] > out[0] > out[2]  # 2 followed most, 7 never
    assert abs(sum(map(math.exp, out)) - 0.8) < 1e-12  # the candidates' drafter mass is kept
    assert all(x <= 0.0 for x in out)
    # a bigram only (no earlier token), an unseen last token and β = 0 leave q alone or nearly
    assert prior.condition(None, 5, logq, [3, 2, 7])[1] > prior.condition(None, 5, logq, [3, 2, 7])[0]
    assert prior.condition(4, 8, logq, [3, 2, 7]) == logq
    assert NgramPrior(ds, beta=0.0).condition(4, 5, logq, [3, 2, 7]) == logq
    with pytest.raises(ValueError):
        NgramPrior(ds, beta=-1.0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_conditioned_trees_stay_lossless_and_differ_from_plain_ones(temperature):
    target = tiny_target("llama", dtype=torch.float64)
    prompt = [3, 5, 7, 11]
    cfg = dict(max_new_tokens=40, temperature=temperature, seed=5, lookup=False, datastore=False)
    plain = Engine(target, tiny_drafter(target), kernels="torch", stop_ids=set())
    ref = plain.run(prompt, GenerationConfig(strategy="ar", **cfg)).token_ids
    rng = random.Random(0)  # a datastore of random text: its n-grams re-rank the random drafter's trees
    ds = Datastore.from_sequences([[rng.randrange(target.vocab_size) for _ in range(400)]], target.vocab_size)
    engine = Engine(target, tiny_drafter(target), kernels="torch", stop_ids=set(), datastore=ds)
    on = list(engine.generate(prompt, GenerationConfig(strategy="bastion", min_nodes=6, **cfg)))
    off = list(engine.generate(prompt, GenerationConfig(strategy="bastion", min_nodes=6, condition=False, **cfg)))
    assert [t for s in on for t in s.tokens] == ref and [t for s in off for t in s.tokens] == ref
    assert not any(s.conditioned for s in off)
    if temperature > 0:  # greedy only: the datastore's counts are of greedy replies
        assert not any(s.conditioned for s in on)
        return
    # the first round's drafts are the same; its tree differs once the n-grams re-rank children
    assert on[0].draft_ids == off[0].draft_ids
    assert any(a.tree.tokens != b.tree.tokens for a, b in zip(on, off))
    assert all(s.conditioned for s in on if len(s.tree) > 1)
    from bastion.records import Step

    assert Step.from_dict(on[0].to_dict()).conditioned == on[0].conditioned


@pytest.mark.parametrize("vocab", [50, 49152, 70000])
def test_the_index_is_compact_and_its_hashes_are_the_grams(vocab):
    """The index costs 12 bytes per n-gram (int64 hash, int32 position) and the tokens 4 bytes each
    — loading the shipped datastore held ~390 MiB of RSS with int64 positions and tokens built through
    torch temporaries, ~140 MiB now (session 47) —, and each hash is its gram's, sorted, equal hashes
    in text order. Both builds: hashes under 2^32 packed with their positions into one sorted key
    (every n here at vocabulary 50, the bigrams at SmolLM2's 49,152), longer ones through an argsort
    (the trigrams there, everything at 70,000)."""
    rng = random.Random(5)
    seqs = [[vocab - 1 - rng.randrange(50) for _ in range(rng.randint(1, 40))] for _ in range(60)]
    ds = Datastore.from_sequences(seqs, vocab)
    flat = [t for s in seqs for t in s + [-1]]
    assert ds.tokens.dtype == torch.int32 and ds.tokens.tolist() == flat
    for n in ds.ngrams:
        hashes, ends = ds._index[n]
        assert hashes.dtype.itemsize == 8 and ends.dtype.itemsize == 4
        want = sorted((sum((flat[e - n + 1 + j] + 1) * (vocab + 1) ** (n - 1 - j) for j in range(n)), e)
                      for e in range(n - 1, len(flat) - 1) if min(flat[e - n + 1:e + 2]) >= 0)
        assert list(zip(hashes.tolist(), ends.tolist())) == want


def test_the_index_is_built_without_numpys_huge_page_advice_and_the_setting_comes_back(monkeypatch):
    """``_index_build``: NumPy's madvise of huge pages stalled the build's first touches (session 59:
    loading 4.0–4.5 s with it, 1.8–2.0 s without); off for the build only, the caller's setting restored."""
    multiarray = pytest.importorskip("numpy._core.multiarray")
    setter = getattr(multiarray, "_set_madvise_hugepage", None)
    if setter is None:
        pytest.skip("this NumPy has no huge-page switch")

    def current() -> bool:
        value = setter(False)
        setter(value)
        return bool(value)

    seen = []
    build = Datastore._build
    monkeypatch.setattr(Datastore, "_build", lambda self, n: seen.append(current()) or build(self, n))
    before = setter(True)
    try:
        ds = Datastore.from_sequences([[1, 2, 3, 1, 2, 4], [2, 3, 1]], 10)
        assert seen == [False, False] and current() is True
        setter(False)
        ds._counts.clear()
        del ds._index[3]
        ds.prepare_successors()  # a lazily built index goes through the same switch
        assert seen == [False, False, False] and current() is False
    finally:
        setter(before)
