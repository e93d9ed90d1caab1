"""The shipped drafter on the embedded SmolLM2 target (slow; CI runs it)."""

import pytest
import torch

from bastion.engine import Engine, GenerationConfig
from bastion.loading import DEFAULT_DRAFTER, EMBEDDED, encode_prompt, load_default_drafter, load_target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    target = load_target(EMBEDDED, torch.float32, "cpu", progress=None)
    drafter = load_default_drafter(target, None, EMBEDDED)
    assert drafter is not None, f"the shipped drafter is missing from {DEFAULT_DRAFTER}"
    return Engine(target, drafter, kernels="torch")


@pytest.mark.parametrize("prompt", ["Explain why the sky is blue.",
                                    "Write a Python function that returns the maximum of a list."])
def test_shipped_drafter_accepts_and_is_lossless(engine, prompt):
    ids = encode_prompt(engine.target.tokenizer, prompt)
    ar = engine.run(ids, GenerationConfig(strategy="ar", max_new_tokens=48))
    res = engine.run(ids, GenerationConfig(strategy="bastion", max_new_tokens=48))
    assert res.token_ids == ar.token_ids
    assert res.tau > 1.5, res.tau
