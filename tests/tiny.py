"""Tiny random models built from configs (no downloads) for fast CPU tests."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from bastion.drafter import DFlashDrafter, DrafterConfig
from bastion.drafter_config import spread_layer_ids
from bastion.target import Target


def tiny_target(family: str = "llama", vocab: int = 97, dtype=torch.float64, seed: int = 0, layers: int = 4,
                max_positions: int = 512) -> Target:
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if family == "llama":
        cfg = LlamaConfig(**common)
    elif family == "qwen3":
        cfg = Qwen3Config(head_dim=8, **common)
    else:
        raise ValueError(family)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # sharpen the output distribution a little so greedy paths are not all ties
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return Target(model.eval(), tokenizer=None)


def tiny_drafter(target: Target, block_size: int = 6, layers: int = 1, seed: int = 1, dtype=None,
                 features: int = 2) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=target.hidden_size, intermediate_size=48, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=target.vocab_size,
                        target_layer_ids=spread_layer_ids(target.num_layers, features), mask_token_id=target.vocab_size - 1,
                        num_target_layers=target.num_layers, block_size=block_size)
    return DFlashDrafter(cfg).to(dtype or target.dtype).eval()


def frozen_latency(engine, draft_s: float, overhead_s: float = 1e-4) -> None:
    """A latency model that no longer learns: T_d = ``draft_s``, T_o = ``overhead_s``, C(n) = 1 ms + 0.1 ms per node."""
    lat = engine.latency
    lat.draft_s, lat.overhead_s = draft_s, overhead_s
    lat.observe = lat.observe_overheads = lambda *a, **k: None
    lat.predict = lambda s, c: 1e-3 * (1 + 0.1 * s)


def path_logits_in_tree_and_alone(target: Target, ctx: torch.Tensor, path: list[int], siblings: list[int]
                                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits inside a tree, logits decoded alone) for each token of ``path`` after the context ``ctx``.

    Alone: one forward per token, each committed before the next. In the tree: the path with a sibling
    (``siblings[i]``, one per path token but the last) between each of its nodes, so every node's
    visible keys are interleaved with hidden ones. Leaves the target's cache empty.
    """
    from bastion.kernels import get_kernels

    kernels = get_kernels("torch")
    target.prefill(ctx)
    alone = []
    for tok in path:
        mask, pos = kernels.tree_mask([-1], target.cache_len, target.dtype, "cpu")
        alone.append(target.forward_tree(torch.tensor([tok]), mask, pos).logits[0])
        target.commit(target.cache_len - 1, [0])
    target.prefill(ctx)
    parents, tokens, rows = [-1], [path[0]], [0]
    for tok, sib in zip(path[1:], siblings):
        at = rows[-1]
        parents += [at, at]  # the sibling first: it sits between the path's nodes
        tokens += [sib, tok]
        rows.append(len(tokens) - 1)
    mask, pos = kernels.tree_mask(parents, target.cache_len, target.dtype, "cpu")
    tree = target.forward_tree(torch.tensor(tokens), mask, pos).logits
    target.reset()
    return [(tree[r], a) for r, a in zip(rows, alone)]


class OracleDrafter:
    """A test drafter that knows a reference continuation and scatters it among its top ranks.

    At depth i it puts the reference token at a random rank among the top ``spread`` with
    probability ``hit`` (random tokens otherwise), so trees contain deep accepted paths, accepted
    siblings of rejected nodes, and misses: every branch of the walk and the cache compaction runs.
    It is duck-typed to the DFlashDrafter inference interface used by the engine.
    """

    def __init__(self, inner: DFlashDrafter, reference: list[int], vocab: int, hit: float = 0.7,
                 spread: int = 3, seed: int = 0, sharpness: float = 2.0):
        self.inner, self.cfg, self.block_size = inner, inner.cfg, inner.block_size
        self.sharpness = sharpness  # logit scale: higher = a more confident drafter
        self.reference, self.vocab, self.hit, self.spread = reference, vocab, hit, spread
        self.gen = torch.Generator().manual_seed(seed)

    def new_cache(self):
        return self.inner.new_cache()

    def extend_cache(self, cache, features):
        self.inner.extend_cache(cache, features)

    def draft(self, cache, root, embed, lm_head, vocab=None, depth=None):  # no draft vocabulary: vocab stays None
        depth = depth or self.block_size - 1
        logits = torch.randn(depth, self.vocab, generator=self.gen)
        pos = cache.length + 1  # index in `reference` of the token after the root
        for i in range(depth):
            if pos + i < len(self.reference) and torch.rand(1, generator=self.gen).item() < self.hit:
                top = torch.topk(logits[i], self.spread).values
                rank = int(torch.randint(self.spread, (1,), generator=self.gen))
                logits[i, self.reference[pos + i]] = top[rank] + 0.01
        return torch.log_softmax(logits * self.sharpness, dim=-1)


def hf_greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy decoding of exactly n new tokens: the reference for lossless tests."""
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0].tolist()
