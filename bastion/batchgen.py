"""Batched greedy generation for training data: the decoder's own modules in a lean loop.

``traindata._shard`` needs, for a batch of B left-padded prompts, each prompt's greedy reply and the
feature-layer states of every token read. transformers' ``generate`` pays, per one-token step, its
attention interface and mask bookkeeping, a separate product per projection and ~40 small ops of
rotary embedding and cache handling a layer: on a 2-core AVX-512 Xeon, 105 ms a step at B = 32 for the
embedded target (3.3 ms a reply token, ~60% above its products' time at that batch). This loop runs
the same layers on the same weights with

- each layer's q/k/v projections as one product over their stacked weights, gate and up as another
  (fewer, wider products; MKL runs them near its peak at 64–128 rows, where a 32-row product runs at
  ~60% of it);
- keys and values written into one preallocated [B, kv, W + N, d] buffer per layer (no cache object);
- attention as two batched products over the grouped query heads (on this host half of SDPA's time
  for one-token queries against a few hundred keys; both compute the same softmax);
- finished rows dropped from the batch once enough of them have read their end token, so the batch
  shrinks as replies end instead of running every row to the longest reply.

At 128 prompts a batch it wrote 128 replies of up to 160 tokens in 58.6 s against ``generate``'s
82.5–84.9 s at batch 32 on that Xeon (1.43×; 1.95 ms a reply token a step, of which the products at
~188 GFLOP/s are three quarters; session 56, ``bench/NOTES.md``).

It computes what ``generate`` computes up to float rounding: products of other widths may round the
last bit differently, so a near-tie between two logits can resolve the other way in a rare reply (the
records keep what this loop wrote; tests compare both on tiny targets, where they agree exactly).
Families: Llama and Qwen3 decoders (SiLU MLP, full attention), any device and dtype (:func:`qualifies`);
``traindata`` runs it on CPUs, where it was measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .target_lean import decoder_qualifies, rms_norm

SHRINK_AT = 0.9  # drop finished rows once at most this share of the batch is still writing
PREFILL_ROWS = 32  # prompts read together


@dataclass
class BatchReplies:
    """What :func:`greedy_batch` wrote for B prompts left-padded to width W.

    tokens: [B, N] int64, N = ``max_new_tokens``: each row's tokens; after its first stop token a row
    holds whatever the loop wrote until it dropped the row, then 0 (callers cut at the stop token).
    feats: [B, W + N, k·h] float16 or None: the feature layers' outputs at every position, prompt
    padding included (its rows are meaningless), concatenated in ``layer_ids`` order; position W + j
    holds new token j's, read in the step after it was written."""

    tokens: torch.Tensor
    feats: torch.Tensor | None


@dataclass
class _Layer:
    """One decoder layer's weights, stacked for the loop (made once per call; views where possible)."""

    layer: torch.nn.Module
    wqkv: torch.Tensor  # [(nq + 2·nkv)·d, h]
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    wgu: torch.Tensor  # [2·m, h]: gate rows then up rows
    wd: torch.Tensor


def qualifies(model) -> bool:
    """Whether :func:`greedy_batch` runs ``model`` (a transformers causal LM): a decoder the lean loops
    reproduce (``target_lean.decoder_qualifies``: Llama or Qwen3, full attention, SiLU MLP) whose MLP has
    no biases and whose q/k/v projections all have or all lack one (they are stacked)."""
    if not decoder_qualifies(model):
        return False
    for layer in model.get_decoder().layers:
        a, m = layer.self_attn, layer.mlp
        if len({p.bias is None for p in (a.q_proj, a.k_proj, a.v_proj)}) != 1 or any(
                p.bias is not None for p in (m.gate_proj, m.up_proj, m.down_proj)):
            return False
    return True


def _stack(layer) -> _Layer:
    a, m = layer.self_attn, layer.mlp
    qkv = (a.q_proj, a.k_proj, a.v_proj)
    return _Layer(layer, torch.cat([p.weight for p in qkv]),
                  None if a.q_proj.bias is None else torch.cat([p.bias for p in qkv]),
                  a.o_proj.weight, a.o_proj.bias, torch.cat((m.gate_proj.weight, m.up_proj.weight)),
                  m.down_proj.weight)


def _step(p: _Layer, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, at: int,
          cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, dims: tuple[int, int, int, float]) -> torch.Tensor:
    """One decoder layer on x [B, L, h] whose tokens sit at cache positions [at, at + L): appends their
    keys (rotated at cos/sin [B, L, d]) and values to ``keys``/``values`` [B, nkv, ≥ at + L, d] and
    attends over positions < at + L under the additive ``mask`` [B, 1, L, at + L]."""
    nq, nkv, d, scale = dims
    B, L, _ = x.shape
    attn = p.layer.self_attn
    h = rms_norm(p.layer.input_layernorm, x)
    q, k, v = F.linear(h, p.wqkv, p.bqkv).split((nq * d, nkv * d, nkv * d), dim=-1)
    q, k = q.view(B, L, nq, d), k.view(B, L, nkv, d)
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotary embedding
        q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
    q, keys[:, :, at:at + L] = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    values[:, :, at:at + L] = v.view(B, L, nkv, d).transpose(1, 2)
    K, V = keys[:, :, :at + L], values[:, :, :at + L]
    g = nq // nkv  # query heads sharing one key-value head: one product per key-value head
    s = q.reshape(B, nkv, g * L, d) @ K.transpose(-1, -2)  # [B, nkv, g·L, T]
    s = (s.view(B, nkv, g, L, -1) * scale + mask[:, :, None]).softmax(-1)
    a = (s.view(B, nkv, g * L, -1) @ V).view(B, nq, L, d).transpose(1, 2).reshape(B, L, nq * d)
    x = x + F.linear(a, p.wo, p.bo)
    gate, up = F.linear(rms_norm(p.layer.post_attention_layernorm, x), p.wgu).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, p.wd)


def _dims(model) -> tuple[int, int, int, float]:
    """(query heads, key-value heads, head size, attention scale) of ``model``'s layers."""
    cfg, attn = model.config, model.get_decoder().layers[0].self_attn
    nq = cfg.num_attention_heads
    return nq, getattr(cfg, "num_key_value_heads", None) or nq, attn.head_dim, float(attn.scaling)


def _prompt_mask(valid: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' additive causal mask [B, 1, W, W] (padding keys masked) and positions [B, W]
    (``generate``'s: real tokens counted from 0, padding at 0)."""
    W = valid.shape[1]
    causal = torch.ones(W, W, dtype=torch.bool, device=valid.device).tril()
    mask = torch.zeros(len(valid), 1, W, W, dtype=dtype, device=valid.device).masked_fill(
        ~(causal & valid[:, None, :])[:, None], torch.finfo(dtype).min)
    return mask, (valid.long().cumsum(-1) - 1).clamp(min=0)


@torch.inference_mode()
def greedy_batch(model, ids: torch.Tensor, valid: torch.Tensor, max_new_tokens: int, layer_ids: list[int],
                 stop_ids: set[int] | frozenset[int] = frozenset(), features: bool = True,
                 choose: Callable[[torch.Tensor], torch.Tensor] | None = None) -> BatchReplies:
    """Each row's greedy continuation of ids [B, W] (left-padded; ``valid`` [B, W] marks real tokens),
    at most ``max_new_tokens`` tokens, with the outputs of decoder layers ``layer_ids`` at every
    position read (``features``). A row is finished once it has read a token of ``stop_ids``; the loop
    ends when every row is finished or wrote ``max_new_tokens`` tokens and read them all.
    ``choose``: the next-token rule, logits [b, V] → ids [b] (default: greedy, ``argmax``; the request
    list passes a nucleus sampler, ``traindata.make_requests``).

    Per new token j (0-based) the row's position is its prompt length + j, as ``generate`` numbers
    left-padded rows; the padding's keys are masked (additive ``finfo.min``, so a row of padding
    alone softmaxes to a uniform mix instead of NaN)."""
    if not qualifies(model):
        raise ValueError(f"{type(model).__name__}: not a Llama or Qwen3 decoder with full attention and a SiLU MLP")
    dec, cfg = model.get_decoder(), model.config
    layers = [_stack(layer) for layer in dec.layers]
    dims = nq, nkv, d, _ = _dims(model)
    dev, dtype = dec.embed_tokens.weight.device, dec.embed_tokens.weight.dtype
    B, W = ids.shape
    T = W + max_new_tokens  # cache positions: the prompt width, then one per token read
    valid = valid.to(dev, torch.bool)
    lens, neg = valid.sum(-1), torch.finfo(dtype).min
    keys = [torch.empty(B, nkv, T, d, device=dev, dtype=dtype) for _ in layers]
    values = [torch.empty_like(k) for k in keys]
    key_ok = torch.ones(B, T, dtype=torch.bool, device=dev)
    key_ok[:, :W] = valid
    feats = torch.zeros(B, T, len(layer_ids) * cfg.hidden_size, dtype=torch.float16) if features else None
    tokens = torch.zeros(B, max_new_tokens, dtype=torch.long)
    slot, h = {i: j for j, i in enumerate(layer_ids)}, cfg.hidden_size
    rows = torch.arange(B, device=dev)  # which original row each batch row is
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)  # wrote a stop token (read it in the next step)

    def forward(x, at, pos, mask, part=slice(None)):  # the rows `part` of the batch read x [b, L, h]
        cos, sin = dec.rotary_emb(x, pos)  # [b, L, d]
        for i, p in enumerate(layers):
            x = _step(p, x, keys[i][part], values[i][part], at, cos, sin, mask, dims)
            if features and i in slot:
                feats[rows[part].cpu(), at:at + x.shape[1], slot[i] * h:(slot[i] + 1) * h] = x.to(torch.float16).cpu()
        return model.get_output_embeddings()(rms_norm(dec.norm, x[:, -1]))

    mask, pos = _prompt_mask(valid, dtype)
    choose = choose or (lambda logits: logits.argmax(-1))
    # the prompts a few rows at a time: the same products, but a wide batch's [B·W, m] intermediates
    # overflow the caches (128 prompts of ~50 tokens: 96 ms a prompt at once against 58 in rows of 32)
    parts = [slice(r, r + PREFILL_ROWS) for r in range(0, B, PREFILL_ROWS)]
    nxt = choose(torch.cat([forward(dec.embed_tokens(ids[c].to(dev)), 0, pos[c], mask[c], c) for c in parts]))
    for j in range(max_new_tokens):
        tokens[rows.cpu(), j] = nxt.cpu()
        live = ~done
        if not bool(live.any()) or (j == max_new_tokens - 1 and not features):
            break
        if int(live.sum()) <= SHRINK_AT * len(rows):  # drop the rows that read their stop token
            keep = live.nonzero()[:, 0]
            rows, nxt, done, lens, key_ok = rows[keep], nxt[keep], done[keep], lens[keep], key_ok[keep]
            keys = [k.index_select(0, keep) for k in keys]
            values = [v.index_select(0, keep) for v in values]
        done = done | torch.isin(nxt, stops)
        at = W + j
        mask = torch.zeros(len(rows), 1, 1, at + 1, dtype=dtype, device=dev).masked_fill(
            ~key_ok[:, None, None, :at + 1], neg)
        nxt = choose(forward(dec.embed_tokens(nxt[:, None]), at, (lens + j)[:, None], mask))
    return BatchReplies(tokens, feats)
