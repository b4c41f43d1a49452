"""Recurrent layers (RNN, LSTM) and the Embedding lookup.

Sequences are laid out (seq_len, batch, features), as in needle and PyTorch's default.
Weights are stored (in, out) so each step is ``x @ W``; gates are ordered as PyTorch's
(LSTM: input, forget, cell, output), so PyTorch weights load after a transpose.
"""

from __future__ import annotations

import math

import numpy as np

from .. import checks, init, ops
from ..autograd import Tensor
from ..backend_ndarray.dtypes import is_floating
from ..errors import DTypeError, ShapeError
from .nn_basic import Module, Parameter


def _uniform(shape, bound: float, device, dtype) -> Parameter:
    return Parameter(init.rand(*shape, low=-bound, high=bound, device=device, dtype=dtype))


class _Cell(Module):
    """Weights of one recurrent layer: ``gates`` blocks of ``hidden_size`` outputs each,
    all initialised uniformly in ±1/sqrt(hidden_size)."""

    gates = 1

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None,
                 dtype="float32"):
        super().__init__()
        checks.positive(input_size, "input_size", type(self).__name__)
        checks.positive(hidden_size, "hidden_size", type(self).__name__)
        self.input_size, self.hidden_size = input_size, hidden_size
        width, k = self.gates * hidden_size, 1 / math.sqrt(hidden_size)
        self.W_ih = _uniform((input_size, width), k, device, dtype)
        self.W_hh = _uniform((hidden_size, width), k, device, dtype)
        self.bias_ih = _uniform((width,), k, device, dtype) if bias else None
        self.bias_hh = _uniform((width,), k, device, dtype) if bias else None

    def _preactivation(self, x, h):
        out = x @ self.W_ih
        if h is not None:
            out = out + h @ self.W_hh
        if self.bias_ih is not None:
            out = out + (self.bias_ih + self.bias_hh)
        return out


class RNNCell(_Cell):
    """h' = nonlinearity(x W_ih + b_ih + h W_hh + b_hh) for x (batch, input_size)."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 nonlinearity: str = "tanh", device=None, dtype="float32"):
        super().__init__(input_size, hidden_size, bias, device, dtype)
        if nonlinearity not in ("tanh", "relu"):
            raise ShapeError(f"RNN nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        self.nonlinearity = nonlinearity

    def forward(self, x, h=None):
        z = self._preactivation(x, h)
        return ops.tanh(z) if self.nonlinearity == "tanh" else ops.relu(z)


class LSTMCell(_Cell):
    """One LSTM step: returns (h', c') from x (batch, input_size) and (h, c)."""

    gates = 4

    def forward(self, x, state=None):
        h, c = state if state is not None else (None, None)
        z = self._preactivation(x, h)
        batch = x.shape[0]
        i, f, g, o = ops.split(ops.reshape(z, (batch, 4, self.hidden_size)), axis=1)
        i, f, g, o = ops.sigmoid(i), ops.sigmoid(f), ops.tanh(g), ops.sigmoid(o)
        c_next = i * g if c is None else f * c + i * g
        return o * ops.tanh(c_next), c_next


def _check_sequence(x, input_size: int, name: str) -> None:
    if x.ndim != 3 or x.shape[2] != input_size:
        raise ShapeError(f"{name} needs input (seq_len, batch, {input_size}), got {x.shape}")


class RNN(Module):
    """A stack of ``num_layers`` RNN layers. ``forward(x, h0)`` takes x (seq_len, batch,
    input_size) and h0 (num_layers, batch, hidden_size) or None (zeros); it returns the last
    layer's outputs (seq_len, batch, hidden_size) and the final states (num_layers, batch,
    hidden_size)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, nonlinearity: str = "tanh", device=None, dtype="float32"):
        super().__init__()
        checks.positive(num_layers, "num_layers", type(self).__name__)
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.rnn_cells = [RNNCell(input_size if i == 0 else hidden_size, hidden_size, bias,
                                  nonlinearity, device, dtype) for i in range(num_layers)]

    def forward(self, x, h0=None):
        _check_sequence(x, self.input_size, "RNN")
        steps = list(ops.split(x, 0))
        states = list(ops.split(h0, 0)) if h0 is not None else [None] * self.num_layers
        final = []
        for cell, h in zip(self.rnn_cells, states):
            outputs = []
            for x_t in steps:
                h = cell(x_t, h)
                outputs.append(h)
            steps = outputs
            final.append(h)
        return ops.stack(steps, 0), ops.stack(final, 0)


class LSTM(Module):
    """A stack of ``num_layers`` LSTM layers. ``forward(x, (h0, c0))`` takes x (seq_len,
    batch, input_size) and states (num_layers, batch, hidden_size) each, or None (zeros);
    it returns the last layer's outputs and the final (h_n, c_n)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, device=None, dtype="float32"):
        super().__init__()
        checks.positive(num_layers, "num_layers", type(self).__name__)
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.lstm_cells = [LSTMCell(input_size if i == 0 else hidden_size, hidden_size, bias,
                                    device, dtype) for i in range(num_layers)]

    def forward(self, x, state=None):
        _check_sequence(x, self.input_size, "LSTM")
        steps = list(ops.split(x, 0))
        if state is None:
            states = [None] * self.num_layers
        else:
            states = list(zip(ops.split(state[0], 0), ops.split(state[1], 0)))
        final_h, final_c = [], []
        for cell, layer_state in zip(self.lstm_cells, states):
            outputs = []
            for x_t in steps:
                layer_state = cell(x_t, layer_state)
                outputs.append(layer_state[0])
            steps = outputs
            final_h.append(layer_state[0])
            final_c.append(layer_state[1])
        return ops.stack(steps, 0), (ops.stack(final_h, 0), ops.stack(final_c, 0))


class Embedding(Module):
    """Rows of a (num_embeddings, embedding_dim) table, initialised N(0, 1), at integer ids
    of any shape: the output has shape ids.shape + (embedding_dim,)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype="float32"):
        super().__init__()
        checks.positive(num_embeddings, "num_embeddings", "nn.Embedding")
        checks.positive(embedding_dim, "embedding_dim", "nn.Embedding")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = Parameter(init.randn(num_embeddings, embedding_dim, device=device,
                                           dtype=dtype))

    def forward(self, ids):
        if isinstance(ids, Tensor) and is_floating(ids.dtype):
            ids = _whole_ids(ids)
        return ops.embedding(self.weight, ids)


def _whole_ids(ids: Tensor) -> Tensor:
    """Float ids (the needle course's language model passes float32 batches) as int64,
    when every one is a whole number; anything else is an error, never a silent rounding."""
    host = ids.numpy()
    if not np.all(np.isfinite(host) & (host == np.round(host))):
        raise DTypeError(f"nn.Embedding: ids must be whole numbers, got {ids.dtype} values "
                         "with fractions; pass integer ids")
    return Tensor(host.astype(np.int64), device=ids.device, requires_grad=False)
