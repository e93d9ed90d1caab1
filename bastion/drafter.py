"""The block-diffusion drafter in the DFlash layout (arXiv 2602.06036).

A few Qwen3-style layers with no embedding or LM head of their own. Inputs are the target's
embeddings of a block [root, MASK × (B−1)]; outputs go through the target's LM head. Conditioning:
the hidden states of k target layers, concatenated ([·, k·h]), projected by ``fc`` to h and
normalised by ``hidden_norm``; in every layer they supply extra keys/values placed in front of the
block's own, and the block attends to all of them without a causal mask. One forward returns the
B−1 position-wise marginals q_1..q_{B−1}.

The context keys/values of each layer depend only on the committed tokens, so they are cached
(:class:`DrafterCache`) and extended by the newly committed tokens each round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from .drafter_config import DrafterConfig
from .drafter_lean import lean_layers, lean_plan
from .kernels.cpu_linear import use_skinny_linear
from .kernels.cpu_modules import use_native_modules


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, x [b, heads, s, d], cos/sin [b, s, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DrafterAttention(nn.Module):
    """Block queries attend (non-causally) to [context keys ; block keys]."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_q, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_q * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_q * d, h, bias=False)
        self.q_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)

    def _kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def context_kv(self, ctx: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [b, n_kv, s, d] of normalised context features ctx [b, s, h]."""
        return self._kv(ctx, cos, sin)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        """x [b, q, h] block hidden states; ctx_k/ctx_v [b, n_kv, c, d]; mask [b, 1, q, c + q] or None."""
        return self.attend(x, cos, sin, ctx_k, ctx_v, mask)[0]

    def attend(self, x, cos, sin, ctx_k, ctx_v, mask=None, fresh=None):
        """Attention output [b, q, h] and the keys/values [b, n_kv, c + m, d] the context now has.

        ``fresh`` [b, m, h]: normalised features of m context tokens not yet in ctx_k/ctx_v (the
        tokens committed since the last draft). Their keys/values come out of the same k/v products
        as the block's — one product over m + q rows instead of two — and are returned appended to
        the context (views of the tensors the block attended to: no second copy of the cache).
        cos/sin [b, m + q, d] cover [fresh ; block]; ctx_k/ctx_v may be None (no context yet).
        """
        b, q, _ = x.shape
        m = 0 if fresh is None else fresh.shape[1]
        qh = self.q_norm(self.q_proj(x).view(b, q, self.n_q, self.head_dim)).transpose(1, 2)
        qh = _rotate(qh, cos[:, m:], sin[:, m:])
        k, v = self._kv(x if fresh is None else torch.cat([fresh, x], dim=1), cos, sin)
        if ctx_k is not None:
            k = torch.cat([ctx_k, k], dim=2)
            v = torch.cat([ctx_v, v], dim=2)
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=self.n_q != self.n_kv)
        keep = k.shape[2] - q
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1)), k[:, :, :keep], v[:, :, :keep]


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = Qwen3MLP(cfg.qwen3())
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def step(self, x, cos, sin, ctx_k, ctx_v, fresh=None):
        """One inference layer: block states [b, q, h] and the context keys/values extended by
        ``fresh`` (see :meth:`DrafterAttention.attend`)."""
        out, k, v = self.self_attn.attend(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, None, fresh)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


@dataclass
class DrafterCache:
    """The drafter's context: per-layer keys/values [1, n_kv, c, d] of the committed tokens before the
    root, plus ``pending`` target features [m_i, k·h] of tokens committed since (encoded by the next
    :meth:`DFlashDrafter.draft` in its own forward, see :meth:`defer`)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    pending: list[torch.Tensor] = field(default_factory=list)
    # the lean CPU loop's per-layer buffers with spare rows, of which keys / values are views
    # (drafter_lean.lean_layers); the module path leaves them alone
    kbuf: list[torch.Tensor] = field(default_factory=list)
    vbuf: list[torch.Tensor] = field(default_factory=list)

    @property
    def encoded(self) -> int:
        """Context tokens whose keys/values are in the cache."""
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def length(self) -> int:
        """Context tokens the cache stands for: encoded plus pending."""
        return self.encoded + sum(f.shape[0] for f in self.pending)

    def defer(self, features: torch.Tensor) -> None:
        """Queue newly committed tokens' target features [m, k·h] for the next draft.

        Encoding them at once (:meth:`DFlashDrafter.extend_cache`) costs a forward of its own: fc,
        a norm, rotary and k/v products over m ≈ τ rows per layer, plus a copy of the cache. Deferred,
        the next draft computes them inside its k/v products over [fresh ; block] rows — and a round
        that skips its draft (DraftGate) pays nothing.
        """
        if features is not None and features.shape[0] > 0:
            self.pending.append(features)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` context tokens (encoded first, then pending)."""
        keep, self.pending, rest = [], [], self.pending
        left = length - self.encoded
        for f in rest:
            if left <= 0:
                break
            keep.append(f[:left])
            left -= f.shape[0]
        self.pending = keep
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]


class DFlashDrafter(nn.Module):
    """Parameters named as in published DFlash checkpoints: layers.{i}.…, norm, fc, hidden_norm."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(cfg.qwen3())
        # Optional draft vocabulary: target ids [V_d] the drafter may propose. Its logits are then
        # computed over V_d rows of the LM head only — on a CPU the full head over V = 49,152 is most
        # of a draft's time. Tokens outside it are never drafted, which costs acceptance, never
        # correctness (verification always uses the target's full distribution).
        self.register_buffer("draft_vocab", None if not cfg.draft_vocab_size else
                             torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        # a draft is a 9–16-row product per matrix (kernels.cpu_linear), and only a proposal: bf16
        # weights (half the bytes; bf16 products too where the CPU has AVX512-BF16)
        use_skinny_linear(self, "native-bf16")
        # ... unless float32 drafts are faster on this host: an engine's probe times both and keeps the
        # faster (probe.tune_drafter_products; its medians in products_probe). A caller that sets a
        # mode itself (bench --drafter-linear MODE) turns this off.
        self.tune_products = True
        self.products_probe: dict[str, float] | None = None
        use_native_modules(self)  # norms and activations: one native pass each where they apply
        self._parts: tuple | None = None  # (rows, its parts) of the last draft (_vocab_parts)
        # CPU drafts: the lean loop's layers as one native call where that computes the same
        # (drafter_lean, kernels/cpu_decoder.py); set False to keep the loop in Python
        self.fused = True

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Restrict drafting to these target token ids (1-D, unique, in [0, V)); None = full vocabulary."""
        self._parts = None
        if ids is None:
            self.draft_vocab, self.cfg.draft_vocab_size = None, None
            return
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        check_draft_vocab(ids, self.cfg.vocab_size)
        self.draft_vocab = ids.to(self.fc.weight.device)
        self.cfg.draft_vocab_size = int(ids.numel())

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def low_precision(self) -> bool:
        """Whether inference products run in bf16 (mode ``native-bf16`` of :func:`use_skinny_linear`);
        the LM head's draft-vocabulary slice then does too."""
        return bool(getattr(self.fc, "native", False) and getattr(self.fc, "low_precision", False))

    def _cos_sin(self, x: torch.Tensor, pos: torch.Tensor):
        cos, sin = self.rotary(x, pos)
        return cos.to(x.dtype), sin.to(x.dtype)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k, v) of target features [b, c, k·h] at positions [b, c]."""
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self._cos_sin(ctx, positions)
        return [layer.self_attn.context_kv(ctx, cos, sin) for layer in self.layers]

    def blocks(self, block_embeds: torch.Tensor, positions: torch.Tensor,
               ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [b, q, h] (after the final norm) of block embeddings [b, q, h].

        ``mask`` [b, 1, q, c + q] lets training pack several blocks of one sequence into a batch row;
        inference passes None (one block, everything visible).
        """
        x = block_embeds
        cos, sin = self._cos_sin(x, positions)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    # ----------------------------------------------------------------- inference
    def new_cache(self) -> DrafterCache:
        return DrafterCache([], [])

    @torch.inference_mode()
    def extend_cache(self, cache: DrafterCache, features: torch.Tensor) -> None:
        """Append newly committed tokens' target features [m, k·h] to the context cache."""
        if features is None or features.shape[0] == 0:
            return
        if cache.pending:  # keep the order: queued tokens come first
            queued, cache.pending = cache.pending, []
            features = torch.cat([*queued, features])
        start = cache.encoded
        pos = torch.arange(start, start + features.shape[0], device=features.device)[None]
        kv = self.context_kv(features[None].to(self.fc.weight.dtype), pos)
        if not cache.keys:
            cache.keys = [k for k, _ in kv]
            cache.values = [v for _, v in kv]
        else:
            cache.keys = [torch.cat([a, k], dim=2) for a, (k, _) in zip(cache.keys, kv)]
            cache.values = [torch.cat([a, v], dim=2) for a, (_, v) in zip(cache.values, kv)]

    @torch.inference_mode()
    def draft(self, cache: DrafterCache, root_token: int, embed, lm_head,
              vocab: torch.Tensor | None = None, depth: int | None = None, refine: int = 0) -> torch.Tensor:
        """Log-probabilities [D, V] of depths 1..D for the block [root, MASK × D] (D = ``depth``,
        default B − 1: the whole block the drafter was trained on; a shorter block drafts fewer depths
        for less work — the block attention is non-causal, so its marginals differ a little).

        The root sits at position cache.length (its context is everything before it); features queued
        with :meth:`DrafterCache.defer` are encoded in this same forward. With a draft
        vocabulary — ``vocab`` if given (the engine widens the drafter's own with a request's tokens),
        else ``draft_vocab`` — the columns are its V_d tokens (``vocab[j]`` is column j's target id)
        and ``lm_head(hidden, rows)`` must return logits of those rows only (called as
        ``lm_head(hidden, rows, low_precision=True)`` when :attr:`low_precision` is on).

        ``refine`` r ≥ 1 (r < D): r more passes; pass i + 1 runs [root, t_1..t_i, MASK × (D − i)],
        t_j the argmax at depth j so far, and replaces depths i+1..D with its own. The first pass's
        marginal at depth d > 1 averages over every token the depths before it might hold; a refined
        one is conditioned on the likeliest — what a chain needs whenever t_1..t_i are right (a drafter
        trained with revealed prefixes, ``train fit --reveal``, reads them). Each pass costs a forward
        over the block; the context is encoded once, in the first.
        """
        if depth is not None and not 1 <= depth < self.block_size:
            raise ValueError(f"draft depth must be in [1, {self.block_size - 1}], got {depth}")
        block = self.block_size if depth is None else depth + 1
        if not 0 <= refine < block - 1:
            raise ValueError(f"refine must be in [0, {block - 2}] for a {block - 1}-depth draft, got {refine}")
        rows = vocab if vocab is not None else self.draft_vocab
        logq = self._pass(cache, [root_token], block, embed, lm_head, rows)
        for i in range(1, refine + 1):
            top = logq[:i].argmax(-1)
            head = [root_token, *(top if rows is None else rows[top]).tolist()]
            logq = torch.cat([logq[:i], self._pass(cache, head, block, embed, lm_head, rows)[i:]])
        return logq

    def _pass(self, cache: DrafterCache, head: list[int], block: int, embed, lm_head,
              rows: torch.Tensor | None) -> torch.Tensor:
        """One forward of the block [*head, MASK × (block − len(head))]: log q [block − 1, V or V_d]."""
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        ids = torch.full((1, block), self.cfg.mask_token_id, dtype=torch.long, device=device)
        ids[0, :len(head)] = torch.tensor(head, dtype=torch.long, device=device)
        emb = embed(ids)
        x = emb.to(dtype)
        fresh = None
        if cache.pending:  # tokens committed since the last draft: encoded in this forward
            feats = cache.pending[0] if len(cache.pending) == 1 else torch.cat(cache.pending)
            cache.pending = []
            fresh = self.hidden_norm(self.fc(feats[None].to(device=device, dtype=dtype)))
        m = 0 if fresh is None else fresh.shape[1]
        start = cache.encoded
        # positions of [fresh ; block]: contiguous, the root right after the last context token
        cos, sin = self._cos_sin(x, torch.arange(start, start + m + block, device=device)[None])
        plan = lean_plan(self)
        if plan is not None:  # CPU float32 with native products: the same layers without the modules
            hidden = lean_layers(self, plan, cache, x[0], None if fresh is None else fresh[0],
                                 cos[0].contiguous(), sin[0].contiguous())[1:].to(emb.dtype)
        else:
            keys, values = [], []
            for i, layer in enumerate(self.layers):
                past = (cache.keys[i], cache.values[i]) if cache.keys else (None, None)
                x, k, v = layer.step(x, cos, sin, *past, fresh)
                keys.append(k)
                values.append(v)
            cache.keys, cache.values = keys, values
            hidden = self.norm(x)[0, 1:].to(emb.dtype)
        if rows is None:
            logits = lm_head(hidden)
        else:
            kw = {"low_precision": True} if self.low_precision else {}
            parts = self._vocab_parts(rows)
            logits = (lm_head(hidden, parts[0], **kw) if len(parts) == 1
                      else torch.cat([lm_head(hidden, p, **kw) for p in parts], dim=-1))
        return torch.log_softmax(logits.float(), dim=-1)

    def _vocab_parts(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """rows as [draft_vocab, the rest] when it extends the draft vocabulary (the engine widens it
        per request with the prompt's and the reply's tokens), else [rows].

        The LM head caches a slice per rows tensor: the draft vocabulary's (V_d·h weights, ~6 ms to
        gather and pack on a 2-core CPU) is then built once, not per request and per widening, and
        only the few extra rows are packed anew. Each column's logit is the same dot product either way.
        """
        base = self.draft_vocab
        if base is None or rows is base or rows.shape[0] <= base.shape[0]:
            return [rows]
        if self._parts is not None and self._parts[0] is rows:
            return self._parts[1]
        n = base.shape[0]
        parts = [base, rows[n:].clone()] if torch.equal(rows[:n], base) else [rows]
        self._parts = (rows, parts)  # holds rows, so its identity stays its own
        return parts


def check_draft_vocab(ids: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError unless ids is a 1-D tensor of unique token ids in [0, vocab_size)."""
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
        raise ValueError(f"draft vocabulary must be a non-empty 1-D integer tensor, got shape {tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft vocabulary has ids outside [0, {vocab_size})")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError("draft vocabulary has repeated ids")
