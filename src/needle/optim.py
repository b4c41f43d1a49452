"""Optimizers, gradient clipping and learning-rate schedules.

Updates work on the parameters' NDArrays, never on Tensors, so a step records no autograd
graph and holds no reference to the last forward pass. Each parameter's update is one fused
array-API call (``adam_update``, ``sgd_update``) that writes the weights and moment buffers
in place in a single pass: written as NDArray arithmetic it would be a dozen passes over all
the weights, four temporaries and, on a GPU, a dozen kernel launches per parameter. Gradients
are only read, never written, since autograd may hand one array to several leaves.

``state_dict``/``load_state_dict`` capture everything a step depends on (step count,
hyper-parameters, moment buffers), so training resumed from a checkpoint continues with the
very same updates.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from . import checks, step_hooks
from .autograd import Tensor
from .backend_ndarray import NDArray, adam_update_many, empty, sgd_update, state_dtype, zeros
from .errors import ArgumentError, ArgumentTypeError, ModelFormatError

__all__ = ["SGD", "Adam", "AdamW", "CosineDecay", "LinearWarmup", "LRScheduler", "Optimizer",
           "clip_grad_norm"]


def _grads(params: Iterable[Tensor]) -> list[tuple[Tensor, NDArray]]:
    return [(p, p.grad.realize_cached_data()) for p in params if p.grad is not None]


class Optimizer:
    """Holds the parameters and their per-parameter state (``self.state[i]`` for params[i]).

    Subclasses name their hyper-parameters in ``hyper`` (saved with the state) and their
    per-parameter buffers in ``buffers``.
    """

    hyper: tuple[str, ...] = ("lr",)
    buffers: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Tensor], lr: float):
        where = type(self).__name__
        if isinstance(params, Tensor):
            raise ArgumentTypeError(f"{where}: params must be an iterable of Tensors (e.g. "
                                    "model.parameters()), not one Tensor")
        try:
            self.params: list[Tensor] = list(dict.fromkeys(params))  # once each, in order
        except TypeError:
            raise ArgumentTypeError(f"{where}: params must be an iterable of Tensors, got "
                                    f"{type(params).__name__}") from None
        if not self.params:
            raise ArgumentError(f"{where}: the parameter list is empty")
        for i, p in enumerate(self.params):
            if not isinstance(p, Tensor):
                raise ArgumentTypeError(f"{where}: params[{i}] is a {type(p).__name__}, not a "
                                        "Tensor (pass model.parameters())")
        self.lr = checks.number(lr, "lr", where, 0.0)
        self.step_count = 0
        self.state: list[dict[str, NDArray]] = [{} for _ in self.params]

    def step(self) -> None:
        if step_hooks.handled(self, self._step):  # ndl.compile replays it on the host
            return
        self._step()

    def _step(self) -> None:
        self.step_count += 1
        arrays = [p.realize_cached_data() for p in self.params]
        sharing = Counter(id(w.handle) for w in arrays)
        for i, (p, w) in enumerate(zip(self.params, arrays)):
            if p.grad is not None and (sharing[id(w.handle)] > 1 or not w.is_compact()):
                # a compact private copy (taken before any update), so that updating it in
                # place changes no other parameter
                arrays[i] = p.data = w.copy()
        self._update_all([(i, w, p.grad.realize_cached_data())
                          for i, (p, w) in enumerate(zip(self.params, arrays))
                          if p.grad is not None])

    def _update_all(self, updates: list[tuple[int, NDArray, NDArray]]) -> None:
        """Update each (i, w, g) of ``updates``; an optimizer whose backends can update
        many parameters in one call overrides it."""
        for i, w, g in updates:
            self._update(i, w, g)

    def _update(self, i: int, w: NDArray, g: NDArray) -> None:
        """Update parameter ``i`` (value ``w``, compact and private) in place from its
        gradient ``g`` (any dtype: the update casts it to w's)."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Forget the gradients (backward then starts from nothing instead of adding)."""
        for p in self.params:
            p.grad = None

    reset_grad = zero_grad  # CMU needle's name

    def state_dict(self) -> dict:
        return {
            "type": type(self).__name__,
            "step": self.step_count,
            "hyper": {name: getattr(self, name) for name in self.hyper},
            "state": {str(i): dict(s) for i, s in enumerate(self.state) if s},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict`` saved from an optimizer of the same type and parameters."""
        if not isinstance(state, dict) or not {"type", "step", "state"} <= set(state):
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ModelFormatError(f"load_state_dict needs what Optimizer.state_dict() returns "
                                   f"(a dict with 'type', 'step', 'hyper', 'state'), got {keys}")
        if not isinstance(state["state"], dict) or not isinstance(state.get("hyper", {}), dict):
            raise ModelFormatError("optimizer state: 'state' and 'hyper' must be dicts")
        if state.get("type") != type(self).__name__:
            raise ModelFormatError(f"optimizer state is for {state.get('type')!r}, this is "
                                   f"{type(self).__name__}")
        new_state: list[dict[str, NDArray]] = [{} for _ in self.params]
        for key, buffers in state.get("state", {}).items():
            try:
                i = int(key)
            except (TypeError, ValueError):
                raise ModelFormatError(f"optimizer state has an entry {key!r}, not a "
                                       "parameter index") from None
            if not isinstance(buffers, dict):
                raise ModelFormatError(f"optimizer state of parameter {i} must be a dict of "
                                       f"buffers, got {type(buffers).__name__}")
            if not 0 <= i < len(self.params):
                raise ModelFormatError(f"optimizer state has an entry for parameter {i}, but "
                                       f"this optimizer has {len(self.params)} parameters")
            w = self.params[i].realize_cached_data()
            for name, value in buffers.items():
                value = value.realize_cached_data() if isinstance(value, Tensor) else value
                array = NDArray(value, device=w.device, dtype=state_dtype(w.dtype))
                if array.shape != w.shape:
                    raise ModelFormatError(f"optimizer buffer {name!r} of parameter {i} has "
                                           f"shape {array.shape}, the parameter {w.shape}")
                new_state[i][name] = array
        hyper = {}
        for name, value in state.get("hyper", {}).items():
            if name in self.hyper:
                if name != "nesterov":
                    checks.number(value, name, f"{type(self).__name__} state")
                hyper[name] = value
        step = checks.integer(state["step"], "step", f"{type(self).__name__} state", 0)
        self.state, self.step_count = new_state, step
        for name, value in hyper.items():
            setattr(self, name, value)


class SGD(Optimizer):
    """Stochastic gradient descent, as ``torch.optim.SGD``: with weight decay ``wd`` and
    momentum ``mu``, ``g += wd * w``; ``u = mu * u + (1 - dampening) * g`` (u = g at the
    first step); ``w -= lr * u`` (``lr * (g + mu * u)`` with ``nesterov``)."""

    hyper = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    buffers = ("momentum_buffer",)

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False):
        super().__init__(params, lr)
        # momentum >= 1 makes the buffer grow without bound (PyTorch allows it; needle refuses)
        self.momentum = checks.number(momentum, "momentum", "SGD", 0.0, 1.0, high_open=True)
        self.dampening = checks.probability(dampening, "dampening", "SGD")
        self.weight_decay = checks.number(weight_decay, "weight_decay", "SGD", 0.0)
        self.nesterov = bool(nesterov)
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise ArgumentError("SGD: nesterov=True needs a momentum > 0 and dampening=0 (as in "
                                f"PyTorch), got momentum={self.momentum}, "
                                f"dampening={self.dampening}")

    def _update(self, i, w, g):
        u = None
        if self.momentum:
            u = self.state[i].get("momentum_buffer")
        first = self.momentum and u is None
        if first:  # the step writes the buffer (u = g) before reading it
            u = self.state[i]["momentum_buffer"] = empty(w.shape, state_dtype(w.dtype),
                                                         w.device)
        sgd_update(w, g, u, lr=self.lr, momentum=self.momentum, dampening=self.dampening,
                   weight_decay=self.weight_decay, nesterov=self.nesterov, first=bool(first))


class Adam(Optimizer):
    """Adam (Kingma and Ba, 2015). ``weight_decay`` adds ``wd * w`` to the gradient (L2
    regularisation, as ``torch.optim.Adam``); for decoupled decay use ``AdamW``."""

    hyper = ("lr", "beta1", "beta2", "eps", "weight_decay")
    buffers = ("m", "v")
    decoupled = False  # L2 decay, added to the gradient

    def __init__(self, params, lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, lr)
        where = type(self).__name__
        self.beta1 = checks.number(beta1, "beta1", where, 0.0, 1.0, high_open=True)
        self.beta2 = checks.number(beta2, "beta2", where, 0.0, 1.0, high_open=True)
        self.eps = checks.number(eps, "eps", where, 0.0)
        self.weight_decay = checks.number(weight_decay, "weight_decay", where, 0.0)

    def _update_all(self, updates):
        """All parameters' steps in one ``adam_update_many`` (on CUDA a launch per 16
        parameters rather than one each; elsewhere one update each, the same values)."""
        for i, w, _ in updates:
            state = self.state[i]
            if "m" not in state:  # the moments start at zero
                state["m"] = zeros(w.shape, state_dtype(w.dtype), w.device)
                state["v"] = zeros(w.shape, state_dtype(w.dtype), w.device)
        adam_update_many([w for _, w, _ in updates], [g for _, _, g in updates],
                         [self.state[i]["m"] for i, _, _ in updates],
                         [self.state[i]["v"] for i, _, _ in updates], lr=self.lr,
                         beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                         weight_decay=self.weight_decay, step=self.step_count,
                         decoupled=self.decoupled)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov and Hutter, 2019), as
    ``torch.optim.AdamW``: ``w *= 1 - lr * wd`` before the Adam step."""

    decoupled = True

    def __init__(self, params, lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.01):
        super().__init__(params, lr, beta1, beta2, eps, weight_decay)


def clip_grad_norm(params: Iterable[Tensor], max_norm: float, eps: float = 1e-6) -> Tensor:
    """Scale all gradients together so that their global L2 norm is at most ``max_norm``.

    Returns the norm before clipping as a 0-d Tensor. Everything stays on the device: the
    scale ``min(1, max_norm / (norm + eps))`` is computed there, so clipping never waits
    for the device.
    """
    if isinstance(params, Tensor) or not isinstance(params, Iterable):
        raise ArgumentTypeError(f"clip_grad_norm: params must be an iterable of Tensors (e.g. "
                                f"model.parameters()), got {type(params).__name__}")
    max_norm = checks.number(max_norm, "max_norm", "clip_grad_norm", 0.0, low_open=True)
    eps = checks.number(eps, "eps", "clip_grad_norm", 0.0)
    grads = _grads(params)
    if not grads:
        return Tensor(0.0, requires_grad=False)
    total = None
    for _, g in grads:
        g32 = g.astype("float32")  # half-precision squares would overflow
        sq = (g32 * g32).sum()
        total = sq if total is None else total + sq
    norm = total.sqrt()
    scale = (float(max_norm) / (norm + eps)).minimum(1.0)
    for p, g in grads:
        p.grad = Tensor(g * scale.astype(g.dtype), requires_grad=False)
    return Tensor(norm, requires_grad=False)


class LRScheduler:
    """Sets ``optimizer.lr`` from the number of ``step()`` calls so far.

    Works with any optimizer (everything here reads ``lr`` at each step). The learning rate
    the optimizer had when the scheduler was made is the base the schedule scales.
    """

    def __init__(self, optimizer: Optimizer):
        if not isinstance(optimizer, Optimizer):
            raise ArgumentTypeError(f"{type(self).__name__}: optimizer must be an Optimizer, "
                                    f"got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.base_lr = optimizer.lr
        self.last_step = 0
        optimizer.lr = self.lr_at(0)

    def lr_at(self, step: int) -> float:
        raise NotImplementedError

    def step(self) -> None:
        if step_hooks.handled(self, self._step):
            return
        self._step()

    def _step(self) -> None:
        self.last_step += 1
        self.optimizer.lr = self.lr_at(self.last_step)

    def state_dict(self) -> dict:
        return {"base_lr": self.base_lr, "last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.base_lr = state["base_lr"]
        self.last_step = state["last_step"]
        self.optimizer.lr = self.lr_at(self.last_step)


class LinearWarmup(LRScheduler):
    """lr grows linearly from base_lr / warmup_steps to base_lr over ``warmup_steps`` steps,
    then stays there."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int):
        self.warmup_steps = checks.positive(warmup_steps, "warmup_steps", "LinearWarmup")
        super().__init__(optimizer)

    def lr_at(self, step: int) -> float:
        return self.base_lr * min(1.0, (step + 1) / self.warmup_steps)


class CosineDecay(LRScheduler):
    """Optional linear warmup, then a half cosine from base_lr down to ``min_lr`` at
    ``total_steps`` (and ``min_lr`` after that)."""

    def __init__(self, optimizer: Optimizer, total_steps: int, warmup_steps: int = 0,
                 min_lr: float = 0.0):
        total_steps = checks.positive(total_steps, "total_steps", "CosineDecay")
        warmup_steps = checks.integer(warmup_steps, "warmup_steps", "CosineDecay", 0)
        if warmup_steps >= total_steps:
            raise ArgumentError(f"CosineDecay: warmup_steps must be < total_steps, got "
                                f"{warmup_steps} and {total_steps}")
        min_lr = checks.number(min_lr, "min_lr", "CosineDecay", 0.0)
        self.total_steps, self.warmup_steps, self.min_lr = total_steps, warmup_steps, min_lr
        super().__init__(optimizer)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_lr + (self.base_lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
