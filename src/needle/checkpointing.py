"""Activation checkpointing: ``ndl.checkpoint(fn, *args)`` is ``fn(*args)`` that keeps none
of ``fn``'s intermediate arrays for the backward pass and runs ``fn`` again there to get
them (``torch.utils.checkpoint``'s trade, and what transformers' ``gradient_checkpointing``
does a decoder layer at a time: the memory of every layer's activations for about a third
more compute).

Everything ``fn`` depends on must reach it as an argument Tensor or as a parameter of the
modules it calls: the trainable ones are found through ``params`` (default: every
``requires_grad`` Parameter of ``fn`` when it is a Module). The second run repeats the first
exactly: it runs under the autocast the first ran under, and the host generator that draws
dropout masks (``needle.init``) is rewound to where the first run found it, so its masks are
the same. Other side effects of ``fn`` (a BatchNorm's running statistics) happen twice, as
with PyTorch's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from . import amp, init
from .autograd import Tensor, TensorOp
from .backprop import grad
from .errors import ArgumentTypeError, GradientError
from .grad_mode import enable_grad, is_grad_enabled, no_grad
from .nn.nn_basic import Module, Parameter


class _Recompute(TensorOp):
    """``fn``'s output from its first n inputs (the arguments); the rest are the parameters
    it uses, inputs only so that their gradients flow out of ``gradient``."""

    def __init__(self, fn: Callable[..., Tensor], n_args: int):
        self.fn, self.n_args = fn, n_args
        self.autocast = amp.autocast_dtype()
        self.rng_state = init.default_generator().bit_generator.state

    def compute(self, *arrays):
        with no_grad():
            out = self.fn(*(Tensor.make_const(a) for a in arrays[:self.n_args]))
        if not isinstance(out, Tensor):
            raise ArgumentTypeError(f"checkpoint: the function must return one Tensor, got "
                                    f"{type(out).__name__}")
        return out.realize_cached_data()

    def gradient(self, out_grad: Tensor, node: Tensor):
        if is_grad_enabled():
            raise GradientError("checkpoint: the gradient of a checkpointed function cannot "
                                "itself be differentiated (create_graph=True); call the "
                                "function without checkpoint")
        args = [Tensor.make_const(x.realize_cached_data(), requires_grad=x.requires_grad)
                for x in node.inputs[:self.n_args]]
        params = node.inputs[self.n_args:]
        generator = init.default_generator().bit_generator
        after = generator.state
        generator.state = self.rng_state  # the same dropout masks as the first run
        try:
            with enable_grad(), amp.autocast(self.autocast or "bfloat16",
                                             enabled=self.autocast is not None):
                out = self.fn(*args)
        finally:
            generator.state = after
        wanted = [t for t in (*args, *params) if t.requires_grad]
        if not out.requires_grad or not wanted:
            return tuple(None for _ in node.inputs)
        found = dict(zip(map(id, wanted), grad(out, wanted, out_grad)))
        return tuple(found.get(id(t)) for t in (*args, *params))


def checkpoint(fn: Callable[..., Tensor], *args: Tensor,
               params: Sequence[Parameter] | None = None) -> Tensor:
    """``fn(*args)``, its intermediate arrays recomputed in the backward pass instead of
    kept (module docstring). ``params``: the trainable Parameters ``fn`` uses (default: a
    Module's own, those with ``requires_grad``). Outside grad mode it is ``fn(*args)``."""
    if not callable(fn):
        raise ArgumentTypeError(f"checkpoint: fn must be callable, got {type(fn).__name__}")
    for i, a in enumerate(args):
        if not isinstance(a, Tensor):
            raise ArgumentTypeError(f"checkpoint: argument {i} must be a Tensor, got "
                                    f"{type(a).__name__}; pass other values through a closure")
    if params is None:
        if not isinstance(fn, Module):
            raise ArgumentTypeError("checkpoint: pass params= (the Parameters fn trains) "
                                    "when fn is not a Module")
        params = [p for p in fn.parameters() if p.requires_grad]
    if not is_grad_enabled():
        return fn(*args)
    return _Recompute(fn, len(args))(*args, *params)
