"""The state a decoder keeps on the device between tokens: keys and values of every layer,
the rotary tables, and the two small buffers a captured decode step reads its inputs from."""

from __future__ import annotations

import numpy as np

from .. import backend_ndarray as nd
from ..backend_ndarray import NDArray
from .config import ModelConfig, RopeConfig


class KVCache:
    """Keys and values of every layer for up to ``capacity`` positions, preallocated.

    Both are stored (1, kv_heads, capacity, head_dim) in the model's dtype (one sequence):
    prefill writes positions 0..n-1 (a captured prefill also its padding's rows past n) and
    each decode step writes its own position, and a step reads no row past its own. Where a
    model has a layer on the composed attention path (``attention.py``), whose decode step
    adds its key and value into its row, the decoder keeps rows past the length zero
    (``clear`` and ``forget_from``); fused layers overwrite their row, so other models may
    leave stale rows there.
    """

    def __init__(self, cfg: ModelConfig, capacity: int, device, dtype: str = "float32"):
        self.capacity, self.dtype = capacity, dtype
        kv, d = cfg.num_kv_heads, cfg.head_dim
        self.keys = [nd.empty((1, kv, capacity, d), dtype, device)
                     for _ in range(cfg.num_layers)]
        self.values = [nd.empty((1, kv, capacity, d), dtype, device)
                       for _ in range(cfg.num_layers)]
        self.clear()

    def clear(self) -> None:
        for array in self.keys + self.values:
            array.fill(0)

    def forget_from(self, length: int, written: int) -> None:
        """Zero positions ``length`` and later (a rewind); ``written``: the rows that may
        hold values (those past it are zero already)."""
        stop = min(written, self.capacity)
        if length < stop:
            for array in self.keys + self.values:
                array[:, :, length:stop, :] = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)


class RotaryTables:
    """cos and sin of every position up to ``length``, (length, head_dim/2), on the device;
    ``for_layer(i)``: the tables layer i rotates with (Gemma 3's sliding layers have their
    own, made once and shared)."""

    def __init__(self, cfg: ModelConfig, length: int, device, dtype: str,
                 rope: RopeConfig | None = None):
        cos, sin = (rope or cfg.rope).tables(cfg.head_dim, length)
        self.cos, self.sin = (nd.array(t, dtype=dtype, device=device) for t in (cos, sin))
        self._layers: list[RotaryTables] | None = None
        if rope is None and cfg.rope_local is not None:
            local = RotaryTables(cfg, length, device, dtype, cfg.rope_local)
            self._layers = [local if cfg.layer_rope(i) is cfg.rope_local else self
                            for i in range(cfg.num_layers)]

    def for_layer(self, layer: int) -> RotaryTables:
        return self if self._layers is None else self._layers[layer]

    def distinct(self) -> list[RotaryTables]:
        """Every table set, once (one, or the global and the local)."""
        return [self] if self._layers is None else list({id(t): t for t in self._layers}.values())


class DecodeState:
    """The inputs of one decode step, in device buffers the host rewrites before each step
    (or that the previous captured step advanced itself)."""

    def __init__(self, cfg: ModelConfig, device):
        self.token = nd.zeros((1, 1), "int32", device)
        self.position = nd.zeros((1,), "int32", device)
        # the most positions this step may read, host-side (the decoder's band, see
        # nd.attention_decode_bands): a hint for the attention kernel's choice; None: the cache
        self.max_positions: int | None = None
        # constants of the composed attention path: cache row indices and head offsets
        self.cache_rows: NDArray | None = None
        self.head_rows: NDArray | None = None
        self._cfg, self._device = cfg, device

    def set(self, token: int, position: int) -> None:
        self.token[...] = token
        self.position[...] = position

    def composed_constants(self, capacity: int) -> tuple[NDArray, NDArray]:
        """(0..capacity-1, kv head h's first row h * capacity), made once, int32."""
        if self.cache_rows is None:
            self.cache_rows = nd.array(np.arange(capacity, dtype=np.int32), device=self._device)
            self.head_rows = nd.array(
                np.arange(self._cfg.num_kv_heads, dtype=np.int32) * capacity,
                device=self._device)
        return self.cache_rows, self.head_rows
