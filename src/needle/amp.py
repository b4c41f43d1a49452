"""Mixed precision: ``autocast`` and a loss scaler for float16.

Inside ``with ndl.autocast("bfloat16"):`` the ops of two lists change the dtype of their
floating-point inputs before computing:

* **low precision** (``matmul``, ``conv``, ``scaled_dot_product_attention``): float32
  inputs are cast to the autocast dtype, so the product runs on the matrix units and its
  output has that dtype;
* **float32** (``summation``/``mean``, ``logsumexp``, ``softmax``, ``log_softmax``,
  ``softmax_cross_entropy``): float16/bfloat16 inputs are cast to float32, so reductions,
  normalisers and losses accumulate in float32.

Every other op follows the ordinary promotion rules (bfloat16 + float32 is float32, so a
Linear layer's bias add brings its output back to float32). The casts are ops of the graph
(``ops.cast``): the backward pass runs each product in the low dtype too and casts the
gradient back to the float32 parameter, so the parameters, their gradients and the optimizer
state stay float32 ("master weights") without any copy in the optimizer.

The switch is per thread. The ops call ``low_precision_inputs`` / ``float32_inputs`` (two
lines each in ``ops``); outside autocast these return their arguments after one attribute
read.

``GradScaler`` keeps float16 gradients from underflowing: ``scale(loss)`` multiplies the loss
by a large factor before ``backward``; ``step(opt)`` divides the gradients by it, skips the
update when any gradient is inf or NaN, and ``update()`` halves the factor after such a step
and doubles it after ``growth_interval`` clean ones. bfloat16 has float32's range and needs
no scaler.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from . import checks
from .backend_ndarray import dtypes
from .errors import ArgumentError, ArgumentTypeError

__all__ = ["GradScaler", "autocast", "autocast_dtype"]

_LOW = ("bfloat16", "float16")
_HALF = frozenset(_LOW)


class _State(threading.local):
    dtype: str | None = None  # the autocast dtype, or None outside autocast


_state = _State()


@contextlib.contextmanager
def autocast(dtype: str = "bfloat16", enabled: bool = True) -> Iterator[None]:
    """Run matmuls and convolutions in ``dtype`` (bfloat16 or float16) and reductions,
    softmax and losses in float32 inside the block (see the module's docstring).
    ``enabled=False`` turns autocast off inside an enclosing block."""
    if not isinstance(enabled, bool):
        raise ArgumentTypeError(f"autocast: enabled must be a bool, got {enabled!r}")
    low = None
    if enabled:
        low = dtypes.canonical(dtype)
        if low not in _LOW:
            raise ArgumentError(f"autocast: dtype must be bfloat16 or float16, got {low}; "
                                "float32 needs no autocast")
    previous, _state.dtype = _state.dtype, low
    try:
        yield
    finally:
        _state.dtype = previous


def autocast_dtype() -> str | None:
    """The dtype matmuls run in here (None outside autocast)."""
    return _state.dtype


def low_precision_inputs(*tensors):
    """The inputs of a matmul/conv/attention: float32 tensors cast to the autocast dtype."""
    low = _state.dtype
    if low is None:
        return tensors
    from . import ops  # ops import this module
    return tuple(ops.cast(t, low) if getattr(t, "dtype", None) == "float32" else t for t in tensors)


def float32_inputs(*tensors):
    """The inputs of a reduction/softmax/loss: half-precision tensors cast to float32."""
    if _state.dtype is None:
        return tensors
    from . import ops
    return tuple(ops.cast(t, "float32") if getattr(t, "dtype", None) in _HALF else t
                 for t in tensors)


class GradScaler:
    """Dynamic loss scaling for float16 training (as ``torch.amp.GradScaler``)::

        scaler = ndl.amp.GradScaler()
        with ndl.autocast("float16"):
            loss = loss_fn(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)      # unscales; skips the update if a gradient is inf/NaN
        scaler.update()       # backoff after a skipped step, growth after clean ones

    ``step`` reads one number back from the device (whether all gradients are finite), so a
    step using the scaler is not capturable by ``ndl.compile``; bfloat16 needs no scaler.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True):
        self.scale_value = checks.number(init_scale, "init_scale", "GradScaler", 0.0,
                                         low_open=True)
        self.growth_factor = checks.number(growth_factor, "growth_factor", "GradScaler", 1.0,
                                           low_open=True)
        self.backoff_factor = checks.number(backoff_factor, "backoff_factor", "GradScaler",
                                            0.0, 1.0, low_open=True, high_open=True)
        self.growth_interval = checks.positive(growth_interval, "growth_interval", "GradScaler")
        self.enabled = bool(enabled)
        self._clean_steps = 0
        self._unscaled: set[int] = set()
        self._found_inf: dict[int, bool] = {}
        self.skipped_steps = 0

    def scale(self, loss):
        """``loss`` times the current scale (a Tensor op: backward flows through it)."""
        return loss * self.scale_value if self.enabled else loss

    def unscale_(self, optimizer) -> bool:
        """Divide ``optimizer``'s gradients by the scale, in place of ``p.grad``; returns
        whether any is inf or NaN (once per step: a second call does nothing)."""
        key = id(optimizer)
        if not self.enabled or key in self._unscaled:
            return self._found_inf.get(key, False)
        from .autograd import Tensor
        inv = 1.0 / self.scale_value
        total = None
        for p in optimizer.params:
            if p.grad is None:
                continue
            g = p.grad.realize_cached_data() * inv
            p.grad = Tensor(g, requires_grad=False)
            # inf * 0 and nan * 0 are NaN: the sum is NaN exactly when an entry is not finite
            probe = (g.astype("float32") * 0.0).sum()
            total = probe if total is None else total + probe
        found = total is not None and total.item() != 0.0  # NaN != 0
        self._unscaled.add(key)
        self._found_inf[key] = found
        return found

    def step(self, optimizer) -> bool:
        """Unscale (if not done yet) and run ``optimizer.step()`` unless a gradient is inf or
        NaN. Returns whether the update ran."""
        if not self.enabled:
            optimizer.step()
            return True
        found = self.unscale_(optimizer)
        if found:
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Adjust the scale after a step: backoff if any optimizer saw inf/NaN, growth after
        ``growth_interval`` clean steps in a row."""
        if not self.enabled:
            return
        if any(self._found_inf.values()):
            self.scale_value *= self.backoff_factor
            self._clean_steps = 0
        else:
            self._clean_steps += 1
            if self._clean_steps >= self.growth_interval:
                self.scale_value *= self.growth_factor
                self._clean_steps = 0
        self._unscaled.clear()
        self._found_inf.clear()

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._clean_steps = int(state["clean_steps"])
