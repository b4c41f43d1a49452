"""Fused optimizer updates (kernel file ``optim``): one launch per parameter per step, the
per-step scalars folded on the host in double precision exactly as numpy_ref folds them."""

from __future__ import annotations

import math

from .array import ADAM, FLOATS, SGD, SUFFIX, GpuArray, scalar
from .base import GpuBase

_SGD_MOMENTUM, _SGD_FIRST, _SGD_NESTEROV, _SGD_DAMPENED = 1, 2, 4, 8


def adam_scalars(dt: str, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, step: int, decoupled: bool) -> tuple[int, tuple]:
    """AdamParams' decay mode and its seven per-step scalars, folded in double."""
    root_bc2 = math.sqrt(1 - beta2 ** step)
    mode = 2 if decoupled else (1 if weight_decay else 0)
    decay = 1 - lr * weight_decay if decoupled else weight_decay
    scalars = (beta1, 1 - beta1, beta2, 1 - beta2, eps * root_bc2,
               lr * root_bc2 / (1 - beta1 ** step), decay)
    return mode, tuple(scalar(dt, x) for x in scalars)


class OptimOps(GpuBase):
    def adam_update(self, param: GpuArray, grad: GpuArray, m: GpuArray, v: GpuArray, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                    decoupled: bool) -> None:
        """One Adam step of ``param`` in place (see numpy_ref.adam_update)."""
        dt = self._need(param.dtype, FLOATS, "adam_update")
        mode, scalars = adam_scalars(dt, lr, beta1, beta2, eps, weight_decay, step, decoupled)
        if param.size:
            self._launch_1d(f"adam_update_{SUFFIX[dt]}", param.size,
                            (param.buffer, grad.buffer, m.buffer, v.buffer),
                            ADAM[dt].pack(param.size, mode, *scalars), "optim")

    def sgd_update(self, param: GpuArray, grad: GpuArray, momentum_buf: GpuArray | None,
                   lr: float, momentum: float, dampening: float, weight_decay: float,
                   nesterov: bool, first: bool) -> None:
        """One SGD step of ``param`` in place (see numpy_ref.sgd_update)."""
        dt = self._need(param.dtype, FLOATS, "sgd_update")
        flags = ((_SGD_MOMENTUM if momentum_buf is not None else 0)
                 | (_SGD_FIRST if first else 0) | (_SGD_NESTEROV if nesterov else 0)
                 | (_SGD_DAMPENED if dampening else 0))
        buf = param.buffer if momentum_buf is None else momentum_buf.buffer  # unused slot
        scalars = (lr, momentum, 1 - dampening, weight_decay)
        if param.size:
            self._launch_1d(f"sgd_update_{SUFFIX[dt]}", param.size,
                            (param.buffer, grad.buffer, buf),
                            SGD[dt].pack(param.size, flags, *(scalar(dt, x) for x in scalars)),
                            "optim")
