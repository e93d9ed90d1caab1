"""The shipped drafter on the embedded SmolLM2 target (slow; CI runs it)."""

import pytest
import torch

from bastion.engine import Engine, GenerationConfig
from bastion.loading import (DEFAULT_DRAFTER, EMBEDDED, encode_prompt, load_default_datastore, load_default_drafter,
                             load_target)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    target = load_target(EMBEDDED, torch.float32, "cpu", progress=None)
    drafter = load_default_drafter(target, None, EMBEDDED)
    assert drafter is not None, f"the shipped drafter is missing from {DEFAULT_DRAFTER}"
    datastore = load_default_datastore(target, None, EMBEDDED)
    assert datastore is not None, f"the shipped datastore is missing from {DEFAULT_DRAFTER}"
    return Engine(target, drafter, kernels="torch", datastore=datastore)


@pytest.mark.parametrize("prompt", ["Explain why the sky is blue.",
                                    "Write a Python function that returns the maximum of a list."])
def test_shipped_drafter_accepts_and_is_lossless(engine, prompt):
    """Acceptance is measured on a fixed 16-node tree (deterministic: it does not depend on timing);
    Bastion's adaptive trees depend on the online latency calibration, so only a floor is asserted."""
    ids = encode_prompt(engine.target.tokenizer, prompt)
    ar = engine.run(ids, GenerationConfig(strategy="ar", max_new_tokens=48))
    fixed = engine.run(ids, GenerationConfig(strategy="fixed", budget=16, max_new_tokens=48))
    steps = list(engine.generate(ids, GenerationConfig(strategy="bastion", max_new_tokens=48)))
    adaptive = engine.summarize(steps, len(ids))
    assert fixed.token_ids == ar.token_ids and adaptive.token_ids == ar.token_ids
    assert any(s.datastore_tokens for s in steps)  # the shipped datastore proposes on real text
    assert fixed.tau > 1.5, fixed.tau
    assert adaptive.tau > 1.2, adaptive.tau


def test_tree_logits_on_the_embedded_target_equal_one_token_decoding(engine):
    """On the real target (native products and attention when built here), a path verified inside a
    tree, with siblings between its nodes, has bit-identical logits to the same tokens decoded one
    forward each — the property that makes greedy verification exact."""
    from bastion.kernels import cpu_native
    from tiny import path_logits_in_tree_and_alone

    if not cpu_native.available():
        pytest.skip(f"native kernel unavailable: {cpu_native.unavailable_reason()}")
    target = engine.target
    ctx = torch.tensor(encode_prompt(target.tokenizer, "Name three rivers in Europe."))
    pairs = path_logits_in_tree_and_alone(target, ctx, [504, 3158, 2909, 30], [77, 99, 111])
    for depth, (in_tree, alone) in enumerate(pairs):
        assert torch.equal(in_tree, alone), depth


def test_the_probe_first_picks_a_product_path_per_row_count(engine):
    """Engine.probe_latency times each row count's exact 4/8-bit products down both native paths
    (probe.tune_wide_rows) and leaves the faster one set; a target without exact panels (a tiny
    float64 one) has nothing to choose and leaves the mask alone."""
    from bastion.kernels import cpu_native
    from bastion.probe import tune_wide_rows
    from tiny import tiny_target

    if cpu_native.wide_rows() is None:
        pytest.skip("no 512-bit path on this CPU")
    cpu_native.set_wide_rows(0x1234)
    tiny = tiny_target("llama", dtype=torch.float64)
    assert tune_wide_rows(tiny, engine.kernels, engine.timer) is None and cpu_native.wide_rows() == 0x1234
    calls = []  # ... and says so again without another forward (an AR engine asks before every request)
    tiny.prefill, prefill = (lambda *a, **k: calls.append(1)), tiny.prefill
    assert tune_wide_rows(tiny, engine.kernels, engine.timer, max_rows=1) is None and not calls
    tiny.prefill = prefill
    engine.probe_latency()
    assert engine.wide_rows is not None and cpu_native.wide_rows() == engine.wide_rows
    # the LM head's 8-bit products are timed alone for their own mask, set beside the 4-bit one
    assert engine.target.wide_rows_q8 is not None and cpu_native.wide_rows(q8=True) == engine.target.wide_rows_q8
    assert engine.padding is not None and len(engine.padding.to_dict()["seconds"]) == 16
    cpu_native.set_wide_rows(0)  # an engine sharing the target takes the same choice, not a new timing
    assert tune_wide_rows(engine.target, engine.kernels, engine.timer) == engine.wide_rows == cpu_native.wide_rows()
    assert cpu_native.wide_rows(q8=True) == engine.target.wide_rows_q8
    # an AR engine on a target nobody has timed chooses the one-row path only; a probe then times all 16
    engine.target.wide_rows, engine.target.wide_rows_timed = None, 0
    ar = Engine(engine.target, None, kernels="torch")
    ar.prepare(GenerationConfig(strategy="ar", max_new_tokens=4))
    assert ar.wide_rows is not None and engine.target.wide_rows_timed == 1
    assert ar.wide_rows & 0xFFFE == 0xFFFE and cpu_native.wide_rows() == ar.wide_rows
    engine.probe_latency()
    assert engine.target.wide_rows_timed == 16 and engine.wide_rows is not None
