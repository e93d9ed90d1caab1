"""The target's KV cache: transformers' dynamic cache whose layers append in place. ``Target`` decodes
with it, and batched data generation (``traindata``) hands it to ``generate``."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A cache layer whose ``keys`` / ``values`` [b, heads, n, d] are views of buffers with spare rows.

    transformers' ``DynamicLayer`` appends by ``torch.cat``, which copies the whole layer on every
    forward — 60 tensors on the embedded target, a cost that grows with the context: a one-row step
    after 150 / 450 / 900 tokens took 27.6 / 28.9 / 30.9 ms with it and 27.2 / 28.2 / 29.5 ms with
    this layer (interleaved, two threads; bench/NOTES.md). Here new rows are written in place and the
    buffers grow by half their length when full (amortised O(1) copies a row); ``crop`` (the
    inherited slicing) and in-place row moves (``Target.commit``) act on the views, i.e. on the
    buffers. The attention reads the same numbers in the same order: outputs are bit-identical.
    """

    min_rows = 256  # first allocation; later ones add half the rows in use

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf = self._vbuf = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self.keys.shape[-2] if self.keys.dim() == 4 else 0, key_states.shape[-2]
        self._room(key_states, value_states, n, m)
        self._kbuf[:, :, n:n + m] = key_states
        self._vbuf[:, :, n:n + m] = value_states
        self.keys, self.values = self._kbuf[:, :, :n + m], self._vbuf[:, :, :n + m]
        return self.keys, self.values

    def _room(self, like_k: torch.Tensor, like_v: torch.Tensor, n: int, m: int) -> None:
        """Buffers shaped like ``like_k`` / ``like_v`` [b, heads, ·, d] with room for n + m rows whose
        first n are the layer's rows. A view of the buffer starts at its first row; anything else (a
        layer replaced from outside, a batch or shape change) is adopted into fresh buffers."""
        buf = self._kbuf
        if (buf is None or n + m > buf.shape[2] or buf.shape[:2] != like_k.shape[:2]
                or buf.shape[3] != like_k.shape[3] or (n and self.keys.data_ptr() != buf.data_ptr())):
            rows = max(n + m + (n + m) // 2, self.min_rows)
            kbuf = like_k.new_empty(*like_k.shape[:2], rows, like_k.shape[3])
            vbuf = like_v.new_empty(*like_v.shape[:2], rows, like_v.shape[3])
            if n:
                kbuf[:, :, :n] = self.keys
                vbuf[:, :, :n] = self.values
            self._kbuf, self._vbuf = kbuf, vbuf

    def reserve(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for m more rows after the layer's rows (an initialised layer of 4-D keys), nothing
        written: the key and value buffers [b, heads, capacity, d], for a writer that fills rows
        [rows in use, + m) itself (``kernels/cpu_decoder.py``) and then calls :meth:`advance`."""
        self._room(self.keys, self.values, self.keys.shape[-2], m)
        return self._kbuf, self._vbuf

    def advance(self, m: int) -> None:
        """Take m rows written into the buffers after the layer's rows (see :meth:`reserve`)."""
        n = self.keys.shape[-2] + m
        self.keys, self.values = self._kbuf[:, :, :n], self._vbuf[:, :, :n]

    def reset(self) -> None:
        super().reset()
        self._kbuf = self._vbuf = None


def growing_cache(config) -> DynamicCache:
    """transformers' dynamic cache for ``config`` with each plain layer a :class:`GrowingLayer`
    (sliding-window and other special layers are left as transformers made them)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
