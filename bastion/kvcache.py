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
    buffers grow by half their length when full (amortised O(1) copies a row); ``crop`` and in-place
    row moves (``Target.commit``) act on the buffers. The attention reads the same numbers in the same
    order: outputs are bit-identical.

    The views are made on demand: a writer that fills the buffers itself (:meth:`reserve` /
    :meth:`advance`, the native decoder) and ``crop`` only move the row count, and ``keys`` /
    ``values`` are sliced when something reads them (transformers' forward, the tests). Slicing 60
    views after every forward and again at every commit cost ~0.3 ms a round on the 2-core CPU.
    """

    min_rows = 256  # first allocation; later ones add half the rows in use

    def __init__(self, **kwargs):
        self._pending: int | None = None  # rows in use while the views are stale (None: they are current)
        self._kbuf = self._vbuf = None
        super().__init__(**kwargs)

    def _view(attr: str) -> property:
        """``keys`` / ``values``: made from the buffers when stale, else whatever was last assigned. An
        assignment first brings the other view up to date, so it is never rebuilt from a stale count."""
        def get(self) -> torch.Tensor | None:
            if self._pending is not None:
                self._views()
            return getattr(self, attr)

        def put(self, value: torch.Tensor | None) -> None:
            if self._pending is not None:
                self._views()
            setattr(self, attr, value)
        return property(get, put)

    keys = _view("_keys")
    values = _view("_values")
    del _view

    def _views(self) -> None:
        n, self._pending = self._pending, None
        self._keys, self._values = self._kbuf[:, :, :n], self._vbuf[:, :, :n]

    def rows(self) -> int:
        """Rows in use, without making views."""
        if self._pending is not None:
            return self._pending
        return self._keys.shape[-2] if self.is_initialized and self._keys is not None and self._keys.dim() == 4 else 0

    def in_buffers(self) -> bool:
        """Whether the layer's rows are the first rows of its own buffers (views of them, or stale)."""
        if self._pending is not None:
            return True
        k, v, kb = self._keys, self._values, self._kbuf
        return (kb is not None and k is not None and v is not None and k.dim() == 4
                and k.data_ptr() == kb.data_ptr() and v.data_ptr() == self._vbuf.data_ptr()
                and k.stride() == kb.stride() and k.shape[:2] == kb.shape[:2])

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers [b, heads, capacity, d] (valid when :meth:`in_buffers`)."""
        return self._kbuf, self._vbuf

    def get_seq_length(self) -> int:
        return self.rows()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._pending, self._kbuf, self._vbuf = None, None, None
        super().lazy_initialization(key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self.rows(), key_states.shape[-2]
        self._room(key_states, value_states, n, m)
        self._kbuf[:, :, n:n + m] = key_states
        self._vbuf[:, :, n:n + m] = value_states
        self._pending = n + m
        return self.keys, self.values

    def _room(self, like_k: torch.Tensor, like_v: torch.Tensor, n: int, m: int) -> None:
        """Buffers shaped like ``like_k`` / ``like_v`` [b, heads, ·, d] with room for n + m rows whose
        first n are the layer's rows. Rows that are not the buffers' own (a layer replaced from
        outside, a batch or shape change) are adopted into fresh buffers."""
        buf = self._kbuf
        if (buf is None or n + m > buf.shape[2] or buf.shape[:2] != like_k.shape[:2]
                or buf.shape[3] != like_k.shape[3] or (n and not self.in_buffers())):
            rows = max(n + m + (n + m) // 2, self.min_rows)
            kbuf = like_k.new_empty(*like_k.shape[:2], rows, like_k.shape[3])
            vbuf = like_v.new_empty(*like_v.shape[:2], rows, like_v.shape[3])
            if n:
                kbuf[:, :, :n] = self.keys
                vbuf[:, :, :n] = self.values
            # the rows now live in the new buffers (none yet: the views stay as they are until written)
            self._kbuf, self._vbuf, self._pending = kbuf, vbuf, n or None

    def reserve(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for m more rows after the layer's rows (an initialised layer of 4-D keys), nothing
        written: the key and value buffers [b, heads, capacity, d], for a writer that fills rows
        [rows in use, + m) itself (``kernels/cpu_decoder.py``) and then calls :meth:`advance`."""
        k, v = self.buffers() if self.in_buffers() else (self.keys, self.values)
        self._room(k, v, self.rows(), m)
        return self._kbuf, self._vbuf

    def advance(self, m: int) -> None:
        """Take m rows written into the buffers after the layer's rows (see :meth:`reserve`)."""
        self._pending = self.rows() + m

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.is_initialized and self.in_buffers():
            self._pending = max(self.rows() + tokens_to_remove, 0)
            return
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        self._pending = None
        super().reset()
        self._kbuf = self._vbuf = None


def growing_cache(config) -> DynamicCache:
    """transformers' dynamic cache for ``config`` with each plain layer a :class:`GrowingLayer`
    (sliding-window and other special layers are left as transformers made them)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
