"""kernels.cpu_attention: regrouped grouped-query attention equals transformers' SDPA path; the native
route takes exactly the few-query float32 calls, and with it a tree verification computes bit-identical
logits to decoding the same tokens one at a time."""

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bastion.kernels import cpu_attention, cpu_native
from bastion.kernels.cpu_attention import NAME, NATIVE_NAME, grouped_sdpa_forward, native_attention_forward
from tiny import path_logits_in_tree_and_alone, tiny_target


def _inputs(n, heads=9, groups=3, length=100, d=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n, d, generator=g, dtype=dtype)
    k = torch.randn(1, heads // groups, length, d, generator=g, dtype=dtype)
    v = torch.randn(1, heads // groups, length, d, generator=g, dtype=dtype)
    mask = torch.zeros(1, 1, n, length, dtype=dtype)
    # a tree mask: each query sees the prefix and a random subset of the other new rows
    allowed = torch.rand(n, n, generator=g) < 0.5
    allowed |= torch.eye(n, dtype=torch.bool)
    mask[0, 0, :, length - n:] = torch.where(allowed, 0.0, float("-inf"))
    module = nn.Module()
    module.num_key_value_groups = groups
    return module, q, k, v, mask


@pytest.mark.parametrize("n", [2, 3, 8, 17, 64])
@pytest.mark.parametrize("heads,groups", [(9, 3), (4, 2), (8, 4)])
def test_equals_transformers_sdpa(n, heads, groups):
    module, q, k, v, mask = _inputs(n, heads, groups)
    got, _ = grouped_sdpa_forward(module, q, k, v, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (1, n, heads, q.shape[-1])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_new_mask_is_never_served_from_the_cache():
    module, q, k, v, mask = _inputs(6)
    grouped_sdpa_forward(module, q, k, v, mask)
    other = mask.clone()
    other[..., -3:] = float("-inf")
    other[..., -1] = 0.0
    got, _ = grouped_sdpa_forward(module, q, k, v, other)
    torch.testing.assert_close(got, sdpa_attention_forward(module, q, k, v, other)[0])
    mask[..., -2] = float("-inf")  # in place: the version changes
    torch.testing.assert_close(grouped_sdpa_forward(module, q, k, v, mask)[0],
                               sdpa_attention_forward(module, q, k, v, mask)[0])


def test_other_cases_go_to_transformers(monkeypatch):
    calls = []
    import transformers.integrations.sdpa_attention as sdpa

    real = sdpa.sdpa_attention_forward
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    module, q, k, v, mask = _inputs(1)
    grouped_sdpa_forward(module, q, k, v, mask)  # one query: transformers regroups it itself
    module, q, k, v, mask = _inputs(5)
    grouped_sdpa_forward(module, q, k, v, None, is_causal=True)  # prefill
    grouped_sdpa_forward(module, q, k, v, mask.bool())
    assert len(calls) == 3


def test_target_uses_it_and_logits_are_unchanged():
    a, b = tiny_target(), tiny_target()
    # float64: the native route (registered with the native linear kernel) hands every call on
    assert a.model.config._attn_implementation == (NATIVE_NAME if cpu_native.available() else NAME)
    b.model.set_attn_implementation("sdpa")
    ids = torch.arange(3, 20)
    for t in (a, b):
        t.prefill(ids)
    n, cache = 5, a.cache_len
    mask = torch.zeros(1, 1, n, cache + n, dtype=torch.float64)
    mask[0, 0, :, cache:] = torch.triu(torch.full((n, n), float("-inf"), dtype=torch.float64), 1)
    mask[0, 0, 3, cache + 1] = float("-inf")  # a branch: node 3 does not see node 1
    pos = torch.tensor([[cache, cache + 1, cache + 2, cache + 2, cache + 3]])
    toks = torch.tensor([5, 6, 7, 8, 9])
    got = a.forward_tree(toks, mask, pos).logits
    want = b.forward_tree(toks, mask, pos).logits
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert cpu_attention._mask_cache is not None  # the regrouping ran


needs_native = pytest.mark.skipif("not cpu_native.available()", reason="native kernel not built here")


@needs_native
def test_native_route_takes_few_float32_queries_only(monkeypatch):
    calls = []
    real = cpu_native.attention_unchecked
    monkeypatch.setattr(cpu_native, "attention_unchecked", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    module, q, k, v, mask = _inputs(5, dtype=torch.float32)
    mask = mask.clamp(min=torch.finfo(torch.float32).min)
    got, _ = native_attention_forward(module, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(got, sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)[0],
                               rtol=1e-5, atol=1e-6)
    native_attention_forward(module, q[:, :, :1], k, v, None)  # one query, no mask: every key visible
    assert calls == [5, 1]
    native_attention_forward(module, q, k, v, None, is_causal=True)  # prefill
    native_attention_forward(module, q.double(), k.double(), v.double(), mask.double())
    native_attention_forward(module, q, k, v, mask.bool())
    module, q, k, v, mask = _inputs(65, dtype=torch.float32)  # past MAX_QUERIES
    native_attention_forward(module, q, k, v, mask)
    assert calls == [5, 1]


@needs_native
def test_target_routes_attention_by_its_linear_mode():
    from bastion.target import Target

    assert tiny_target(dtype=torch.float32).model.config._attn_implementation == NATIVE_NAME
    fast = tiny_target(dtype=torch.float32)
    assert Target(fast.model, linear="fast").model.config._attn_implementation == NAME
    with pytest.raises(ValueError, match="for drafters"):
        Target(fast.model, linear="native-bf16")


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_logits_are_bit_identical_to_one_token_at_a_time(family):
    """Row-invariant products (cpu_native.linear) and attention (cpu_native.attention): the logits of
    a path inside a tree with siblings between its nodes equal, bit for bit, those of decoding the
    path's tokens one forward each — greedy verification is exact, not merely close."""
    t = tiny_target(family, dtype=torch.float32)
    pairs = path_logits_in_tree_and_alone(t, torch.arange(5, 45) % 90, [11, 12, 13, 14], [50, 51, 52])
    for depth, (in_tree, alone) in enumerate(pairs):
        assert torch.equal(in_tree, alone), depth
