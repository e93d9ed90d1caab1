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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "bastion_grouped_sdpa"
MAX_QUERIES = 64  # decoding regime; prefill (causal, no mask) never reaches the regrouping anyway

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
    extra = any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "cache", "sinks", "s_aux"))
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


def use_grouped_attention(model) -> bool:
    """Route `model`'s SDPA attention through :func:`grouped_sdpa_forward` (registered with
    transformers under ``NAME``, with SDPA's mask builder); True when switched. Models on another
    attention implementation (eager, flash) are left alone."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, grouped_sdpa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
