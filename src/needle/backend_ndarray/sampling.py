"""``sample``: the next token of each row of logits, chosen on the logits' device.

Checks here, as everywhere in this layer, so a backend only sees compact buffers of the
dtypes it expects. The semantics are the reference's (``backends/numpy_ref/sampling.py``):
transformers' repetition penalty, temperature, top-k, top-p and min-p, then a draw from a
hash of (seed, position), reproducible on every device. Backends with capability
``sampling`` implement it; nothing here reads device memory, so a captured decode step can
sample without the logits ever reaching the host.
"""

from __future__ import annotations

from ..backends.api import has
from ..errors import DeviceError, DTypeError, ShapeError
from . import dtypes
from .ndarray import NDArray

PARAMS = 5  # per row: temperature, top_k, top_p, min_p, repetition_penalty


def sample(logits: NDArray, params: NDArray, seeds: NDArray, positions: NDArray,
           seen: NDArray, out: NDArray | None = None) -> NDArray:
    """Tokens (rows,) int32 for ``logits`` (rows, vocab).

    ``params`` (rows, 5) float32: temperature (0: greedy), top_k (0: off), top_p (1: off),
    min_p (0: off), repetition_penalty (1: off); ``seeds`` (rows,) int32; ``positions``
    (rows,) int32, the positions of the tokens being chosen; ``seen`` (rows, vocab) bool,
    updated in place with the chosen tokens. ``out``: a compact int32 array of ``rows``
    elements to write the tokens into (e.g. the next decode step's input).
    """
    if logits.ndim != 2 or not dtypes.is_floating(logits.dtype):
        raise ShapeError(f"sample needs floating-point logits of shape (rows, vocab), got "
                         f"{logits.shape} of {logits.dtype}")
    rows, vocab = logits.shape
    want = {"params": (params, (rows, PARAMS), "float32"), "seeds": (seeds, (rows,), "int32"),
            "positions": (positions, (rows,), "int32"), "seen": (seen, (rows, vocab), "bool")}
    if out is None:
        out = NDArray.make((rows,), device=logits.device, dtype="int32")
    want["out"] = (out, (out.size,), "int32")
    for name, (array, shape, dtype) in want.items():
        logits._check_device(array)
        if array.size != rows * (shape[1] if len(shape) > 1 else 1) or array.dtype != dtype \
                or not array.is_compact():
            raise DTypeError(f"sample: {name} must be a compact {dtype} array of shape {shape},"
                             f" got {array.shape} of {array.dtype}")
    backend = logits.device.backend
    if not has(backend, "sampling"):
        raise DeviceError(f"{logits.device.name} cannot sample on the device (no capability "
                          "'sampling'); sample from logits.numpy() on the host instead")
    if rows:
        backend.sample(logits.compact().handle, params.handle, seeds.handle, positions.handle,
                       seen.handle, out.handle, rows, vocab)
    return out
