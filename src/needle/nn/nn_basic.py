"""Modules, Parameters and the basic layers: linear, activations, norms, dropout, loss.

A Module finds its Parameters, buffers and submodules by looking through its attributes
(including lists, tuples and dicts of them), so layers are written as plain Python classes
that assign what they own in ``__init__``. Names are the attribute paths joined by dots
(``layers.0.weight``), which is what ``state_dict`` uses as keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np

from .. import backend_ndarray as nd
from .. import checks, init, ops, step_hooks
from ..autograd import Tensor
from ..backend_ndarray import NDArray
from ..backend_ndarray.dtypes import is_floating
from ..backends.api import has
from ..errors import (
    ArgumentTypeError,
    DTypeError,
    IndexOutOfRangeError,
    ModelFormatError,
    ShapeError,
)


class Parameter(Tensor):
    """A Tensor that a Module trains (it always requires grad)."""


def _find(value, name: str, kind) -> Iterator[tuple[str, object]]:
    """(name, object) for each ``kind`` at ``value`` or inside its lists, tuples and dicts."""
    if isinstance(value, kind):
        yield name, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _find(v, f"{name}.{i}", kind)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _find(v, f"{name}.{k}", kind)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class Module:
    """Base class of layers and models: ``forward`` is the computation, ``__call__`` runs it."""

    def __init__(self):
        self.training = True
        self._buffer_names: list[str] = []

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    # --- printing, as PyTorch prints a model -----------------------------------------------
    def extra_repr(self) -> str:
        """The settings shown between the parentheses: by default the module's public int,
        float, bool and str attributes (layers override this where that says too little)."""
        return ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                         if not k.startswith("_") and k != "training"
                         and isinstance(v, (bool, int, float, str)))

    def _repr_children(self) -> Iterator[tuple[str, Module]]:
        return self.named_children()

    def __repr__(self) -> str:
        children = [f"({name}): " + repr(m).replace("\n", "\n  ")
                    for name, m in self._repr_children()]
        extra = self.extra_repr()
        if not children:
            return f"{type(self).__name__}({extra})"
        lines = ([extra] if extra else []) + children
        return f"{type(self).__name__}(\n  " + "\n  ".join(lines) + "\n)"

    # --- what a module owns ------------------------------------------------------------
    def register_buffer(self, name: str, value: Tensor) -> None:
        """Keep ``value`` as state that is saved and moved with the module but not trained
        (BatchNorm's running statistics)."""
        setattr(self, name, value)
        if name not in self._buffer_names:
            self._buffer_names.append(name)

    def named_children(self) -> Iterator[tuple[str, Module]]:
        for name, value in vars(self).items():
            yield from _find(value, name, Module)

    def children(self) -> list[Module]:
        return [m for _, m in self.named_children()]

    def named_modules(self, prefix: str = "", _seen: set | None = None
                      ) -> Iterator[tuple[str, Module]]:
        """This module and every submodule below it, each once."""
        seen = set() if _seen is None else _seen
        if id(self) in seen:
            return
        seen.add(id(self))
        yield prefix, self
        for name, child in self.named_children():
            yield from child.named_modules(_join(prefix, name), seen)

    def modules(self) -> list[Module]:
        return [m for _, m in self.named_modules()]

    def named_parameters(self, prefix: str = "", _seen: set | None = None
                         ) -> Iterator[tuple[str, Parameter]]:
        """Every Parameter once (a shared one under its first name), in attribute order,
        submodules' parameters where the submodule is assigned."""
        seen = set() if _seen is None else _seen
        seen.add(id(self))
        for attr, value in vars(self).items():
            for name, obj in _find(value, attr, (Parameter, Module)):
                if id(obj) in seen:
                    continue
                if isinstance(obj, Parameter):
                    seen.add(id(obj))
                    yield _join(prefix, name), obj
                else:
                    yield from obj.named_parameters(_join(prefix, name), seen)

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        for module_name, module in self.named_modules(prefix):
            for name in getattr(module, "_buffer_names", ()):
                yield _join(module_name, name), getattr(module, name)

    def _named_state(self) -> dict[str, Tensor]:
        return {**dict(self.named_parameters()), **dict(self.named_buffers())}

    # --- saving and loading ------------------------------------------------------------
    def state_dict(self) -> dict[str, NDArray]:
        """Parameters and buffers by dotted name: the module's own arrays, not copies.
        Optimizers update them in place, so save (or copy) a state dict before training on."""
        return {name: t.realize_cached_data() for name, t in self._named_state().items()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy ``state`` (NDArrays, Tensors or numpy arrays by name) into this module.

        With ``strict``, every parameter and buffer must be present and nothing else.
        Shapes must match; values are converted to each parameter's device and dtype.
        Nothing is changed unless everything fits.
        """
        if not isinstance(state, Mapping):
            raise ArgumentTypeError(f"load_state_dict: state_dict must be a mapping of names to "
                                    f"arrays (from state_dict() or ndl.load), got "
                                    f"{type(state).__name__}")
        targets = self._named_state()
        if strict:
            missing = [k for k in targets if k not in state]
            unexpected = [k for k in state if k not in targets]
            if missing or unexpected:
                parts = ([f"missing keys {missing}"] if missing else []) + (
                    [f"unexpected keys {unexpected}"] if unexpected else [])
                raise ModelFormatError(f"state dict does not fit {type(self).__name__}: "
                                       + "; ".join(parts))
        updates = []
        for name, target in targets.items():
            if name not in state:
                continue
            value = state[name]
            value = value.realize_cached_data() if isinstance(value, Tensor) else value
            shape = tuple(value.shape) if hasattr(value, "shape") else np.shape(value)
            if shape != target.shape:
                raise ModelFormatError(f"state dict entry {name!r} has shape {shape}, the "
                                       f"model's is {target.shape}")
            updates.append((target, value))
        for target, value in updates:
            target.data = NDArray(value, device=target.device, dtype=target.dtype)

    # --- modes and placement -----------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        for m in self.modules():
            m.training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    def to(self, device=None, dtype=None) -> Module:
        """Move parameters and buffers to ``device``; cast floating ones to ``dtype``."""
        for t in self._named_state().values():
            array = t.realize_cached_data()
            target = dtype if dtype is not None and is_floating(array.dtype) else array.dtype
            if device is not None and device != array.device:
                # converted on the host: either device may lack the other's dtype (no float64
                # on Metal)
                t.data = NDArray(array.numpy(), device=device, dtype=target)
            else:
                t.data = array.astype(target)
        return self


class Identity(Module):
    def forward(self, x):
        return x


class Linear(Module):
    """y = x W + b with W stored (in_features, out_features), as needle does.

    W starts Kaiming-uniform (suited to ReLU layers) and b uniform in ±1/sqrt(in_features).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype="float32"):
        super().__init__()
        in_features = checks.positive(in_features, "in_features", "nn.Linear")
        out_features = checks.positive(out_features, "out_features", "nn.Linear")
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(init.kaiming_uniform(in_features, out_features, device=device,
                                                     dtype=dtype))
        bound = 1 / math.sqrt(in_features)
        self.bias = Parameter(init.rand(out_features, low=-bound, high=bound, device=device,
                                        dtype=dtype)) if bias else None

    def forward(self, x):
        if not isinstance(x, Tensor):
            raise ArgumentTypeError(f"nn.Linear: the input must be a Tensor, got "
                                    f"{type(x).__name__}")
        if not x.shape or x.shape[-1] != self.in_features:
            raise ShapeError(f"nn.Linear: the input's last dimension must be in_features="
                             f"{self.in_features}, got input of shape {x.shape}")
        y = x @ self.weight
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Flatten(Module):
    """(N, ...) -> (N, product of the rest)."""

    def forward(self, x):
        if not x.shape:
            raise ShapeError("nn.Flatten: the input needs a batch dimension, got a 0-d tensor")
        return ops.reshape(x, (x.shape[0], -1))


class ReLU(Module):
    def forward(self, x):
        return ops.relu(x)


class Tanh(Module):
    def forward(self, x):
        return ops.tanh(x)


class Sigmoid(Module):
    def forward(self, x):
        return ops.sigmoid(x)


class SiLU(Module):
    def forward(self, x):
        return ops.silu(x)


class GELU(Module):
    """The exact (erf) GELU, as ``torch.nn.GELU()``."""

    def forward(self, x):
        return ops.gelu(x)


class Sequential(Module):
    def __init__(self, *layers: Module):
        super().__init__()
        for i, layer in enumerate(layers):
            if not isinstance(layer, Module):
                raise ArgumentTypeError(f"nn.Sequential: layer {i} is a {type(layer).__name__}"
                                        f" ({layer!r}), not an nn.Module")
        self.layers = list(layers)

    def _repr_children(self) -> Iterator[tuple[str, Module]]:
        return ((str(i), layer) for i, layer in enumerate(self.layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class SoftmaxLoss(Module):
    """Mean cross-entropy of ``logits`` (..., classes) against integer labels (...)."""

    def forward(self, logits, y):
        if not isinstance(y, Tensor):
            raise ArgumentTypeError(f"SoftmaxLoss: the labels must be an integer Tensor, got "
                                    f"{type(y).__name__}")
        classes = logits.shape[-1]
        if tuple(y.shape) != tuple(logits.shape[:-1]):
            raise ShapeError(f"SoftmaxLoss: labels of shape {tuple(y.shape)} do not match "
                             f"logits of shape {logits.shape}")
        on_device = _check_labels(y, classes)
        rows = logits if logits.ndim == 2 else ops.reshape(logits, (-1, classes))
        labels = y if len(y.shape) == 1 else ops.reshape(y, (-1,))
        hot = init.one_hot(classes, labels, device=logits.device, dtype=logits.dtype)
        loss = ops.softmax_cross_entropy(rows, hot)
        return loss + _label_poison(hot) if on_device else loss


def _check_labels(y, classes: int) -> bool:
    """Labels must be integer class ids in [0, classes). Where the labels are in host memory
    they are checked now (an error); on a GPU reading them back would stall the device, so
    instead the caller adds ``_label_poison`` of the one-hot rows to the loss (NaN when any
    label is out of range: the loss is not a wrong finite number). Returns whether the
    device must check."""
    labels = y.realize_cached_data() if isinstance(y, Tensor) else y
    if not isinstance(labels, NDArray):
        labels = nd.array(np.asarray(labels))
    if is_floating(labels.dtype) or labels.dtype == "bool":
        raise DTypeError(f"SoftmaxLoss: labels must be integer class ids (int32 or int64), "
                         f"got {labels.dtype}")
    if not labels.size:
        return False
    # (not while ndl.compile records a step: a host read would make it uncapturable)
    if has(labels.device.backend, "host_memory") and not step_hooks.recording():
        lo, hi = labels.min().item(), labels.max().item()
        if lo < 0 or hi >= classes:
            raise IndexOutOfRangeError(f"SoftmaxLoss: label {lo if lo < 0 else hi} is not a "
                                       f"class id in 0..{classes - 1}")
        return False
    return True


def _label_poison(hot, per_label: bool = False):
    """0, or NaN where a label was out of range (one scalar for the batch, or per_label: one
    a label, the labels' shape), from the one-hot rows the loss uses: a row of a valid label
    sums to 1, of any other label to 0, and 0 * log(sum) is 0 or 0 * -inf = NaN. Four small
    kernels and no host read (an earlier form compared the labels with both bounds: ~12)."""
    counts = hot.realize_cached_data().sum(axis=len(hot.shape) - 1)
    poison = counts.log() * 0.0
    return Tensor((poison if per_label else poison.sum()).astype("float32"),
                  requires_grad=False)


class _BatchNorm(Module):
    """Normalise each feature by the batch's statistics while training and by running
    averages in eval mode. The running variance is the unbiased batch variance, as in
    PyTorch; normalising uses the biased one."""

    reduce_axes: tuple[int, ...] = ()

    def __init__(self, dim: int, eps: float = 1e-5, momentum: float = 0.1, device=None,
                 dtype="float32"):
        super().__init__()
        where = type(self).__name__
        dim = checks.positive(dim, "dim", where)
        eps = checks.number(eps, "eps", where, 0.0, low_open=True)
        momentum = checks.probability(momentum, "momentum", where)
        self.dim, self.eps, self.momentum = dim, eps, momentum
        self.weight = Parameter(init.ones(dim, device=device, dtype=dtype))
        self.bias = Parameter(init.zeros(dim, device=device, dtype=dtype))
        self.register_buffer("running_mean", init.zeros(dim, device=device, dtype=dtype))
        self.register_buffer("running_var", init.ones(dim, device=device, dtype=dtype))

    def _stat_shape(self, x) -> tuple[int, ...]:
        """Where the feature axis sits, so per-feature values broadcast against ``x``."""
        return tuple(self.dim if i == 1 else 1 for i in range(x.ndim))

    def forward(self, x):
        if x.ndim < 2 or x.shape[1] != self.dim:
            raise ShapeError(f"{type(self).__name__}({self.dim}) got input of shape {x.shape}")
        shape = self._stat_shape(x)
        axes = tuple(i for i in range(x.ndim) if i != 1)
        if self.training:
            count = x.size // self.dim
            if count == 0:
                raise ShapeError(f"{type(self).__name__}: a training batch needs at least one "
                                 f"sample (input shape {x.shape}); its statistics would be NaN "
                                 "and the running averages lost")
            mean = ops.summation(x, axes) / count
            centred = x - ops.broadcast_to(ops.reshape(mean, shape), x.shape)
            var = ops.summation(centred * centred, axes) / count
            m = self.momentum  # running averages are updated on the arrays, off the graph
            unbiased = var.realize_cached_data() * (count / max(count - 1, 1))
            keep = self.running_mean.dtype  # buffers keep their dtype whatever x's (PyTorch)
            self.running_mean.data = (self.running_mean.realize_cached_data() * (1 - m)
                                      + mean.realize_cached_data() * m).astype(keep)
            self.running_var.data = (self.running_var.realize_cached_data() * (1 - m)
                                     + unbiased * m).astype(keep)
        else:
            mean, var = self.running_mean, self.running_var
            centred = x - ops.broadcast_to(ops.reshape(mean, shape), x.shape)
        scale = ops.reshape(self.weight / (var + self.eps) ** 0.5, shape)
        return centred * ops.broadcast_to(scale, x.shape) + ops.broadcast_to(
            ops.reshape(self.bias, shape), x.shape)


class BatchNorm1d(_BatchNorm):
    """Batch norm of (N, features) input."""


class BatchNorm2d(_BatchNorm):
    """Batch norm of (N, C, H, W) input, per channel."""


class LayerNorm1d(Module):
    """Normalise over the last axis, then scale and shift (one fused kernel)."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype="float32"):
        super().__init__()
        self.dim = checks.positive(dim, "dim", "nn.LayerNorm1d")
        self.eps = checks.number(eps, "eps", "nn.LayerNorm1d", 0.0, low_open=True)
        self.weight = Parameter(init.ones(dim, device=device, dtype=dtype))
        self.bias = Parameter(init.zeros(dim, device=device, dtype=dtype))

    def forward(self, x):
        return ops.layernorm(x, self.weight, self.bias, self.eps)


class RMSNorm(Module):
    """x / sqrt(mean(x²) + eps) · w over the last axis (one fused kernel)."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype="float32"):
        super().__init__()
        self.dim = checks.positive(dim, "dim", "nn.RMSNorm")
        self.eps = checks.number(eps, "eps", "nn.RMSNorm", 0.0, low_open=True)
        self.weight = Parameter(init.ones(dim, device=device, dtype=dtype))

    def forward(self, x):
        return ops.rmsnorm(x, self.weight, self.eps)


class Dropout(Module):
    """While training, zero each element with probability ``p`` and scale the rest by
    1 / (1 - p); in eval mode, the identity. Masks come from ``needle.init``'s generator."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = checks.probability(p, "p", "nn.Dropout")

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        if self.p == 1:
            return x * 0.0
        keep = init.randb(*x.shape, p=1 - self.p, device=x.device, dtype=x.dtype)
        return x * (keep * (1 / (1 - self.p)))


class Residual(Module):
    """fn(x) + x."""

    def __init__(self, fn: Module):
        super().__init__()
        if not isinstance(fn, Module):
            raise ArgumentTypeError(f"nn.Residual: fn must be a Module, got {type(fn).__name__}")
        self.fn = fn

    def forward(self, x):
        return self.fn(x) + x
