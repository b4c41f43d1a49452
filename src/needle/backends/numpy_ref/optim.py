"""Fused optimizer updates."""

from __future__ import annotations

import math

import numpy as np

from .core import Array, _f, _store

# --- optimizer updates ------------------------------------------------------------------
# One parameter's whole update in one pass, in place: an optimizer step written with the
# functions above costs a dozen passes over the weights and as many launches. ``param`` and
# ``grad`` share a dtype; the state buffers are float32 for float16/bfloat16 parameters and
# of the parameter's dtype otherwise, and all arithmetic runs in the state's dtype, rounding
# ``param`` once when it is written. Products and sums follow needle.optim's formulas in
# order, so float64 results are those of the unfused update bit for bit.

def adam_update(param: Array, grad: Array, m: Array, v: Array, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float, step: int,
                decoupled: bool) -> None:
    """Adam step number ``step`` (>= 1) of one parameter; ``m`` and ``v`` are the moments
    (zeros before the first step). With c = scalars rounded to the state's dtype:

    decay: ``w = w * (1 - lr*wd)`` when ``decoupled`` (AdamW), else ``g = g + w * wd``;
    ``m = m*b1 + g*(1-b1)``; ``v = v*b2 + (g*g)*(1-b2)``;
    ``w = w - m / (sqrt(v) + eps*sqrt(bc2)) * (lr*sqrt(bc2)/bc1)``, ``bc_i = 1 - b_i**step``.
    """
    c = m.array.dtype.type
    w, g = _f(param.array), _f(grad.array)
    with np.errstate(all="ignore"):
        if decoupled:
            w = w * c(1 - lr * weight_decay)
        elif weight_decay:
            g = g + w * c(weight_decay)
        g2 = g * g
        g2 *= c(1 - beta2)
        m.array *= c(beta1)
        m.array += g * c(1 - beta1)
        v.array *= c(beta2)
        v.array += g2
        root_bc2 = math.sqrt(1 - beta2 ** step)
        denom = np.sqrt(v.array)
        denom += c(eps * root_bc2)
        update = m.array / denom
        update *= c(lr * root_bc2 / (1 - beta1 ** step))
        _store(param, w - update)


def adam_update_many(params: list, grads: list, ms: list, vs: list, lr: float, beta1: float,
                     beta2: float, eps: float, weight_decay: float, step: int,
                     decoupled: bool) -> None:
    """``adam_update`` of each parameter in turn (capability ``multi_tensor_adam``): lists
    of equal length, the parameters of one dtype, one set of hyper-parameters. A backend
    may update them in any order and together (one launch for many), so each result must
    be bitwise what ``adam_update`` of that parameter alone gives."""
    for param, grad, m, v in zip(params, grads, ms, vs):
        adam_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, decoupled)


def sgd_update(param: Array, grad: Array, momentum_buf: Array | None, lr: float,
               momentum: float, dampening: float, weight_decay: float, nesterov: bool,
               first: bool) -> None:
    """SGD step of one parameter, as torch.optim.SGD. ``momentum_buf`` is None exactly when
    ``momentum`` is 0; ``first`` says it holds nothing yet (the step sets it to g).

    ``g = g + w * wd``; ``u = g`` (first) or ``u = u*mu + g*(1-dampening)``;
    ``w = w - (g + u*mu if nesterov else u) * lr`` (``w = w - g * lr`` without momentum).
    """
    w, g = _f(param.array), _f(grad.array)
    c = g.dtype.type
    with np.errstate(all="ignore"):
        if weight_decay:
            g = g + w * c(weight_decay)
        if momentum_buf is not None:
            u = momentum_buf.array
            if first:
                u[:] = g
            else:
                u *= c(momentum)
                u += g * c(1 - dampening) if dampening else g
            g = g + u * c(momentum) if nesterov else u
        _store(param, w - g * c(lr))
