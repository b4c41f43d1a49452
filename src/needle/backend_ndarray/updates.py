"""Fused optimizer updates: one array-API call updates one parameter and its state in place.

Written with NDArray arithmetic, an Adam step is about a dozen whole-array operations per
parameter: a dozen passes over the weights, four temporaries, and on a GPU a dozen kernel
launches whose host cost dominates a small model's step. ``adam_update`` and ``sgd_update``
run the same formulas (``numpy_ref`` states them) in one pass. As everywhere in this layer,
the checks are made here, so a backend only ever sees compact buffers of the dtypes it
expects: ``param`` and ``grad`` of one floating dtype, the state in ``state_dtype`` of it.
"""

from __future__ import annotations

from ..backends import api
from ..errors import DTypeError, NeedleError, ShapeError
from . import dtypes
from .ndarray import NDArray


def state_dtype(dtype: str) -> str:
    """The dtype of optimizer state and arithmetic for parameters of ``dtype``: float32 for
    float16/bfloat16 parameters, whose squared small gradients and eps would underflow."""
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def _check(param: NDArray, grad: NDArray, buffers: dict[str, NDArray], what: str) -> NDArray:
    """Validate the operands; returns ``grad`` as a compact array of the parameter's dtype."""
    if not dtypes.is_floating(param.dtype):
        raise DTypeError(f"{what}: parameters must be floating-point, got {param.dtype}")
    if not param.is_compact():
        raise ShapeError(f"{what} updates the parameter in place, so it must be compact "
                         "(call .compact() and keep the result)")
    want = state_dtype(param.dtype)
    for name, a in {"grad": grad, **buffers}.items():
        param._check_device(a)
        if a.shape != param.shape:
            raise ShapeError(f"{what}: {name} has shape {a.shape}, the parameter {param.shape}")
        if name != "grad" and (a.dtype != want or not a.is_compact()):
            raise DTypeError(f"{what}: {name} must be a compact {want} array for a {param.dtype}"
                             f" parameter, got {a.dtype}"
                             + ("" if a.is_compact() else " (not compact)"))
    return grad.astype(param.dtype).compact()


def adam_update(param: NDArray, grad: NDArray, m: NDArray, v: NDArray, *, lr: float,
                beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                decoupled: bool = False) -> None:
    """Adam step number ``step`` (>= 1) of ``param`` in place, with its moments ``m`` and
    ``v`` (zeros before the first step); AdamW's decoupled decay when ``decoupled``, else
    L2 decay added to the gradient."""
    g = _check(param, grad, {"m": m, "v": v}, "adam_update")
    if int(step) < 1:
        raise NeedleError(f"adam_update: step counts from 1, got {step}")
    if param.size:
        param.device.backend.adam_update(
            param.handle, g.handle, m.handle, v.handle, float(lr), float(beta1), float(beta2),
            float(eps), float(weight_decay), int(step), bool(decoupled))


def adam_update_many(params: list[NDArray], grads: list[NDArray], ms: list[NDArray],
                     vs: list[NDArray], *, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float, step: int, decoupled: bool = False) -> None:
    """``adam_update`` of every ``params[i]`` with ``grads[i]``, ``ms[i]``, ``vs[i]`` and
    one set of hyper-parameters, each parameter's result bitwise its own ``adam_update``'s.
    Where the device declares ``multi_tensor_adam`` the parameters of each dtype are updated
    together (CUDA: a launch per 16 parameters instead of one each)."""
    if not len(params) == len(grads) == len(ms) == len(vs):
        raise ShapeError(f"adam_update_many: {len(params)} parameters, {len(grads)} gradients, "
                         f"{len(ms)} first and {len(vs)} second moments (one each)")
    if int(step) < 1:
        raise NeedleError(f"adam_update_many: step counts from 1, got {step}")
    groups: dict[tuple, list] = {}  # (device, dtype) -> [(param, grad, m, v)], in order
    for i, (w, g, m, v) in enumerate(zip(params, grads, ms, vs)):
        g = _check(w, g, {"m": m, "v": v}, f"adam_update_many (parameter {i})")
        if w.size:
            groups.setdefault((w.device, w.dtype), []).append((w, g, m, v))
    hyper = (float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(step),
             bool(decoupled))
    for (device, _), group in groups.items():
        backend = device.backend
        handles = [[a.handle for a in column] for column in zip(*group)]
        if api.has(backend, "multi_tensor_adam"):
            backend.adam_update_many(*handles, *hyper)
        else:
            for w, g, m, v in zip(*handles):
                backend.adam_update(w, g, m, v, *hyper)


def sgd_update(param: NDArray, grad: NDArray, momentum_buf: NDArray | None, *, lr: float,
               momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
               nesterov: bool = False, first: bool = False) -> None:
    """SGD step of ``param`` in place (torch.optim.SGD's formulas). ``momentum_buf`` is None
    without momentum; ``first`` says it holds nothing yet, so the step sets it to the
    gradient."""
    if (momentum_buf is None) != (momentum == 0):
        raise NeedleError("sgd_update needs a momentum buffer exactly when momentum != 0")
    buffers = {} if momentum_buf is None else {"momentum_buf": momentum_buf}
    g = _check(param, grad, buffers, "sgd_update")
    if param.size:
        param.device.backend.sgd_update(
            param.handle, g.handle, None if momentum_buf is None else momentum_buf.handle,
            float(lr), float(momentum), float(dampening), float(weight_decay), bool(nesterov),
            bool(first))
