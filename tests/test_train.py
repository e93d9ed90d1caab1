"""The training pipeline: the offline corpus, and `python -m bastion.train data|fit|plot` end to end."""

import json
import random
import time
from pathlib import Path

import pytest
import torch

from bastion.corpus import build_corpus
from bastion.loading import DEV_PROMPTS, EVAL_PROMPTS
from bastion.traindata import pending_shards, progress
from tiny import tiny_drafter, tiny_target


def _eval_prompts() -> set[str]:
    data = json.loads(EVAL_PROMPTS.read_text())
    return {p for v in data.values() if isinstance(v, list) for p in v}


def _dev_prompts() -> set[str]:
    data = json.loads(DEV_PROMPTS.read_text())
    return {p for v in data.values() if isinstance(v, list) for p in v}


def test_dev_suite_is_larger_disjoint_and_excluded_from_training():
    """assets/dev_prompts.json: three categories of 30 distinct prompts, none an evaluation prompt or a
    few-shot example, and every corpus builder is told to leave them out."""
    from bastion.corpus import SEED_REQUESTS
    from bastion.traindata import _eval_prompt_set

    data = json.loads(DEV_PROMPTS.read_text())
    cats = {k: v for k, v in data.items() if isinstance(v, list)}
    assert set(cats) == {"chat", "code", "math"} and all(len(v) == len(set(v)) == 30 for v in cats.values())
    dev = _dev_prompts()
    assert len(dev) == 90 and not dev & _eval_prompts()
    assert not dev & {q for qs in SEED_REQUESTS.values() for q in qs}
    assert dev | _eval_prompts() <= _eval_prompt_set()


def test_fresh_self_suite_is_a_valid_suite_disjoint_and_excluded_from_training():
    """assets/fresh_self_prompts.json: 60 distinct model-written requests, none in the other suites or
    the few-shot seeds, read as a suite by the benchmark's reader, and left out of every corpus."""
    from bastion.bench import read_prompts
    from bastion.corpus import SEED_REQUESTS
    from bastion.loading import FRESH_PROMPTS
    from bastion.traindata import _eval_prompt_set

    fresh = read_prompts(FRESH_PROMPTS)["self"]
    assert len(fresh) == len(set(fresh)) == 60
    assert not set(fresh) & (_eval_prompts() | _dev_prompts() | {q for qs in SEED_REQUESTS.values() for q in qs})
    assert set(fresh) <= _eval_prompt_set()


@pytest.mark.parametrize("name", ["eval_prompts.json", "dev_prompts.json", "fresh_self_prompts.json"])
def test_shipped_suites_are_plain_category_to_prompt_lists(name):
    """Each shipped suite is exactly {category: [prompt, ...]}: a script that iterates it naively must
    get whole prompts (a metadata string among the lists once gave such scripts one-character prompts)."""
    data = json.loads((EVAL_PROMPTS.parent / name).read_text(encoding="utf-8"))
    assert isinstance(data, dict) and data
    for category, prompts in data.items():
        assert isinstance(prompts, list) and prompts, category
        assert all(isinstance(p, str) and len(p.strip()) > 10 for p in prompts), category


@pytest.mark.parametrize("corpus", ["base", "broad"])
def test_corpus_is_deterministic_prefix_stable_and_disjoint_from_eval(corpus):
    held_out = _eval_prompts() | _dev_prompts()
    big = build_corpus(3000, seed=0, exclude=held_out, corpus=corpus)
    assert len(big) == len(set(big)) == 3000
    assert build_corpus(500, seed=0, exclude=held_out, corpus=corpus) == big[:500]  # more data extends
    assert not set(big) & held_out
    assert build_corpus(300, seed=1, corpus=corpus) != big[:300]


def test_corpus_excludes_what_it_is_told_and_rejects_unknown_names():
    first = build_corpus(10)
    assert first[0] not in build_corpus(10, exclude={first[0]})
    with pytest.raises(ValueError, match="unknown corpus"):
        build_corpus(10, corpus="wikipedia")


def test_self_corpus_seeds_prompt_and_parser():
    from bastion.corpus import SEED_REQUESTS, parse_requests, request_prompt

    seeds = {q for qs in SEED_REQUESTS.values() for q in qs}
    assert not seeds & _eval_prompts()  # the few-shot examples are not evaluation prompts
    import random

    a, b = request_prompt(random.Random(3), "code"), request_prompt(random.Random(3), "code")
    assert a == b and a.endswith("\n6.") and sum(q in a for q in SEED_REQUESTS["code"]) == 5
    text = " Write a Go function that sums a slice of ints.\n7.  How do I   center a div?\n9. skipped number?"
    assert parse_requests(text) == ["Write a Go function that sums a slice of ints.", "How do I center a div?"]
    assert parse_requests(" Write a Go function that sums a slice") == []  # cut off mid-sentence
    assert parse_requests(" Hi?") == []  # too short
    assert parse_requests(" " + SEED_REQUESTS["math"][0]) == []  # a copied example
    with pytest.raises(ValueError, match="make_requests"):
        build_corpus(10, corpus="self")


class _CharTokenizer:
    """Just enough of a tokenizer for make_requests on a tiny random model (97 ids ↔ printable chars)."""

    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(c) % 96 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\n" if i == 1 else chr(31 + i) for i in ids if i)


def test_make_requests_fails_loudly_when_the_model_cannot_write_requests():
    from bastion.traindata import make_requests
    from tiny import tiny_target

    target = tiny_target(dtype=torch.float32)
    target.tokenizer = _CharTokenizer()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="usable requests of 50 in 1 rounds"):
        make_requests(target, 50, batch=4, max_new_tokens=8, max_rounds=1)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random stream is left as it was


def test_nucleus_sampler_draws_from_transformers_top_p_nucleus_in_proportion():
    """``NucleusSampler`` (the request writer's sampler): each row's nucleus is the set transformers'
    own top-p warper keeps — rows from one token to ~2,900 of 3,000, so the growing top-k search
    runs past its first rounds — and its draws follow softmax renormalised over the nucleus (20,000
    draws of one row: every token within 4 standard errors of its probability, none outside)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from bastion.traindata import NucleusSampler

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3000, generator=g) * torch.tensor([0.05, 0.5, 1.0, 2.0, 4.0, 40.0])[:, None]
    kept = TopPLogitsWarper(0.9)(None, x.clone()) > float("-inf")
    sizes = kept.sum(dim=-1)
    assert sizes.min() == 1 and sizes.max() > 2000
    torch.manual_seed(1)
    for _ in range(20):  # every draw lies in its row's nucleus
        out = NucleusSampler(0.9)(None, x)
        pick = out.argmax(dim=-1)
        assert (out == 0).sum() == 6 and kept[torch.arange(6), pick].all()
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, -6.0, -9.0])
    n = 20_000
    torch.manual_seed(2)
    pick = NucleusSampler(0.9)(None, row.expand(n, -1)).argmax(dim=-1)
    nucleus = TopPLogitsWarper(0.9)(None, row[None].clone())[0] > float("-inf")
    want = torch.softmax(row.masked_fill(~nucleus, float("-inf")), dim=-1)
    got = torch.bincount(pick, minlength=len(row)).double() / n
    assert 3 <= int(nucleus.sum()) < len(row)
    se = (want.double() * (1 - want.double()) / n).sqrt()
    assert ((got - want.double()).abs() <= 4 * se + 1e-12).all(), (got, want)


@pytest.mark.slow
def test_self_corpus_is_written_once_and_extended(tmp_path):
    """The embedded target writes its own requests; requests.json is reused, and a larger n appends."""
    from bastion.loading import EMBEDDED, load_target
    from bastion.traindata import _requests_file

    target = load_target(EMBEDDED, torch.float32, "cpu")
    first = _requests_file(target, tmp_path, 6, seed=0, batch=8)
    assert len(first) == len(set(first)) == 6 and not set(first) & _eval_prompts()
    assert all(q[-1] in "?.!:" for q in first)
    assert _requests_file(target, tmp_path, 4, seed=0, batch=8) == first[:4]  # read back, not regenerated
    more = _requests_file(target, tmp_path, 9, seed=0, batch=8)
    assert more[:6] == first and len(set(more)) == 9
    assert json.loads((tmp_path / "requests.json").read_text()) == more


@pytest.mark.slow
def test_data_fit_resume_and_plot_on_the_embedded_target(tmp_path, capsys):
    """data → fit (stops after 2 steps) → fit again resumes at step 2 and continues to 4 → plot."""
    from bastion.drafter_io import load_drafter
    from bastion.train import main

    data, ckpt = tmp_path / "data", tmp_path / "ckpt"
    common = ["--threads", "1"]
    assert main(["data", "--out", str(data), "--prompts", "3", "--batch", "2", "--max-new-tokens", "6"] + common) == 0
    shards = sorted(data.glob("shard_*.pt"))
    assert len(shards) == 2
    recs = torch.load(shards[0])
    assert len(recs) == 2 and recs[0]["feats"].shape[1] == 4 * 576 and len(recs[0]["ids"]) > recs[0]["prompt_len"]
    # a second data run with another corpus into the same folder is refused (shards would mix)
    with pytest.raises(ValueError, match="other settings"):
        main(["data", "--out", str(data), "--prompts", "3", "--corpus", "broad"] + common)
    fit = ["fit", "--data", str(data), "--ckpt", str(ckpt), "--rows", "2", "--anchors", "2", "--loss-depths", "3",
           "--ckpt-every", "1", "--draft-vocab", "512", "--export", str(tmp_path / "drafter")] + common
    assert main(fit + ["--steps", "2"]) == 0
    assert main(fit + ["--steps", "4"]) == 0
    err = capsys.readouterr().err
    assert "resumed from step 2" in err
    log = [json.loads(x) for x in (ckpt / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3, 4]
    d = load_drafter(tmp_path / "drafter", 576, 49152, 30)
    assert d.draft_vocab is not None and len(d.draft_vocab) == 512
    assert main(["plot", "--ckpt", str(ckpt), "--ckpt", str(ckpt), "--out", str(tmp_path / "loss.png")]) == 0
    from bastion.train import read_logs
    both, starts = read_logs([ckpt, ckpt])
    assert [x["step"] for x in both] == [1, 2, 3, 4, 5, 6, 7, 8] and starts == [4]
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_a_warm_start_keeps_its_draft_vocabulary_when_new_shards_appear(tmp_path, monkeypatch):
    """fit --init without --draft-vocab trains on the init drafter's vocabulary, also after a reload of
    shards the data job wrote meanwhile (a vocabulary refitted on a small new folder would drop tokens
    the drafter learned on all earlier data)."""
    from bastion import fitting, train
    from bastion.drafter_io import load_drafter, save_drafter

    data = tmp_path / "data"
    common = ["--threads", "1"]
    assert train.main(["data", "--out", str(data), "--prompts", "2", "--batch", "2", "--max-new-tokens", "6"]
                      + common) == 0
    init = tmp_path / "init"
    d = load_drafter(Path(__file__).resolve().parent.parent / "assets" / "drafter-smollm2-135m", 576, 49152, 30)
    vocab = torch.arange(100, 1124)  # not what the tiny data's token counts would pick
    d.set_draft_vocab(vocab)
    save_drafter(d, init)
    counts = iter(range(1, 100))  # the shard count grows at every check: every checkpoint reloads
    monkeypatch.setattr(fitting, "count_shards", lambda data: next(counts))
    fit = ["fit", "--data", str(data), "--ckpt", str(tmp_path / "ckpt"), "--rows", "2", "--anchors", "2",
           "--loss-depths", "3", "--ckpt-every", "1", "--steps", "2", "--init", str(init),
           "--export", str(tmp_path / "out")] + common
    assert train.main(fit) == 0
    out = load_drafter(tmp_path / "out", 576, 49152, 30)
    assert torch.equal(out.draft_vocab, vocab)


def test_ids_only_data_trains_with_live_features(tmp_path):
    """data --no-features stores token ids only; fit refuses it without --live-features and trains
    on it with the target's features computed per batch."""
    from bastion.drafter_io import load_drafter
    from bastion.train import main

    data, ckpt = tmp_path / "ids", tmp_path / "ckpt"
    common = ["--threads", "1"]
    assert main(["data", "--out", str(data), "--prompts", "2", "--batch", "2", "--max-new-tokens", "6",
                 "--no-features"] + common) == 0
    (recs,) = [torch.load(p) for p in data.glob("shard_*.pt")]
    assert len(recs) == 2 and all("feats" not in r for r in recs)
    assert json.loads((data / "meta.json").read_text())["features"] is False
    # the same folder with features would mix two kinds of shards
    with pytest.raises(ValueError, match="other settings"):
        main(["data", "--out", str(data), "--prompts", "4", "--batch", "2"] + common)
    fit = ["fit", "--data", str(data), "--ckpt", str(ckpt), "--rows", "2", "--anchors", "2", "--loss-depths", "3",
           "--ckpt-every", "1", "--steps", "2", "--export", str(tmp_path / "drafter")] + common
    with pytest.raises(ValueError, match="--live-features"):
        main(fit)
    assert main(fit + ["--live-features"]) == 0
    log = [json.loads(x) for x in (ckpt / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2] and all(x["loss"] > 0 for x in log)
    assert load_drafter(tmp_path / "drafter", 576, 49152, 30).cfg.target_layer_ids == [1, 10, 18, 27]


def test_features_turns_an_ids_only_folder_into_checked_feature_shards(tmp_path, capsys):
    """train features: an ids-only folder (what a GPU writes) gains the target's features — equal to
    those `data` stores for the same replies — and ``agree`` marks the reply tokens that are this
    target's greedy choices (a token changed on purpose is caught); finished shards are not redone;
    a folder with features already, or no data folder, is refused with a message."""
    from bastion.train import main

    common = ["--threads", "1"]
    gen = ["--prompts", "3", "--batch", "2", "--max-new-tokens", "6"] + common
    ids, full, out = tmp_path / "ids", tmp_path / "full", tmp_path / "feats"
    assert main(["data", "--out", str(ids), "--no-features"] + gen) == 0
    assert main(["data", "--out", str(full)] + gen) == 0
    shard1 = ids / "shard_00001.pt"
    recs = torch.load(shard1)
    recs[0]["ids"][-1] = (int(recs[0]["ids"][-1]) + 1) % 49152  # a token the target did not write
    torch.save(recs, shard1)
    assert main(["features", "--data", str(ids), "--out", str(out), "--batch", "1"] + common) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["features"] is True and meta["features_from"] == "ids"
    for name in ("shard_00000.pt", "shard_00001.pt"):
        made, ref = torch.load(out / name), torch.load(full / name)
        assert [len(r["ids"]) for r in made] == [len(r["ids"]) for r in ref]
        for k, (m, r) in enumerate(zip(made, ref)):
            assert m["feats"].shape == r["feats"].shape and m["feats"].dtype == torch.float16
            # fp16 either way; `data` keeps generate's own (left-padded) forwards, this one forward
            # (the changed last token of shard 1's first reply has features of its own)
            a, b = (m["feats"][:-1], r["feats"][:-1]) if (name, k) == ("shard_00001.pt", 0) else (m["feats"], r["feats"])
            assert (a.float() - b.float()).norm() < 1e-3 * b.float().norm()
            if name == "shard_00000.pt":
                assert torch.equal(m["ids"], r["ids"]) and bool(m["agree"].all())
    changed = torch.load(out / "shard_00001.pt")[0]["agree"]
    assert not bool(changed[-1]) and bool(changed[:-1].all())
    before = (out / "shard_00000.pt").stat().st_mtime_ns
    assert main(["features", "--data", str(ids), "--out", str(out)] + common) == 0
    assert (out / "shard_00000.pt").stat().st_mtime_ns == before
    capsys.readouterr()
    assert main(["features", "--data", str(full), "--out", str(tmp_path / "x")] + common) == 2
    assert "already holds features" in capsys.readouterr().err
    assert main(["features", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "y")] + common) == 2
    assert "no data folder" in capsys.readouterr().err


def test_fit_draws_a_block_length_per_step_from_blocks(tmp_path, capsys):
    """fit --blocks 3,5: each step trains blocks of 3 or 5 tokens (depths 1..min(D, B'−1)) on the
    16-token drafter; a length the drafter cannot hold is refused before training."""
    from bastion.drafter_io import load_drafter
    from bastion.train import main

    data, ckpt = tmp_path / "data", tmp_path / "ckpt"
    common = ["--threads", "1"]
    assert main(["data", "--out", str(data), "--prompts", "2", "--batch", "2", "--max-new-tokens", "8"]
                + common) == 0
    fit = ["fit", "--data", str(data), "--ckpt", str(ckpt), "--rows", "2", "--anchors", "2", "--loss-depths", "3",
           "--ckpt-every", "4", "--steps", "8", "--export", str(tmp_path / "drafter")] + common
    for bad, why in (("3,x", "comma-separated integers"), ("3,17", "must lie in [2, --block = 16]"),
                     ("1,3", "must lie in")):
        with pytest.raises(SystemExit):
            main(fit + ["--blocks", bad])
        assert why in capsys.readouterr().err
    # with --init the drafter's own block size bounds them (known once it is loaded)
    init = tmp_path / "init"
    from bastion.drafter_io import save_drafter
    save_drafter(load_drafter(Path(__file__).resolve().parent.parent / "assets" / "drafter-smollm2-135m",
                              576, 49152, 30), init)
    with pytest.raises(ValueError, match="outside"):
        main(fit + ["--blocks", "3,20", "--init", str(init)])
    assert main(fit + ["--blocks", "3,5"]) == 0
    log = [json.loads(x) for x in (ckpt / "log.jsonl").read_text().splitlines()]
    # depths trained: 2 for 3-token blocks, 3 (the --loss-depths cap) for 5-token ones
    assert {len(x["acc"]) for x in log} == {2, 3} and all(x["loss"] > 0 for x in log)
    assert load_drafter(tmp_path / "drafter", 576, 49152, 30).block_size == 16

    # --seed picks the batch stream: the same seed draws the same lengths, another seed others
    def lengths(seed: int) -> list[int]:
        out = tmp_path / f"ckpt-seed{seed}"
        assert main(fit[:4] + [str(out)] + fit[5:] + ["--blocks", "3,5", "--seed", str(seed)]) == 0
        return [len(json.loads(x)["acc"]) for x in (out / "log.jsonl").read_text().splitlines()]

    again = lengths(0)
    assert again == [len(x["acc"]) for x in log] and lengths(7) != again


def _two_step_fit_from_the_shipped_drafter(tmp_path) -> list[str]:
    """Writes 2 short sequences of the embedded target to tmp_path/data; returns `fit` arguments for a
    2-step run from the shipped drafter into tmp_path/ckpt, exporting to tmp_path/drafter."""
    from bastion.train import main

    data, ckpt = tmp_path / "data", tmp_path / "ckpt"
    common = ["--threads", "1"]
    assert main(["data", "--out", str(data), "--prompts", "2", "--batch", "2", "--max-new-tokens", "8"]
                + common) == 0
    shipped = Path(__file__).resolve().parent.parent / "assets" / "drafter-smollm2-135m"
    return ["fit", "--data", str(data), "--ckpt", str(ckpt), "--rows", "2", "--anchors", "2", "--loss-depths", "3",
            "--ckpt-every", "2", "--steps", "2", "--init", str(shipped), "--export", str(tmp_path / "drafter")] + common


def test_fit_grows_an_init_drafter_and_resumes_only_at_its_size(tmp_path, capsys):
    """fit --init D --layers 3 trains a 3-layer drafter from the shipped 2-layer one and exports it;
    resuming that checkpoint without --layers is refused with the reason, as is --layers 0."""
    from bastion.drafter_io import load_drafter
    from bastion.train import main

    with pytest.raises(SystemExit):
        main(["fit", "--data", "x", "--ckpt", "y", "--layers", "0"])
    assert "positive layer count" in capsys.readouterr().err
    fit = _two_step_fit_from_the_shipped_drafter(tmp_path)
    assert main(fit + ["--layers", "3"]) == 0
    shipped_store = Path(fit[fit.index("--init") + 1]) / "datastore.safetensors"  # the export keeps the
    assert (tmp_path / "drafter" / "datastore.safetensors").read_bytes() == shipped_store.read_bytes()  # init's
    grown = load_drafter(tmp_path / "drafter", 576, 49152, 30)
    assert grown.cfg.num_hidden_layers == 3 and grown.cfg.draft_vocab_size == 8192
    with pytest.raises(ValueError, match="resume with the --layers it was started with"):
        main(fit + ["--steps", "4"])  # the later --steps wins


def test_train_cli_rejects_a_device_it_cannot_use(capsys):
    from bastion.train import main

    with pytest.raises(SystemExit):
        main(["fit", "--data", "x", "--ckpt", "y", "--device", "tpu:0"])
    assert "--device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["fit", "--data", "x", "--ckpt", "y", "--device", "cuda"])
        assert "no CUDA GPU" in capsys.readouterr().err


def test_gpu_payload_turns_feature_shards_into_ids_only_folders(tmp_path):
    """scripts/gpu_payload.py's data step: the records keep ids and prompt lengths, lose the features,
    and the folder's meta says so (fit then asks for --live-features)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "gpu_payload", Path(__file__).resolve().parents[1] / "scripts" / "gpu_payload.py")
    payload = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(payload)
    src = tmp_path / "self"
    src.mkdir()
    recs = [{"ids": torch.arange(n, dtype=torch.int32), "prompt_len": 2, "feats": torch.zeros(n, 8)} for n in (5, 7)]
    torch.save(recs[:1], src / "shard_00000.pt")
    torch.save(recs[1:], src / "shard_00001.pt")
    (src / "meta.json").write_text(json.dumps({"layer_ids": [1, 2], "corpus": "self", "seed": 0, "batch": 1}))
    payload.ids_only([src], tmp_path / "ids")
    (out,) = [torch.load(p) for p in (tmp_path / "ids" / "self").glob("shard_*.pt")]
    assert [r["ids"].tolist() for r in out] == [list(range(5)), list(range(7))]
    assert all(set(r) == {"ids", "prompt_len"} for r in out)
    meta = json.loads((tmp_path / "ids" / "self" / "meta.json").read_text())
    assert meta["features"] is False and meta["layer_ids"] == [1, 2] and meta["prompts"] == 2


def test_gpu_train_script_dry_run_on_the_cpu(tmp_path):
    """scripts/gpu_train.sh, the one-call recipe a session with a GPU runs, in its CPU dry-run mode
    (DEVICE=cpu, tiny batches, no benchmark): ids-only data, live features, distillation (KD) and the
    export split into parts all work, with revealed prefixes (REVEAL) — a broken script would cost that
    session its device time."""
    import os
    import shutil
    import subprocess
    import sys

    from bastion.train import main

    root = Path(__file__).resolve().parents[1]
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    shutil.copytree(root / "assets" / "drafter-smollm2-135m", work / "drafter",
                    ignore=shutil.ignore_patterns("*.png", "*.md", "datastore.safetensors"))
    assert main(["data", "--no-features", "--out", str(work / "ids" / "self_a"), "--prompts", "2", "--batch", "2",
                 "--max-new-tokens", "8", "--threads", "1"]) == 0
    env = dict(os.environ, PYTHON=sys.executable, DEVICE="cpu", ROWS="2", ANCHORS="2", SKIP_BENCH="1", KD="0.5",
               REVEAL="0.5", OMP_NUM_THREADS="1")
    run = subprocess.run(["bash", str(root / "scripts" / "gpu_train.sh"), str(work), str(out), "0.05"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "fit exit 0" in run.stdout, run.stdout + (work / "fit.err").read_text()[-2000:]
    assert str(work / "ids" / "self_a") in run.stdout  # the ids-only folder was found (and given twice)
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert log and all(x["loss"] > 0 and x["kd"] == 0.5 and x["reveal"] == 0.5 for x in log)
    parts = sorted(out.glob("drafter.safetensors.part-*"))
    assert parts and (out / "drafter.config.json").is_file()
    joined = tmp_path / "joined"
    joined.mkdir()
    (joined / "model.safetensors").write_bytes(b"".join(p.read_bytes() for p in parts))
    shutil.copy(out / "drafter.config.json", joined / "config.json")
    from bastion.drafter_io import load_drafter
    assert load_drafter(joined, 576, 49152, 30).cfg.draft_vocab_size == 8192


def test_replay_restores_feature_shards_from_a_datastore(tmp_path, capsys):
    """train replay: the replies a datastore keeps become training shards again — same ids, the
    prompt split at the assistant header, and the features the data job had computed."""
    from bastion.datastore import main as build_datastore
    from bastion.traindata import load_shards
    from bastion.train import main

    data, store, out = tmp_path / "data", tmp_path / "store", tmp_path / "replay"
    common = ["--threads", "1"]
    assert main(["data", "--out", str(data), "--prompts", "3", "--batch", "2", "--max-new-tokens", "6"] + common) == 0
    store.mkdir()
    (store / "config.json").write_text('{"vocab_size": 49152}')
    assert build_datastore(["--data", str(data), "--out", str(store)]) == 0
    assert main(["replay", "--datastore", str(store), "--out", str(out), "--sequences", "5", "--batch", "2"]
                + common) == 0
    made = {tuple(r["ids"].tolist()): r for r in load_shards(data)}
    back = load_shards(out)
    assert len(back) == 3 and len(list(out.glob("shard_*.pt"))) == 2
    for r in back:
        ref = made[tuple(r["ids"].tolist())]
        assert r["prompt_len"] == ref["prompt_len"]
        assert torch.allclose(r["feats"].float(), ref["feats"].float(), rtol=1e-2, atol=2e-2)  # fp16, other padding
    # ids only (the GPU payload's input): every stored reply, no target forward, no features
    ids = tmp_path / "ids"
    assert main(["replay", "--datastore", str(store), "--out", str(ids), "--sequences", "0", "--no-features"]
                + common) == 0
    assert json.loads((ids / "meta.json").read_text())["features"] is False
    bare = load_shards(ids, ids_only=True)
    assert sorted(tuple(r["ids"].tolist()) for r in bare) == sorted(made)
    assert all("feats" not in r and r["prompt_len"] == made[tuple(r["ids"].tolist())]["prompt_len"] for r in bare)
    # the same folder cannot silently switch to feature shards
    assert main(["replay", "--datastore", str(store), "--out", str(ids), "--sequences", "0"] + common) == 2
    assert "other settings (features)" in capsys.readouterr().err
    # --newest: only the replies stored last (an --extend appends), here the last 2 of 3
    from bastion.datastore import Datastore
    flat = Datastore.load(store, 49152).tokens.tolist()
    stored = [tuple(q) for q in _split_at(flat, -1)]
    newest = tmp_path / "newest"
    assert main(["replay", "--datastore", str(store), "--out", str(newest), "--sequences", "0", "--newest", "2",
                 "--no-features"] + common) == 0
    assert sorted(tuple(r["ids"].tolist()) for r in load_shards(newest, ids_only=True)) == sorted(stored[-2:])
    assert main(["replay", "--datastore", str(store), "--out", str(newest), "--sequences", "0", "--newest", "1",
                 "--no-features"] + common) == 2
    assert "other settings (newest)" in capsys.readouterr().err
    # --dtype bfloat16 (the fast path on AMX): the same replies, features within bf16 rounding of float32's
    half = tmp_path / "bf16"
    assert main(["replay", "--datastore", str(store), "--out", str(half), "--sequences", "5", "--batch", "2",
                 "--dtype", "bfloat16"] + common) == 0
    assert json.loads((half / "meta.json").read_text())["dtype"] == "bfloat16"
    for r in load_shards(half):
        f32, f16 = made[tuple(r["ids"].tolist())]["feats"].float(), r["feats"].float()
        assert r["feats"].dtype == torch.float16
        assert ((f16 - f32).norm() / f32.norm()).item() < 0.05
    with pytest.raises(SystemExit):
        main(["replay", "--datastore", str(store), "--out", str(tmp_path / "neg"), "--newest", "-1"] + common)
    assert "--newest must be ≥ 0" in capsys.readouterr().err and not (tmp_path / "neg").exists()
    assert main(["replay", "--datastore", str(tmp_path), "--out", str(out)] + common) == 2
    assert "no datastore" in capsys.readouterr().err


def _split_at(flat: list[int], sep: int) -> list[list[int]]:
    """``flat`` cut at every ``sep`` (the separator dropped; a datastore ends each reply with one)."""
    out, cur = [], []
    for t in flat:
        if t == sep:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_finish_from_a_feature_layer_equals_the_full_forward(family):
    """The layers after a feature layer, run on its stored outputs, give the model's own final
    hidden states on every real token of a padded batch (what --kd's target distributions need)."""
    target = tiny_target(family, dtype=torch.float64, layers=5)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (3, 11), generator=gen)
    valid = torch.ones(3, 11, dtype=torch.bool)
    valid[1, 7:] = False  # padding after the end, as make_batch pads
    valid[2, 4:] = False
    with torch.no_grad():
        out = target.model.get_decoder()(input_ids=ids, attention_mask=valid.long(), output_hidden_states=True)
    for layer in (0, 2, 3):
        got = target.finish_from(out.hidden_states[layer + 1], layer, valid)
        assert torch.allclose(got[valid], out.last_hidden_state[valid], atol=1e-10), (family, layer)


def _sgd_losses(drafter, loss_fn, steps: int = 25, lr: float = 0.5) -> list[float]:
    """The loss before each of ``steps`` plain SGD steps on ``loss_fn()``."""
    opt = torch.optim.SGD(drafter.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_kd_targets_are_the_targets_distributions_and_train(tmp_path):
    """target_distributions gives, for each label of a block, the target's next-token distribution
    at the position before it (its argmax is the greedy label); a --kd step back-propagates it."""
    from bastion.distill import Batch, _train_step, target_distributions

    target = tiny_target("llama", dtype=torch.float64, layers=4)
    drafter = tiny_drafter(target, block_size=4).train()
    target.set_feature_layers(drafter.cfg.target_layer_ids)
    prompt = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        seq = target.model.generate(prompt, max_new_tokens=12, do_sample=False)  # greedy: labels = argmax
    ids = torch.cat([seq, seq])
    valid = torch.ones_like(ids, dtype=torch.bool)
    feats = target.batch_features(ids, valid.long()).clone()
    anchors = torch.tensor([[2, 5], [4, 8]])
    B, mask_id = 4, target.vocab_size - 1
    block_pos = (anchors[:, :, None] + torch.arange(B)).reshape(2, -1)
    block_ids = torch.full((2, 2, B), mask_id)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    labels = ids.gather(1, (anchors[:, :, None] + 1 + torch.arange(B - 1)).reshape(2, -1))
    batch = Batch(feats, valid, block_ids.reshape(2, -1), block_pos, labels, anchors, ids)
    logp = target_distributions(drafter, target, batch, B - 1)
    assert logp.shape == (2, 2 * (B - 1), target.vocab_size)
    assert torch.allclose(logp.exp().sum(-1), torch.ones(2, 2 * (B - 1), dtype=logp.dtype))
    assert torch.equal(logp.argmax(-1), labels)
    with torch.no_grad():  # and each row is the full model's distribution at that position
        full = torch.log_softmax(target.model(ids).logits, -1)
    at = (anchors[:, :, None] + torch.arange(B - 1)).reshape(2, -1)
    assert torch.allclose(logp, full.gather(1, at[:, :, None].expand(-1, -1, full.shape[-1])).float(), atol=1e-5)
    losses = _sgd_losses(drafter, lambda: _train_step(drafter, target, batch, 5.0, None, kd=1.0)[0])
    assert losses[-1] < losses[0] - 0.1, losses  # the soft term alone trains the drafter


def test_acceptance_weights_give_the_gradient_of_the_expected_chain_length():
    """Σ_j w_j·(−log q_j) with the weights held fixed has exactly the gradient of −E[L] = −Σ_d Π_{k≤d} q_k;
    a label that cannot be hit (−inf) ends the chain: no weight from it on."""
    from bastion.distill import acceptance_weights

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2, 6, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (3, 2, 6), generator=gen)
    logq = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    hit = torch.ones_like(labels, dtype=torch.bool)
    hit[1, 0, 2] = False  # e.g. a label outside the draft vocabulary
    lq = torch.where(hit, logq, float("-inf"))
    w = acceptance_weights(lq).double()
    assert torch.all(w[1, 0, 3:] == 0) and torch.all(w[1, 0, :2] > 0)
    assert torch.all(w[..., :-1] >= w[..., 1:])  # a deeper label never carries more chain
    surrogate = -(w * torch.where(hit, logq, 0.0)).sum()
    expected = torch.exp(torch.cumsum(lq, -1)).sum()
    g1, = torch.autograd.grad(surrogate, logits, retain_graph=True)
    g2, = torch.autograd.grad(-expected, logits)
    assert torch.allclose(g1, g2, atol=1e-12)


def test_an_accept_step_trains_and_differs_from_the_decay_loss():
    """--accept β puts the labels' weight where the chain rides: the loss of a batch differs from the
    fixed decay's, and steps on it lower it."""
    from bastion.distill import make_batch, _train_step

    target = tiny_target("llama", dtype=torch.float32, layers=4)  # make_batch stores features in float32
    drafter = tiny_drafter(target, block_size=5).train()
    target.set_feature_layers(drafter.cfg.target_layer_ids)
    gen = torch.Generator().manual_seed(2)
    recs = []
    for _ in range(4):
        ids = torch.randint(0, target.vocab_size - 1, (30,), generator=gen)
        recs.append({"ids": ids, "prompt_len": 4, "feats": target.batch_features(ids[None], torch.ones(1, 30, dtype=torch.long))[0].clone()})
    batch = make_batch(recs, 4, 3, 5, target.vocab_size - 1, random.Random(0))
    plain, _, _ = _train_step(drafter, target, batch, 5.0, None)
    mixed, _, _ = _train_step(drafter, target, batch, 5.0, None, accept=1.0)
    assert abs(plain.item() - mixed.item()) > 1e-6
    losses = _sgd_losses(drafter, lambda: _train_step(drafter, target, batch, 5.0, None, accept=0.5)[0])
    assert losses[-1] < losses[0] - 0.1, losses


def test_fit_rejects_an_accept_weight_outside_0_1(capsys):
    from bastion.train import main

    with pytest.raises(SystemExit):
        main(["fit", "--data", "x", "--ckpt", "y", "--accept", "-0.5"])
    assert "--accept -0.5" in capsys.readouterr().err


def test_fit_rejects_a_kd_weight_outside_0_1(capsys):
    from bastion.train import main

    with pytest.raises(SystemExit):
        main(["fit", "--data", "x", "--ckpt", "y", "--kd", "1.5"])
    assert "--kd 1.5" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_layers_from_a_feature_layer_give_the_models_own_outputs(family):
    """Target.layers_from carries a stored layer's outputs to later layers exactly as the full
    forward computes them (padded batch), and refuses layer ids it cannot give."""
    target = tiny_target(family, dtype=torch.float64, layers=5)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.vocab_size, (2, 9), generator=gen)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 5:] = False
    target.set_feature_layers([1, 2, 3, 4])  # the hooks see each layer's raw output (the last one unnormed)
    with torch.no_grad():
        target.model.get_decoder()(input_ids=ids, attention_mask=valid.long())
    want = {i: target._captured[i] for i in (1, 2, 3, 4)}
    target._captured.clear()
    got = target.layers_from(want[1], 1, valid, [2, 4])
    assert len(got) == 2
    for g, i in zip(got, (2, 4)):
        assert torch.allclose(g[valid], want[i][valid], atol=1e-10), (family, i)
    for bad in ([1], [3, 2], [5], []):
        with pytest.raises(ValueError, match="must ascend"):
            target.layers_from(want[1], 1, valid, bad)


def test_a_widened_drafter_drafts_as_before_and_reads_the_new_layer():
    """widen_features appends a later target layer to the drafter's features with zero fc columns:
    the same context keys/values whatever that layer holds; extend_features computes it from the
    stored features as the target's hooks capture it; the engine runs such a drafter losslessly."""
    from bastion.engine import Engine, GenerationConfig
    from bastion.drafter_ops import extend_features, widen_features

    target = tiny_target("llama", dtype=torch.float64, layers=4)
    drafter = tiny_drafter(target, block_size=4)
    stored = list(drafter.cfg.target_layer_ids)
    assert stored[-1] < 3
    wide = widen_features(drafter, [3])
    assert wide.cfg.target_layer_ids == stored + [3] and wide.fc.weight.shape[1] == 3 * target.hidden_size
    ids = torch.randint(0, target.vocab_size - 1, (2, 10), generator=torch.Generator().manual_seed(2))
    valid = torch.ones(2, 10, dtype=torch.bool)
    target.set_feature_layers(stored + [3])
    full = target.batch_features(ids, valid.long())
    h = target.hidden_size
    extended = extend_features(target, full[..., :len(stored) * h], stored, stored + [3], valid)
    assert torch.allclose(extended, full, atol=1e-10)
    pos = torch.arange(10)[None].expand(2, -1)
    with torch.no_grad():
        before = drafter.context_kv(full[..., :len(stored) * h], pos)
        after = wide.context_kv(torch.cat([full[..., :len(stored) * h], torch.randn(2, 10, h, dtype=full.dtype)], -1), pos)
    for (k0, v0), (k1, v1) in zip(before, after):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    with pytest.raises(ValueError, match="ascending layer ids after"):
        widen_features(drafter, [stored[-1]])
    with pytest.raises(ValueError, match="ascending layer ids after"):
        widen_features(drafter, [4])
    with pytest.raises(ValueError, match="not a prefix"):
        extend_features(target, full, [0, 3], [1, 3], valid)
    with torch.no_grad():  # a drafter reading the last layer, in the engine: greedy output equals AR's
        wide.fc.weight.normal_(0, 0.1)
    engine = Engine(target, wide, kernels="torch", stop_ids=set())
    prompt = [5, 9, 13, 2]
    ref = engine.run(prompt, GenerationConfig(strategy="ar", max_new_tokens=16)).token_ids
    for strategy in ("chain", "fixed", "bastion"):
        assert engine.run(prompt, GenerationConfig(strategy=strategy, max_new_tokens=16)).token_ids == ref, strategy


def test_fit_adds_a_feature_layer_to_an_init_drafter(tmp_path, capsys):
    """fit --init D --add-feature-layers 29 trains the shipped drafter reading the target's last layer
    as well (its features computed per batch from the stored layer 27) and exports a loadable folder;
    resuming without the option, or an id that is not later than the data's, is refused."""
    from bastion.drafter_io import load_drafter
    from bastion.train import main

    fit = _two_step_fit_from_the_shipped_drafter(tmp_path)
    with pytest.raises(SystemExit):
        main(fit + ["--add-feature-layers", "29,x"])
    assert "comma-separated layer ids" in capsys.readouterr().err
    with pytest.raises(ValueError, match="ascending layer ids after"):
        main(fit + ["--add-feature-layers", "18"])
    assert main(fit + ["--add-feature-layers", "29"]) == 0
    wide = load_drafter(tmp_path / "drafter", 576, 49152, 30)
    assert wide.cfg.target_layer_ids == [1, 10, 18, 27, 29] and wide.fc.weight.shape[1] == 5 * 576
    assert wide.fc.weight[:, 4 * 576:].abs().max() > 0  # the new columns trained
    with pytest.raises(ValueError, match="resume with the --add-feature-layers"):
        main(fit + ["--steps", "4"])


def test_average_of_drafters_is_their_mean_and_refuses_strangers(tmp_path, capsys):
    """average_drafters is the element-wise mean (draft vocabulary kept); `train average` writes it as a
    loadable folder; drafters of other shapes or vocabularies, one input, or --out an input are refused."""
    from bastion.drafter_io import load_drafter, save_drafter
    from bastion.drafter_ops import average_drafters, widen_features
    from bastion.train import main

    target = tiny_target("llama", dtype=torch.float32, layers=4)
    a, b = tiny_drafter(target, seed=1), tiny_drafter(target, seed=2)
    vocab = torch.arange(0, 60)
    a.set_draft_vocab(vocab)
    b.set_draft_vocab(vocab)
    mean = average_drafters([a, b])
    for k, v in mean.state_dict().items():
        if v.is_floating_point():
            assert torch.allclose(v, (a.state_dict()[k] + b.state_dict()[k]) / 2, atol=1e-6), k
    assert torch.equal(mean.draft_vocab, vocab)
    with pytest.raises(ValueError, match="differs from drafter 1 in num_hidden_layers"):
        average_drafters([a, tiny_drafter(target, layers=2)])
    with pytest.raises(ValueError, match="differs from drafter 1 in target_layer_ids"):
        average_drafters([a, widen_features(b, [3])])
    c = tiny_drafter(target, seed=3)
    c.set_draft_vocab(torch.arange(1, 61))
    with pytest.raises(ValueError, match="another draft vocabulary"):
        average_drafters([a, c])
    with pytest.raises(ValueError, match="no drafters"):
        average_drafters([])
    # the command, on copies of the shipped drafter (the embedded target checks them as it loads)
    shipped = Path(__file__).resolve().parent.parent / "assets" / "drafter-smollm2-135m"
    one = load_drafter(shipped, 576, 49152, 30)
    two = load_drafter(shipped, 576, 49152, 30)
    with torch.no_grad():
        two.fc.weight.add_(0.5)
    save_drafter(one, tmp_path / "one", dtype=torch.float16)
    save_drafter(two, tmp_path / "two", dtype=torch.float16)
    for args, msg in [(["--drafter", str(tmp_path / "one")], "two or more"),
                      (["--drafter", str(tmp_path / "one"), "--drafter", str(tmp_path / "two"),
                        "--out", str(tmp_path / "two")], "is one of the inputs")]:
        with pytest.raises(SystemExit):
            main(["average", "--out", str(tmp_path / "x")] + args if "--out" not in args else ["average"] + args)
        assert msg in capsys.readouterr().err
    assert main(["average", "--drafter", str(tmp_path / "one"), "--drafter", str(tmp_path / "missing"),
                 "--out", str(tmp_path / "x")]) == 2
    assert "missing" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["average", "--drafter", str(tmp_path / "one"), "--drafter", str(tmp_path / "two"),
                 "--out", str(tmp_path / "mean"), "--threads", "1"]) == 0
    got = load_drafter(tmp_path / "mean", 576, 49152, 30)
    assert torch.allclose(got.fc.weight, one.fc.weight + 0.25, atol=2e-3)  # fp16 storage
    assert torch.equal(got.draft_vocab, one.draft_vocab)


def test_a_new_drafter_starts_from_its_seed_and_leaves_the_global_generator_alone():
    from bastion.fitting import FitConfig, _fit_drafter

    target = tiny_target(dtype=torch.float32)

    def start(seed):
        drafter = _fit_drafter(target, FitConfig(seed=seed, layers=1, block=4, mask_token_id=5), [1, 2])
        return {k: v.clone() for k, v in drafter.state_dict().items()}

    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = start(3), start(3), start(4)
    assert torch.equal(torch.rand(3), before)  # the caller's random stream is untouched
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # another seed, another start


def test_checked_records_mark_exactly_the_tokens_the_target_would_not_have_written():
    """``_records(check=True)``: a reply the target wrote greedily agrees everywhere; a reply with one
    token changed disagrees there, and at every other reply position agrees iff that token is the
    full model's argmax after the text before it."""
    from bastion.traindata import _records

    torch.manual_seed(3)
    target = tiny_target("llama", vocab=64, dtype=torch.float32, layers=3)
    target.set_feature_layers([1, 2])
    prompt = [5, 9, 2, 7]
    with torch.inference_mode():
        greedy = target.model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                       pad_token_id=0)[0].tolist()
    bent = list(greedy)
    bent[7] = (bent[7] + 1) % 64
    recs = _records(target, [greedy, bent], [4, 4], pad=0, features=True, check=True)
    assert recs[0]["agree"].all() and recs[0]["feats"].shape == (len(greedy), 2 * target.hidden_size)
    with torch.inference_mode():
        best = target.model(input_ids=torch.tensor([bent])).logits[0].argmax(-1)
    want = [True] * 4 + [int(best[t - 1]) == bent[t] for t in range(4, len(bent))]
    assert recs[1]["agree"].tolist() == want and not want[7]
    # unchecked records carry no mark, and checked ones need no features
    assert "agree" not in _records(target, [bent], [4], pad=0)[0]
    assert "feats" not in _records(target, [bent], [4], pad=0, features=False, check=True)[0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_shard_keeps_the_features_generate_computed_and_they_equal_a_separate_forward(family):
    """``_shard`` with the target writing: each reply is the prompt's own greedy continuation, cut at
    its first end token (one prompt ends early, the others run to the limit), and the streamed
    features of every kept token equal ``_records``' forward over the finished sequences."""
    from types import SimpleNamespace

    from bastion.traindata import _records, _shard

    target = tiny_target(family, vocab=64, dtype=torch.float32, layers=3)
    enc = [[5, 9, 2, 7], [3, 4], [8, 1, 6, 2, 2, 9]]
    alone = []
    with torch.inference_mode():
        for e in enc:
            g = target.model.generate(input_ids=torch.tensor([e]), max_new_tokens=10, do_sample=False,
                                      pad_token_id=0)[0, len(e):].tolist()
            alone.append(g)
    # an end token that the first reply writes early and the others never write
    end = next(t for t in alone[0][1:6] if t != 0 and all(t not in g for g in alone[1:]))
    target.tokenizer = SimpleNamespace(eos_token_id=end)
    recs = _shard(target, target.model, enc, pad=0, max_new_tokens=10, layer_ids=[0, 2], features=True,
                  check=False)
    for e, g, r in zip(enc, alone, recs):
        stop = next((i for i, t in enumerate(g) if t in (end, 0)), len(g) - 1)
        assert r["ids"].tolist() == e + g[:stop + 1] and r["prompt_len"] == len(e)
    assert len(recs[0]["ids"]) < len(enc[0]) + 10 and len(recs[1]["ids"]) == len(enc[1]) + 10
    target.set_feature_layers([0, 2])
    ref = _records(target, [r["ids"].tolist() for r in recs], [len(e) for e in enc], pad=0)
    for r, want in zip(recs, ref):
        assert r["feats"].dtype == torch.float16 and r["feats"].shape == (len(r["ids"]), 2 * target.hidden_size)
        torch.testing.assert_close(r["feats"].float(), want["feats"].float(), rtol=2e-3, atol=2e-3)
    # ids only, or a copy writing: the separate forward makes the records as before
    plain = _shard(target, target.model, enc, pad=0, max_new_tokens=10, layer_ids=[0, 2], features=False,
                   check=False)
    assert [p["ids"].tolist() for p in plain] == [r["ids"].tolist() for r in recs]
    assert all("feats" not in p for p in plain)
    with pytest.raises(ValueError, match="out of range"), target.feature_stream([0, 3]):
        pass


def test_a_batch_drops_the_labels_at_and_past_a_disagreement_in_each_block():
    """make_batch: with ``agree`` False at position m, a block anchored at a keeps its depth-k label
    iff a + k < m or a ≥ m; records without ``agree`` keep every label."""
    from bastion.distill import make_batch

    n, plen, m, block = 20, 3, 11, 5
    ids = torch.arange(1, n + 1, dtype=torch.int32)
    agree = torch.ones(n, dtype=torch.bool)
    agree[m] = False
    rec = {"ids": ids, "prompt_len": plen, "feats": torch.zeros(n, 4), "agree": agree}
    checked = make_batch([rec], 6, 8, block, 99, random.Random(5))
    plain = make_batch([{k: v for k, v in rec.items() if k != "agree"}], 6, 8, block, 99, random.Random(5))
    assert torch.equal(checked.anchor_pos, plain.anchor_pos)
    anchors = checked.anchor_pos.flatten().tolist()
    assert any(a < m <= a + block - 1 for a in anchors)  # the case that matters was drawn
    lab = checked.labels.view(-1, block - 1)
    ref = plain.labels.view(-1, block - 1)
    for j, a in enumerate(anchors):
        for k in range(1, block):
            keep = a + k < m or a >= m
            assert lab[j, k - 1] == (ref[j, k - 1] if keep else -100), (a, k)


def test_a_batch_of_any_text_trains_the_targets_greedy_choices_up_to_one_past_a_departure():
    """make_batch on a ``greedy`` record (g_t: the target's choice after tokens ≤ t): the depth-k label
    of anchor a is g_{a+k−1}, kept iff the text's tokens a+1..a+k−1 are the target's choices — here the
    text departs at m (the target would write 500 there), so a block keeps k ≤ m − a (the last of
    them is 500) or everything when a ≥ m; labels past the end are dropped."""
    from bastion.distill import make_batch

    n, plen, m, block = 20, 3, 11, 6
    ids = torch.arange(1, n + 1, dtype=torch.int32)
    greedy = torch.cat([ids[1:], torch.tensor([7], dtype=torch.int32)])  # g_t = x_{t+1}: the text agrees
    greedy[m - 1] = 500
    rec = {"ids": ids, "prompt_len": plen, "feats": torch.zeros(n, 4), "greedy": greedy}
    batch = make_batch([rec], 8, 8, block, 99, random.Random(3))
    anchors = batch.anchor_pos.flatten().tolist()
    assert any(a < m < a + block - 1 for a in anchors) and any(a >= m for a in anchors)  # both cases drawn
    lab = batch.labels.view(-1, block - 1)
    for j, a in enumerate(anchors):
        for k in range(1, block):
            t = a + k  # the label's position
            if t >= n or (a < m <= t - 1):
                want = -100
            else:
                want = 500 if t == m else t + 1  # x_t = t + 1
            assert lab[j, k - 1] == want, (a, k)


@pytest.mark.slow
def test_bf16_generated_data_is_checked_and_recorded(tmp_path):
    """``data --gen-dtype bfloat16`` on the embedded target: shards carry ``agree``, the folder
    remembers the dtype, and a float32 run into it is refused."""
    from bastion.train import main

    data = tmp_path / "data"
    common = ["--out", str(data), "--prompts", "2", "--batch", "2", "--max-new-tokens", "24", "--threads", "1"]
    assert main(["data", "--gen-dtype", "bfloat16"] + common) == 0
    recs = torch.load(data / "shard_00000.pt")
    assert all(r["agree"].dtype == torch.bool and len(r["agree"]) == len(r["ids"]) for r in recs)
    assert all(r["agree"][:r["prompt_len"]].all() for r in recs)
    assert json.loads((data / "meta.json").read_text())["gen_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="gen_dtype"):
        main(["data", "--gen-dtype", "float32"] + common)


@pytest.mark.slow
def test_a_bf16_copy_writes_the_self_requests_and_float32_the_replies(tmp_path, monkeypatch, capsys):
    """``data --corpus self --request-dtype bfloat16``: a bf16 copy samples the request list, the
    float32 target writes the replies (features streamed from its own generation, no ``agree``), and
    the folder records both dtypes; with another corpus the flag is refused before anything loads."""
    from bastion import traindata
    from bastion.train import main

    writers = []
    real = traindata.make_requests

    def spy(target, n, **kw):
        writers.append(next(kw["model"].parameters()).dtype)
        return real(target, n, **kw)

    monkeypatch.setattr(traindata, "make_requests", spy)
    data = tmp_path / "data"
    common = ["--out", str(data), "--prompts", "2", "--batch", "2", "--max-new-tokens", "16", "--threads", "1"]
    assert main(["data", "--corpus", "self", "--request-dtype", "bfloat16"] + common) == 0
    assert writers == [torch.bfloat16]
    assert len(json.loads((data / "requests.json").read_text())) == 2
    meta = json.loads((data / "meta.json").read_text())
    assert meta["request_dtype"] == "bfloat16" and meta["gen_dtype"] == "float32"
    recs = torch.load(data / "shard_00000.pt")
    assert len(recs) == 2 and all("feats" in r and "agree" not in r for r in recs)
    with pytest.raises(SystemExit):
        main(["data", "--corpus", "base", "--request-dtype", "bfloat16", "--out", str(tmp_path / "b")])
    assert "--request-dtype is for --corpus self" in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_feature_noise_is_scaled_per_layer_and_drawn_from_its_seed():
    """noisy_features: x + σ·rms(x)·ε per token and per feature layer — a layer ten times larger gets
    ten times the noise — the same seed draws the same noise, another seed other noise, σ = 0 none."""
    from bastion.distill import noisy_features

    h = 64
    small, large = torch.randn(3, 50, h), 10 * torch.randn(3, 50, h)
    feats = torch.cat([small, large], dim=-1)
    out = noisy_features(feats, 0.5, h, seed=7)
    assert out.shape == feats.shape and out.dtype == feats.dtype
    d = (out - feats).view(3, 50, 2, h)
    rms = feats.view(3, 50, 2, h).pow(2).mean(-1).sqrt()            # [3, 50, 2]
    ratio = d.pow(2).mean(-1).sqrt() / rms                          # per token and layer ≈ σ
    assert 0.4 < ratio.mean().item() < 0.6 and (ratio[..., 0].mean() / ratio[..., 1].mean() - 1).abs() < 0.1
    assert torch.equal(noisy_features(feats, 0.5, h, seed=7), out)
    assert not torch.equal(noisy_features(feats, 0.5, h, seed=8), out)
    assert noisy_features(feats, 0.0, h, seed=7) is feats


def test_fit_trains_on_noisy_features_and_rejects_a_bad_sigma(tmp_path, capsys):
    """fit --feature-noise σ: the loss of the same batch stream moves (the features differ), the log
    says the scale, and a σ outside [0, 10] is refused before anything loads; --reveal likewise."""
    from bastion.train import main

    with pytest.raises(SystemExit):
        main(["fit", "--data", "x", "--ckpt", "y", "--feature-noise", "-0.1"])
    assert "--feature-noise -0.1" in capsys.readouterr().err
    data = tmp_path / "data"
    common = ["--threads", "1"]
    assert main(["data", "--out", str(data), "--prompts", "2", "--batch", "2", "--max-new-tokens", "8"] + common) == 0

    def losses(sigma: str) -> list[dict]:
        ckpt = tmp_path / f"ckpt-{sigma}"
        assert main(["fit", "--data", str(data), "--ckpt", str(ckpt), "--rows", "2", "--anchors", "2",
                     "--loss-depths", "3", "--steps", "3", "--no-bf16", "--feature-noise", sigma] + common) == 0
        return [json.loads(x) for x in (ckpt / "log.jsonl").read_text().splitlines()]

    plain, noisy = losses("0"), losses("0.5")
    assert "feature_noise" not in plain[0] and noisy[0]["feature_noise"] == 0.5
    assert abs(plain[0]["loss"] - noisy[0]["loss"]) > 1e-4
    # fit --reveal: revealed prefixes (distill.reveal_prefixes) in the same stream; a share outside [0, 1] refused
    with pytest.raises(SystemExit):
        main(["fit", "--data", "x", "--ckpt", "y", "--reveal", "1.5"])
    assert "--reveal 1.5" in capsys.readouterr().err
    ckpt = tmp_path / "ckpt-reveal"
    assert main(["fit", "--data", str(data), "--ckpt", str(ckpt), "--rows", "2", "--anchors", "4", "--block", "6",
                 "--loss-depths", "3", "--steps", "3", "--no-bf16", "--reveal", "0.5"] + common) == 0
    log = [json.loads(x) for x in (ckpt / "log.jsonl").read_text().splitlines()]
    assert len(log) == 3 and all(row["reveal"] == 0.5 and row["loss"] == row["loss"] for row in log)  # not NaN
    # ids-only data (the GPU recipe): the target's live features are noised too — the batch carries no
    # features until the target computes them, which once reached the noise as None and crashed
    ids = tmp_path / "ids"
    assert main(["data", "--out", str(ids), "--prompts", "2", "--batch", "2", "--max-new-tokens", "8",
                 "--no-features"] + common) == 0
    live = tmp_path / "ckpt-live"
    assert main(["fit", "--data", str(ids), "--ckpt", str(live), "--rows", "2", "--anchors", "2", "--live-features",
                 "--loss-depths", "3", "--steps", "3", "--no-bf16", "--feature-noise", "0.5"] + common) == 0
    live_log = [json.loads(x) for x in (live / "log.jsonl").read_text().splitlines()]
    assert live_log[0]["feature_noise"] == 0.5 and abs(live_log[0]["loss"] - noisy[0]["loss"]) < 1e-3


def test_reveal_prefixes_put_labels_in_place_of_masks_and_drop_them():
    """distill.reveal_prefixes: a revealed block is [x_a, y_1..y_j, MASK...] with y its labels, which
    are then dropped; blocks whose prefix labels are not all kept stay as they were; share 0 changes
    nothing, and the draw follows the batch stream's generator."""
    import random

    from bastion.distill import Batch, reveal_prefixes

    r, A, B, mask = 3, 40, 6, 99
    rng = random.Random(0)
    labels = torch.tensor([[rng.randrange(50) for _ in range(A * (B - 1))] for _ in range(r)])
    labels[0, 0] = -100  # block 0 of row 0: depth 1 lost, so nothing may be revealed there
    block_ids = torch.full((r, A, B), mask)
    block_ids[:, :, 0] = 7
    batch = Batch(None, torch.ones(r, 9, dtype=torch.bool), block_ids.view(r, A * B), torch.zeros(r, A * B),
                  labels, torch.zeros(r, A, dtype=torch.long), torch.zeros(r, 9, dtype=torch.long))
    assert reveal_prefixes(batch, 0.0, random.Random(1)) is batch
    out = reveal_prefixes(batch, 0.6, random.Random(1))
    again = reveal_prefixes(batch, 0.6, random.Random(1))
    assert torch.equal(out.block_ids, again.block_ids) and torch.equal(out.labels, again.labels)
    ids, lab, old = out.block_ids.view(r, A, B), out.labels.view(r, A, B - 1), labels.view(r, A, B - 1)
    js = []
    for i in range(r):
        for a in range(A):
            j = int((ids[i, a, 1:] != mask).sum())
            js.append(j)
            assert ids[i, a, 0] == 7 and (ids[i, a, 1 + j:] == mask).all()  # a prefix, nothing else
            assert torch.equal(ids[i, a, 1:1 + j], old[i, a, :j])           # the labels, revealed
            assert (lab[i, a, :j] == -100).all() and torch.equal(lab[i, a, j:], old[i, a, j:])
    assert js[0] == 0 and max(js) <= B - 2
    revealed = sum(j > 0 for j in js) / len(js)
    assert 0.4 < revealed < 0.8 and js.count(1) > js.count(B - 2)  # the share, and P(j) ∝ 1/j
    assert torch.equal(batch.labels, labels)  # the input batch is left alone


def test_fit_trains_in_float32_on_a_cpu_without_amx(tmp_path, capsys, monkeypatch):
    """bf16 autocast is emulated on CPUs without AVX512-BF16 (~20× slower than float32) and still
    slower with it but without AMX (~2×): fit says so and trains in float32; the flag tests read the
    CPU's own flags."""
    from bastion.kernels import cpu_build
    from bastion.train import main

    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : fpu sse2 avx2 fma")
    assert not cpu_build.cpu_has_amx()
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : avx2 avx512f avx512_bf16")
    assert not cpu_build.cpu_has_amx()
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : avx512_bf16 amx_tile amx_bf16 amx_int8")
    assert cpu_build.cpu_has_amx()
    data = tmp_path / "data"
    assert main(["data", "--out", str(data), "--prompts", "2", "--batch", "2", "--max-new-tokens", "8",
                 "--threads", "1"]) == 0
    seen = []
    import bastion.fitting as train_mod
    real = train_mod.train_step
    monkeypatch.setattr(train_mod, "train_step", lambda *a, **k: seen.append(a[4]) or real(*a, **k))
    fit = ["fit", "--data", str(data), "--rows", "2", "--anchors", "2", "--loss-depths", "2", "--steps", "1",
           "--threads", "1"]
    for has, ckpt in ((False, "a"), (True, "b")):
        monkeypatch.setattr(cpu_build, "cpu_has_amx", lambda has=has: has)
        capsys.readouterr()
        assert main(fit + ["--ckpt", str(tmp_path / ckpt)]) == 0
        assert ("training in float32" in capsys.readouterr().err) is not has
    assert seen == [False, True]


def test_progress_counts_down_to_a_deadline_that_comes_before_the_steps_run_out(capsys):
    t0 = time.time() - 10.0  # 10 steps in 10 s: 1 step/s
    progress(10, 100_000, t0)
    assert "eta 1666." in capsys.readouterr().err  # by the rate alone: ~99,990 s
    progress(10, 100_000, t0, deadline=time.time() + 120.0)
    assert "eta 2.0 min" in capsys.readouterr().err
    progress(10, 20, t0, deadline=time.time() + 3600.0)  # the steps end first: the rate's estimate
    assert "eta 0.2 min" in capsys.readouterr().err
    progress(10, 100_000, t0, deadline=time.time() - 5.0)  # past it: never negative
    assert "eta 0.0 min" in capsys.readouterr().err


def test_progress_rate_leaves_out_the_items_a_resumed_job_found_done(capsys):
    t0 = time.time() - 10.0
    progress(30, 100, t0, unit="replies", base=20)  # 10 written in 10 s, 70 to go
    err = capsys.readouterr().err
    assert "[30/100] 1.00 replies/s eta 1.2 min" in err


def test_pending_shards_skips_finished_shards_and_counts_items(tmp_path, capsys):
    (tmp_path / "shard_00001.pt").write_bytes(b"done")
    got = []
    for path, lo, hi in pending_shards(tmp_path, 10, 4, "replies"):
        got.append((path.name, lo, hi))
        path.write_bytes(b"x")
    assert got == [("shard_00000.pt", 0, 4), ("shard_00002.pt", 8, 10)]
    err = capsys.readouterr().err
    assert "[8/10]" in err and "[10/10]" in err and "replies/s" in err and "shard 3/3" in err
    assert list(pending_shards(tmp_path, 10, 4, "replies")) == []  # all done: nothing to write
