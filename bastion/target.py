"""The target model: a thin wrapper around any transformers causal LM (Llama, Qwen3, ...).

This is the only module that touches KV-cache internals. State between calls: the KV cache of
the committed tokens *except the root* (the root is verified as node 0 of the next tree).
Hidden states of the drafter's chosen layers are captured with forward hooks, so only those
layers are kept, never the whole stack.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from . import target_lean
from .kernels import cpu_native, cpu_rows
from .kernels.cpu_attention import MAX_QUERIES, use_grouped_attention
from .kernels.cpu_decoder import NativeDecoder
from .kernels.cpu_linear import pack_for, prepack, skinny_linear, use_skinny_linear
from .kernels.cpu_modules import use_native_modules
from .kvcache import GrowingLayer, growing_cache

HEAD_SLICES = 4  # lm_head(rows=...) slices kept: a drafter's vocabulary, a request's extra rows, and spares


@dataclass
class TargetOutput:
    """logits: [n, V] float (None for a prefill); features: [n, k·h] captured hidden states of the
    k feature layers concatenated (None when no feature layer is selected)."""

    logits: torch.Tensor | None
    features: torch.Tensor | None


class Target:
    """Prefill, tree forward with a 4-D additive mask, and cache compaction on an HF causal LM."""

    def __init__(self, model: PreTrainedModel, tokenizer=None, linear: str | bool = "native"):
        """`linear`: how the model's linear layers multiply few rows on a CPU (``kernels.cpu_linear``):
        ``native`` (the packed kernel, built on first use; the panels are made here, at load; weights
        that are exactly Q4_1 / Q8_0 — the embedded model's — in 4 / 8 bits, the same product bits),
        ``native-f32`` (the packed kernel on float32 panels only), ``fast`` (torch's few-row routines)
        or ``stock`` (``F.linear``); no effect on GPUs or in training.
        SDPA attention of a few masked queries regroups grouped-query heads instead of copying the
        KV cache, and with ``native`` runs in the native kernel (``kernels.cpu_attention``; CPU only,
        the same attention). ``native-bf16`` is refused: it is for drafters, whose outputs are only
        proposals; the target's logits are what the output is made of."""
        if linear == "native-bf16":
            raise ValueError("linear mode 'native-bf16' rounds products to bf16: it is for drafters, not the target")
        self.model = model.eval()
        use_skinny_linear(self.model, linear)
        prepack(self.model)
        # with the native linear kernel, few-query float32 attention runs natively too (the same
        # attention, each row on its own); the packed panels may have been refused for memory
        native = any(getattr(m, "native", False) for m in self.model.modules())
        use_grouped_attention(self.model, native=native)
        use_native_modules(self.model, native)
        self.tokenizer = tokenizer
        self.config = model.config
        self.cache: DynamicCache | None = None
        self._feature_layers: list[int] = []
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list = []
        # lm_head(rows=...)'s slices, newest last: key -> (rows, weight rows, bias rows, panels); a few
        # are kept, so a drafter's fixed vocabulary and a request's extra rows are packed once each
        self._head_slices: dict[tuple, tuple] = {}
        # forward_tree's own decoder loop (target_lean.lean_forward): None until first checked, then whether
        # this model qualifies; set False to always go through transformers' forward
        self.lean: bool | None = None
        self.wide_rows: int | None = None  # the product path per row count its probe chose (probe.tune_wide_rows)
        self.wide_rows_q8: int | None = None  # ... and for its 8-bit products (probe._tune_q8_rows)
        self.wide_rows_timed = 0  # ... for the row counts 1..wide_rows_timed (the others: 512 bits; 16 and
        # wide_rows None: this target has nothing to choose)
        self._plan: tuple | None = None  # the lean loop's products and what they were made from (target_lean.lean_plan)
        # the lean loop's layers as one native call where that computes the same (kernels/cpu_decoder.py);
        # set False to keep the loop in Python
        self.fused = True
        self._fused: NativeDecoder | None = None

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        local_files_only: bool = False, linear: str | bool = "native") -> "Target":
        tok = AutoTokenizer.from_pretrained(path, local_files_only=local_files_only)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=local_files_only)
        return cls(model.to(device), tok, linear)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor, rows: torch.Tensor | None = None,
                low_precision: bool = False) -> torch.Tensor:
        """Logits [..., V] of hidden [..., h]; with ``rows`` [V_d] only those vocabulary rows [..., V_d].

        The row slice of the head is cached per rows tensor (the last ``HEAD_SLICES`` of them, each
        holding its rows tensor, so a freed tensor's id is never mistaken for it), so a drafter with a
        draft vocabulary reads V_d·h weights per call instead of V·h. ``low_precision`` (a drafter's,
        with ``rows``): the slice is multiplied in bf16 where the native kernel can (``kernels.cpu_linear``).
        """
        head = self.model.get_output_embeddings()
        if rows is None:
            return head(hidden)
        # inference-mode tensors cannot be saved for backward: keep one slice per mode
        key = (id(rows), head.weight.data_ptr(), torch.is_inference_mode_enabled(), low_precision,
               getattr(head, "compress", True))
        hit = self._head_slices.pop(key, None)
        if hit is None or hit[0] is not rows:
            with torch.no_grad():
                w = head.weight.index_select(0, rows.to(head.weight.device))
                b = None if head.bias is None else head.bias.index_select(0, rows.to(head.weight.device))
            # the head's linear mode decides whether the slice gets native panels too
            native = getattr(head, "native", False) and w.device.type == "cpu" and w.dtype == torch.float32 \
                and cpu_native.available()
            hit = (rows, w, b, pack_for(w, low_precision, getattr(head, "compress", True)) if native else None)
        self._head_slices[key] = hit  # newest last
        while len(self._head_slices) > HEAD_SLICES:
            self._head_slices.pop(next(iter(self._head_slices)))
        _, w, b, panels = hit
        return skinny_linear(hidden, w, b, panels)

    # ----------------------------------------------------------------- feature capture
    def _decoder_layers(self):
        return self.model.get_decoder().layers

    @property
    def feature_layers(self) -> list[int]:
        """The decoder layers (0-based) whose outputs every forward captures."""
        return list(self._feature_layers)

    def set_feature_layers(self, layer_ids: list[int]) -> None:
        """Capture the outputs of these decoder layers (0-based) in every forward."""
        self._check_layer_ids(layer_ids)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._feature_layers = list(layer_ids)
        layers = self._decoder_layers()
        for i in self._feature_layers:
            self._hooks.append(layers[i].register_forward_hook(self._make_hook(i)))

    def _check_layer_ids(self, layer_ids: list[int]) -> None:
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"feature layer ids {bad} out of range for a {self.num_layers}-layer target")

    def _make_hook(self, idx: int):
        def hook(_module, _inputs, output):
            self._captured[idx] = output[0] if isinstance(output, tuple) else output
        return hook

    @contextlib.contextmanager
    def feature_stream(self, layer_ids: list[int]):
        """While open, every forward's outputs of decoder layers ``layer_ids`` are kept; yields a function
        returning them joined: [b, L, k·h], L the positions of all forwards in call order.

        For batched generation of training data: ``generate``'s prefill [b, W] and its one-token steps
        [b, 1] together hold the features of every position it read, so no second forward over the
        finished sequences is needed (on the embedded target it had cost ~40% of a shard's time)."""
        self._check_layer_ids(layer_ids)
        chunks: dict[int, list[torch.Tensor]] = {i: [] for i in layer_ids}

        def keep(i):
            def hook(_module, _inputs, output):
                chunks[i].append(output[0] if isinstance(output, tuple) else output)
            return hook

        layers = self._decoder_layers()
        hooks = [layers[i].register_forward_hook(keep(i)) for i in dict.fromkeys(layer_ids)]
        try:
            yield lambda: torch.cat([torch.cat(chunks[i], dim=1) for i in layer_ids], dim=-1)
        finally:
            for h in hooks:
                h.remove()
            self._captured.clear()  # what set_feature_layers' own hooks kept of the last forward

    def _collect_features(self) -> torch.Tensor | None:
        if not self._feature_layers:
            return None
        feats = torch.cat([self._captured[i] for i in self._feature_layers], dim=-1)
        self._captured.clear()
        return feats[0]

    # ----------------------------------------------------------------- forwards
    @property
    def cache_len(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    def reset(self) -> None:
        self.cache = growing_cache(self.config)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> TargetOutput:
        """Run ids [m] (the committed tokens before the root) into a fresh cache; no logits."""
        self.reset()
        if ids.numel() == 0:
            return TargetOutput(None, None)
        pos = torch.arange(ids.numel(), device=self.device)[None]
        # Only the cache and the captured features matter here: call the decoder, skip the LM head.
        self.model.get_decoder()(input_ids=ids[None].to(self.device), position_ids=pos,
                                 past_key_values=self.cache, use_cache=True)
        return TargetOutput(None, self._collect_features())

    @torch.inference_mode()
    def forward_tree(self, tokens: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor) -> TargetOutput:
        """One forward over n tree nodes appended after the cache.

        Args:
            tokens: [n] node tokens in pop order (node 0 = root).
            mask: [1, 1, n, cache_len + n] additive float mask in the model's dtype.
            position_ids: [1, n] = cache_len + depth.
        Returns logits [n, V] and features [n, k·h]; the cache grows by n rows until commit().
        """
        if self.lean is None:
            self.lean = target_lean.lean_qualifies(self)
        if self.lean and self.cache is not None and 1 <= tokens.numel() <= MAX_QUERIES \
                and mask.dtype == torch.float32 and mask.shape[-1] == self.cache_len + tokens.numel():
            return TargetOutput(target_lean.lean_forward(self, tokens, mask, position_ids), self._collect_features())
        out = self.model(input_ids=tokens[None].to(self.device), attention_mask=mask,
                         position_ids=position_ids, past_key_values=self.cache, use_cache=True)
        return TargetOutput(out.logits[0], self._collect_features())

    @torch.inference_mode()
    def batch_features(self, ids: torch.Tensor, attention_mask: torch.Tensor,
                       greedy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Feature-layer hidden states [b, L, k·h] of padded sequences ids [b, L] (no cache; training data).
        ``greedy``: also the target's greedy next token after every position, int64 [b, L] (the LM
        head runs one sequence at a time: [L, V] logits, not [b, L, V])."""
        with torch.inference_mode():
            out = self.model.get_decoder()(input_ids=ids, attention_mask=attention_mask, use_cache=False)
            feats = torch.cat([self._captured[i] for i in self._feature_layers], dim=-1)
            if greedy:
                last = out.last_hidden_state
                nxt = torch.stack([self.model.get_output_embeddings()(last[i]).argmax(-1) for i in range(len(last))])
        self._captured.clear()
        return (feats, nxt) if greedy else feats

    def plain_copy(self, dtype: torch.dtype) -> PreTrainedModel:
        """A plain transformers copy of the model in ``dtype`` (SDPA attention, torch's own products;
        none of this class's kernels or hooks): e.g. a bf16 model for batched generation of training
        data, where bf16's products run several times faster than float32's on CPUs with AMX."""
        cfg = copy.deepcopy(self.model.config)
        cfg._attn_implementation = "sdpa"
        model = type(self.model)(cfg).to(dtype=dtype, device=self.device)
        model.load_state_dict(self.model.state_dict())
        return model.eval()

    @torch.no_grad()
    def layers_from(self, hidden: torch.Tensor, layer_id: int, valid: torch.Tensor,
                    outputs: list[int]) -> list[torch.Tensor]:
        """The outputs [b, L, h] of decoder layers ``outputs`` (ids after ``layer_id``, ascending) for
        padded sequences whose layer ``layer_id``'s outputs are ``hidden`` [b, L, h] (``valid`` [b, L]
        marks real tokens): only the layers after it run, causally — what a feature stored once for
        ``layer_id`` costs to carry further (``fit --kd``, ``--add-feature-layers``: ``fitting.py``)."""
        if sorted(set(outputs)) != list(outputs) or not outputs or not layer_id < outputs[0] or outputs[-1] >= self.num_layers:
            raise ValueError(f"layer ids {outputs} must ascend, follow layer {layer_id} and lie below {self.num_layers}")
        dec = self.model.get_decoder()
        b, L, _ = hidden.shape
        dev = hidden.device
        h = hidden.to(self.dtype)
        pos = torch.arange(L, device=dev)[None].expand(b, -1)
        cos_sin = dec.rotary_emb(h, pos)
        ok = torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None] & valid.to(dev)[:, None, :]
        mask = torch.zeros(b, 1, L, L, dtype=h.dtype, device=dev).masked_fill(~ok[:, None], torch.finfo(h.dtype).min)
        got = []
        for i in range(layer_id + 1, outputs[-1] + 1):
            out = self._decoder_layers()[i](h, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            h = out[0] if isinstance(out, tuple) else out
            if i in outputs:
                got.append(h)
        return got

    @torch.no_grad()
    def finish_from(self, hidden: torch.Tensor, layer_id: int, valid: torch.Tensor) -> torch.Tensor:
        """The final normed hidden states [b, L, h] of padded sequences whose decoder layer
        ``layer_id``'s outputs are ``hidden`` [b, L, h] (``valid`` [b, L] marks real tokens): the
        layers after it run causally (:meth:`layers_from`), so the logits of a training sequence cost
        only its last few layers when that layer's outputs are stored as features (``fit --kd``, ``fitting.py``)."""
        last = self.num_layers - 1
        h = hidden.to(self.dtype) if layer_id == last else self.layers_from(hidden, layer_id, valid, [last])[0]
        return self.model.get_decoder().norm(h)

    @torch.inference_mode()
    def commit(self, prefix_len: int, accepted: list[int]) -> None:
        """Keep cache rows [0, prefix_len) plus the tree rows of the accepted nodes, drop the rest.

        ``accepted`` are node indices (root first, increasing). When they are 0..k-1 the kept rows
        are already contiguous and a crop suffices; otherwise gather then crop.
        """
        total = self.cache_len
        keep = prefix_len + len(accepted)
        if accepted != list(range(len(accepted))):
            layers = self.cache.layers
            src = [prefix_len + a for a in accepted]
            # on the CPU one native call moves the rows of every layer (two torch ops per tensor cost
            # ~0.4 ms a round on the embedded target); elsewhere, or for other layouts, torch
            # (a growing layer's buffers: the same rows and strides, without slicing 60 views)
            tensors = [t for layer in layers for t in (layer.buffers() if type(layer) is GrowingLayer
                                                       and layer.in_buffers() else (layer.keys, layer.values))]
            if not (self.device.type == "cpu" and cpu_rows.move_rows(tensors, src, list(range(prefix_len, keep)))):
                idx = torch.tensor(src, device=self.device)
                for layer in layers:
                    layer.keys[:, :, prefix_len:keep] = layer.keys.index_select(2, idx)
                    layer.values[:, :, prefix_len:keep] = layer.values.index_select(2, idx)
        if total > keep:
            self.cache.crop(keep - total)  # transformers 5: a negative count of rows to drop


def load_tokenizer(path: str | Path, local_files_only: bool = False):
    return AutoTokenizer.from_pretrained(path, local_files_only=local_files_only)
