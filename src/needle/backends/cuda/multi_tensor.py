"""Many parameters' optimizer steps in one launch (capability ``multi_tensor_adam``).

``adam_update_many`` runs numpy_ref.adam_update_many: Adam steps of a list of parameters
with one set of hyper-parameters. ``optim.cu``'s ``adam_update_many_*`` takes up to
``ADAM_MANY`` tensors a launch, their addresses and sizes in the params struct (passed by
value as a raw argument: a CUDA graph keeps them, and no table is uploaded), and updates each
element with the same arithmetic as ``adam_update_*``, so the results are bitwise those of
one launch per parameter. A 6-layer GPT's AdamW step: 102 launches become 7.
"""

from __future__ import annotations

import struct

from ...errors import DTypeError, ShapeError
from ..gpu.array import ADAM, FLOATS, SUFFIX, cdiv
from ..gpu.optim import OptimOps, adam_scalars
from .memory import address

ADAM_MANY = 16  # tensors a launch takes (optim.cu)
ADAM_MANY_THREADS, ADAM_MANY_BLOCK = 256, 256 * 8  # a group's threads and elements
# AdamManyParams after its AdamParams header: count, w, g, m, v addresses, n, first_group
_TABLE = struct.Struct(f"q{ADAM_MANY}Q{ADAM_MANY}Q{ADAM_MANY}Q{ADAM_MANY}Q{ADAM_MANY}q"
                       f"{ADAM_MANY + 1}q")


class MultiTensorOps(OptimOps):
    def adam_update_many(self, params: list, grads: list, ms: list, vs: list, lr: float,
                         beta1: float, beta2: float, eps: float, weight_decay: float,
                         step: int, decoupled: bool) -> None:
        """numpy_ref.adam_update_many: the parameters (one dtype) in launches of
        ADAM_MANY tensors; empty ones are skipped."""
        if not len(params) == len(grads) == len(ms) == len(vs):
            raise ShapeError("adam_update_many: one gradient and two moments per parameter")
        work = [t for t in zip(params, grads, ms, vs) if t[0].size]
        if not work:
            return
        dt = self._need(work[0][0].dtype, FLOATS, "adam_update_many")
        if any(t[0].dtype != dt or t[1].dtype != dt for t in work):
            raise DTypeError("adam_update_many: the parameters and gradients of one call share "
                             "a dtype (nd.adam_update_many groups them)")
        mode, scalars = adam_scalars(dt, lr, beta1, beta2, eps, weight_decay, step, decoupled)
        header = ADAM[dt].pack(0, mode, *scalars)
        k = self._kernel("optim", f"adam_update_many_{SUFFIX[dt]}")
        for start in range(0, len(work), ADAM_MANY):
            self._adam_launch(k, header, work[start:start + ADAM_MANY])

    def _adam_launch(self, kernel, header: bytes, tensors: list) -> None:
        pad = [0] * (ADAM_MANY - len(tensors))
        columns = [[address(t[j]) for t in tensors] + pad for j in range(4)]
        sizes = [t[0].size for t in tensors]
        first = [0]
        for n in sizes:
            first.append(first[-1] + cdiv(n, ADAM_MANY_BLOCK))
        table = _TABLE.pack(len(tensors), *columns[0], *columns[1], *columns[2], *columns[3],
                            *sizes, *pad, *first, *pad)
        self.queue.dispatch(kernel, (first[-1], 1, 1), (ADAM_MANY_THREADS, 1, 1), (),
                            raw_args=(header + table,))
        # the kernel reaches the tensors through its params, not its buffer arguments: a
        # capture must still keep them alive
        self.queue.keep([a.buffer for t in tensors for a in t])
