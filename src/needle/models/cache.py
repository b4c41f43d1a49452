"""The state a decoder keeps on the device between tokens: keys and values of every layer,
the rotary tables, and the two small buffers a captured decode step reads its inputs from."""

from __future__ import annotations

from .. import backend_ndarray as nd
from .config import ModelConfig, RopeConfig


class KVCache:
    """Keys and values of every layer for up to ``capacity`` positions, preallocated.

    Both are stored (1, kv_heads, capacity, head_dim) in the model's dtype (one sequence):
    prefill writes positions 0..n-1 (a captured prefill also its padding's rows past n) and
    each decode step writes its own position, and a step reads no row past its own, so rows
    past the length may hold a longer earlier sequence's keys.
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

    def __init__(self, device):
        self.token = nd.zeros((1, 1), "int32", device)
        self.position = nd.zeros((1,), "int32", device)
        # the most positions this step may read, host-side (the decoder's band, see
        # nd.attention_decode_bands): a hint for the attention kernel's choice; None: the cache
        self.max_positions: int | None = None

    def set(self, token: int, position: int) -> None:
        self.token[...] = token
        self.position[...] = position
