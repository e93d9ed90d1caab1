"""The engine and training on a CUDA GPU with compiled Triton kernels (skipped without one).

fp32 on the GPU: a tree forward and a sequential one may pick different matrix kernels, so exact
equality is checked on tiny models where fp32 rounding cannot flip a sharpened argmax (the CPU
tests check the same in float64).
"""

import random

import pytest
import torch

from bastion.engine import Engine, GenerationConfig
from tiny import OracleDrafter, tiny_drafter, tiny_target

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


class DeviceOracle(OracleDrafter):
    """OracleDrafter whose draft distributions live on the target's device."""

    def draft(self, cache, root, embed, lm_head, vocab=None, depth=None):
        return super().draft(cache, root, embed, lm_head, vocab, depth).to(CUDA)


def cuda_target(family: str, **kw):
    target = tiny_target(family, dtype=torch.float32, **kw)
    target.model.to(CUDA)
    return target


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_every_strategy_equals_ar_on_cuda_with_triton(family):
    target = cuda_target(family)
    inner = tiny_drafter(target, block_size=6).to(CUDA)
    rng = random.Random(0)
    engine_ar = Engine(target, inner, kernels="triton", stop_ids=set())
    assert engine_ar.kernels.name == "triton"
    for trial in range(4):
        prompt = [rng.randrange(target.vocab_size - 1) for _ in range(rng.randint(1, 12))]
        ref = engine_ar.run(prompt, GenerationConfig(strategy="ar", max_new_tokens=24)).token_ids
        drafter = DeviceOracle(inner, prompt + ref, target.vocab_size, hit=0.85, spread=3, seed=trial)
        engine = Engine(target, drafter, kernels="triton", stop_ids=set())
        taus = []
        for strategy, kw in (("chain", {}), ("fixed", {"budget": 7}), ("fixed", {"budget": 40}), ("bastion", {})):
            res = engine.run(prompt, GenerationConfig(strategy=strategy, max_new_tokens=24, **kw))
            assert res.token_ids == ref, (family, trial, strategy, kw)
            taus.append(res.tau)
        assert max(taus) > 1.5  # the trees were accepted deep: the walk and the cache gather ran


def test_sampling_on_cuda_is_the_same_for_every_strategy():
    """Position-indexed random stream: one seed gives one sample whatever the tree (Triton node choice)."""
    target = cuda_target("qwen3", vocab=40, seed=5)
    with torch.no_grad():
        target.model.get_output_embeddings().weight.mul_(0.2)
    engine = Engine(target, tiny_drafter(target, block_size=5).to(CUDA), kernels="triton", stop_ids=set())
    for seed in range(3):
        outs = {s: engine.run([2, 3], GenerationConfig(strategy=s, max_new_tokens=16, temperature=1.0, top_p=0.9,
                                                        seed=seed, budget=9)).token_ids
                for s in ("ar", "chain", "fixed", "bastion")}
        assert len({tuple(v) for v in outs.values()}) == 1, outs


def test_live_feature_training_runs_on_cuda():
    from bastion.distill import make_batch, train_step
    from bastion.drafter_ops import new_drafter

    target = cuda_target("llama", vocab=50, layers=4)
    target.set_feature_layers([1, 2])
    for p in target.model.parameters():
        p.requires_grad_(False)
    rng = random.Random(0)
    records = [{"ids": torch.tensor([rng.randrange(50) for _ in range(n)], dtype=torch.int32), "prompt_len": 3}
               for n in (12, 20, 9, 15)]
    drafter = new_drafter(target, layers=1, layer_ids=[1, 2], block_size=4, mask_token_id=49).to(CUDA)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        batch = make_batch(records, 4, 4, 4, 49, rng).to(CUDA)
        loss, acc, _ = train_step(drafter, target, batch, gamma=5.0, bf16=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses
