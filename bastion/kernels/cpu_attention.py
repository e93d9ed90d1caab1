"""Grouped-query attention for few masked queries without copying the KV cache.

With grouped-query attention (SmolLM2-135M: 9 query heads share 3 key/value heads) transformers'
SDPA path runs a masked multi-query forward — a tree verification — by ``repeat_kv``: it copies the
cached keys and values of every layer into 9 heads first (2 × 0.7 MB per layer after 300 tokens),
~2.5 ms of a 37 ms 4-row forward on the development machine (torch profiler: ``aten::copy_``).
For one query transformers already avoids the copy by regrouping the query heads; this does the same
for n queries:

    query [b, H, n, d] → [b, G, (H/G)·n, d]         (the H/G heads that share a KV head, stacked)
    mask  [b, 1, n, L] → [b, 1, (H/G)·n, L]          (each head's rows see the same mask)
    out   [b, G, (H/G)·n, d] → [b, H, n, d] → [b, n, H, d]

which is the same attention (head h reads KV head h // (H/G), as in ``repeat_kv``) with no copy of
the cache. Anything else — GPUs, no mask, one query, more than 64 queries, extra arguments — goes to
transformers' own SDPA function unchanged.

:func:`native_attention_forward` (name ``NATIVE_NAME``; what :class:`bastion.target.Target` uses with
the native linear kernel) goes further where that kernel is built (``kernels.cpu_native.attention``):
CPU float32 decoding steps and tree verifications — 1–64 queries with an additive mask, or one query
without — run each (head, query) pair on its own in C. A row's output then depends only on its query
and the keys its mask row leaves visible, so a token verified inside a tree and the same token decoded
alone get bit-identical attention — with the row-invariant products, bit-identical logits: greedy
verification is exact by construction, where torch's flash attention differs by ~3e-5 in the logits.
It is also faster on these shapes (bench/NOTES.md). Everything else goes to :func:`grouped_sdpa_forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "bastion_grouped_sdpa"
NATIVE_NAME = "bastion_native_attention"
MAX_QUERIES = 64  # decoding regime; prefill (causal, no mask) never reaches the regrouping anyway
_EXTRAS = ("position_bias", "softcap", "cache", "sinks", "s_aux")  # arguments only transformers' SDPA handles

_mask_cache: tuple | None = None  # (source mask, its version, groups, regrouped mask)


def _regrouped_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, 1, n, L] → [b, 1, groups·n, L]; cached for the layers of one forward (same mask object)."""
    global _mask_cache
    c = _mask_cache
    # the source is held by the cache, so its id cannot be reused by a new tensor while cached
    if c is not None and c[0] is mask and c[1] == mask._version and c[2] == groups:
        return c[3]
    b, _, n, length = mask.shape
    out = mask[:, :, None].expand(b, 1, groups, n, length).reshape(b, 1, groups * n, length)
    _mask_cache = (mask, mask._version, groups, out)
    return out


def grouped_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs):
    """transformers attention-interface function: query [b, H, n, d], key/value [b, G, L, d], additive
    float mask [b, 1, n, L] → ([b, n, H, d], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, n, d = query.shape
    extra = any(kwargs.get(k) is not None for k in _EXTRAS)
    if (groups == 1 or query.device.type != "cpu" or attention_mask is None or n == 1 or n > MAX_QUERIES
            or extra or attention_mask.dtype == torch.bool or attention_mask.dim() != 4
            or attention_mask.shape[1] != 1 or attention_mask.shape[2] != n
            or attention_mask.shape[3] != key.shape[2] or dropout):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q = query.reshape(b, heads // groups, groups * n, d)
    mask = _regrouped_mask(attention_mask, groups)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, heads, n, d).transpose(1, 2).contiguous(), None


def _native_fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 dropout: float, kwargs: dict) -> bool:
    """Whether cpu_native.attention's conditions hold (checked here once, cheaply, per layer call)."""
    b, heads, n, d = query.shape
    if (b != 1 or not 1 <= n <= MAX_QUERIES or dropout or query.device.type != "cpu"
            or query.dtype != torch.float32 or key.dtype != torch.float32 or value.dtype != torch.float32
            or key.shape != value.shape or key.shape[0] != 1 or key.shape[3] != d or heads % key.shape[1]
            or any(kwargs.get(k) is not None for k in _EXTRAS)):
        return False
    if mask is None:
        return n == 1  # one query sees every cached key; several without a mask would be causal
    return (mask.dtype == torch.float32 and mask.dim() == 4 and mask.shape[0] == 1 and mask.shape[1] == 1
            and mask.shape[2] == n and mask.shape[3] == key.shape[2])


def native_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, **kwargs):
    """transformers attention-interface function: few CPU float32 queries through the native kernel
    (module docstring), everything else through :func:`grouped_sdpa_forward`. Shapes as there."""
    from . import cpu_native

    if _native_fits(query, key, value, attention_mask, dropout, kwargs) and cpu_native.available():
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return cpu_native.attention_unchecked(query, key, value, attention_mask, float(scale)), None
    return grouped_sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                is_causal=is_causal, **kwargs)


def use_grouped_attention(model, native: bool = False) -> bool:
    """Route `model`'s SDPA attention through :func:`grouped_sdpa_forward` — or, with ``native``,
    :func:`native_attention_forward` — registered with transformers under ``NAME`` (``NATIVE_NAME``)
    with SDPA's mask builder; True when switched. Models on another attention implementation (eager,
    flash) are left alone."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", NAME, NATIVE_NAME):
        return False
    name, fn = (NATIVE_NAME, native_attention_forward) if native else (NAME, grouped_sdpa_forward)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    return model.config._attn_implementation == name
