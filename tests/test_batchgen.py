"""The lean batched greedy loop that writes training data (``bastion/batchgen.py``)."""

from types import SimpleNamespace

import pytest
import torch

from bastion import batchgen
from bastion.traindata import _shard
from tiny import tiny_target

PROMPTS = [[5, 9, 2, 7], [3, 4], [8, 1, 6, 2, 2, 9], [11, 12, 13], [7], [2, 30, 31, 40, 41], [17, 18]]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_lean_loop_writes_what_generate_writes_with_the_same_features(family, monkeypatch):
    """``_shard`` through the lean loop (prompts read three rows at a time, finished rows dropped as
    soon as one ends) against the same batch through transformers' ``generate``: every reply
    identical, cut at its first end token (some end early, some run to the limit), and every kept
    token's features equal up to their fp16 storage."""
    target = tiny_target(family, vocab=64, dtype=torch.float64, layers=3)
    hf_alone = [target.model.generate(input_ids=torch.tensor([e]), max_new_tokens=12, do_sample=False,
                                      pad_token_id=0)[0, len(e):].tolist() for e in PROMPTS]
    # an end token that some replies write early and others never write
    counts = {t: sum(t in g[:8] for g in hf_alone) for t in range(1, 64)}
    end = max((t for t, c in counts.items() if 0 < c < len(PROMPTS) - 1), key=counts.get)
    target.tokenizer = SimpleNamespace(eos_token_id=end)
    calls = []
    real = batchgen.greedy_batch
    monkeypatch.setattr(batchgen, "greedy_batch", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    monkeypatch.setattr(batchgen, "PREFILL_ROWS", 3)
    monkeypatch.setattr(batchgen, "SHRINK_AT", 0.99)
    lean = _shard(target, target.model, PROMPTS, pad=0, max_new_tokens=12, layer_ids=[0, 2], features=True,
                  check=False)
    assert calls == [(len(PROMPTS), 6)]
    monkeypatch.setattr(batchgen, "qualifies", lambda model: False)
    hf = _shard(target, target.model, PROMPTS, pad=0, max_new_tokens=12, layer_ids=[0, 2], features=True,
                check=False)
    assert len(calls) == 1  # the second went through generate
    short = 0
    for e, alone, a, b in zip(PROMPTS, hf_alone, lean, hf):
        stop = next((i for i, t in enumerate(alone) if t in (end, 0)), len(alone) - 1)
        assert a["ids"].tolist() == b["ids"].tolist() == e + alone[:stop + 1]
        assert a["prompt_len"] == b["prompt_len"] == len(e)
        short += stop < 11
        assert a["feats"].dtype == torch.float16 and a["feats"].shape == b["feats"].shape
        torch.testing.assert_close(a["feats"].float(), b["feats"].float(), rtol=1e-3, atol=1e-3)
    assert 0 < short < len(PROMPTS)


def test_the_lean_loop_without_features_and_on_models_it_does_not_run():
    """ids only: the same tokens without a final read; a decoder it does not reproduce (GELU MLP) is
    refused by name, and ``_shard`` then uses ``generate``."""
    target = tiny_target("llama", vocab=64, dtype=torch.float32, layers=2)
    ids = torch.tensor([[0, 0, 5, 9], [3, 4, 8, 1]])
    valid = ids != 0
    with_feats = batchgen.greedy_batch(target.model, ids, valid, 6, [0, 1])
    bare = batchgen.greedy_batch(target.model, ids, valid, 6, [0, 1], features=False)
    assert bare.feats is None and torch.equal(bare.tokens, with_feats.tokens)
    assert with_feats.feats.shape == (2, 4 + 6, 2 * target.hidden_size)
    target.model.config.hidden_act = "gelu"
    assert not batchgen.qualifies(target.model)
    with pytest.raises(ValueError, match="SiLU"):
        batchgen.greedy_batch(target.model, ids, valid, 6, [0, 1])


@pytest.mark.parametrize("ends", [None, "early"])
def test_the_request_lists_sample_through_the_lean_loop_as_through_generate(ends, monkeypatch):
    """``_sample_lists`` (the ``self`` corpus's request lists): with rows kept to the end (no row
    dropped, so the sampler draws over the same rows in the same order) the lean loop and
    ``generate`` draw the same tokens from the same seed until a row ends (then ``generate`` feeds
    that row padding, whose nucleus changes what later draws consume); each row is cut after its
    first end token."""
    from bastion.traindata import _sample_lists

    target = tiny_target("llama", vocab=64, dtype=torch.float64, layers=2)
    ids = torch.tensor([[0, 0, 5, 9], [3, 4, 8, 1], [0, 7, 7, 2]])
    att = (ids != 0).long()
    if ends == "early":  # an end token the first row draws early
        torch.manual_seed(3)
        first = _sample_lists(target.model, ids, att, 10, pad=0)[0]
        target.model.generation_config.eos_token_id = first[2]
    monkeypatch.setattr(batchgen, "SHRINK_AT", 0.0)
    got = {}
    for how in ("lean", "generate"):
        if how == "generate":
            monkeypatch.setattr(batchgen, "qualifies", lambda model: False)
        torch.manual_seed(3)
        got[how] = _sample_lists(target.model, ids, att, 10, pad=0)
    same = min(map(len, got["lean"]))  # the steps until the first row ended
    assert [x[:same] for x in got["lean"]] == [x[:same] for x in got["generate"]]
    assert all(len(x) == 10 for x in got["generate"])  # generate pads finished rows
    if ends == "early":
        end = target.model.generation_config.eos_token_id
        assert len(got["lean"][0]) <= 3 and got["lean"][0][-1] == end and same < 10
        assert all(end not in x[:-1] for x in got["lean"])
    else:
        assert all(len(x) == 10 for x in got["lean"])
