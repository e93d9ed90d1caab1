"""The training pipeline: the offline corpus, and `python -m bastion.train data|fit|plot` end to end."""

import json

import pytest
import torch

from bastion.corpus import build_corpus
from bastion.loading import EVAL_PROMPTS


def _eval_prompts() -> set[str]:
    data = json.loads(EVAL_PROMPTS.read_text())
    return {p for v in data.values() if isinstance(v, list) for p in v}


@pytest.mark.parametrize("corpus", ["base", "broad"])
def test_corpus_is_deterministic_prefix_stable_and_disjoint_from_eval(corpus):
    big = build_corpus(3000, seed=0, exclude=_eval_prompts(), corpus=corpus)
    assert len(big) == len(set(big)) == 3000
    assert build_corpus(500, seed=0, exclude=_eval_prompts(), corpus=corpus) == big[:500]  # more data extends
    assert not set(big) & _eval_prompts()
    assert build_corpus(300, seed=1, corpus=corpus) != big[:300]


def test_corpus_excludes_what_it_is_told_and_rejects_unknown_names():
    first = build_corpus(10)
    assert first[0] not in build_corpus(10, exclude={first[0]})
    with pytest.raises(ValueError, match="unknown corpus"):
        build_corpus(10, corpus="wikipedia")


@pytest.mark.slow
def test_data_fit_resume_and_plot_on_the_embedded_target(tmp_path, capsys):
    """data → fit (stops after 2 steps) → fit again resumes at step 2 and continues to 4 → plot."""
    from bastion.drafter import load_drafter
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
