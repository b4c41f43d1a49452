"""RNN, LSTM and Embedding against PyTorch with the same weights."""

import numpy as np
import pytest
import torch

import needle as ndl
from needle import nn

from ..conftest import assert_close


def copy_to_torch(cells, theirs):
    """Our (in, gates*hidden) weights are PyTorch's transposed; biases match as they are."""
    with torch.no_grad():
        for layer, cell in enumerate(cells):
            getattr(theirs, f"weight_ih_l{layer}").copy_(torch.tensor(cell.W_ih.numpy().T))
            getattr(theirs, f"weight_hh_l{layer}").copy_(torch.tensor(cell.W_hh.numpy().T))
            getattr(theirs, f"bias_ih_l{layer}").copy_(torch.tensor(cell.bias_ih.numpy()))
            getattr(theirs, f"bias_hh_l{layer}").copy_(torch.tensor(cell.bias_hh.numpy()))


def compare_grads(cells, theirs):
    for layer, cell in enumerate(cells):
        assert_close(cell.W_ih.grad, getattr(theirs, f"weight_ih_l{layer}").grad.numpy().T,
                     "float32", "matmul")
        assert_close(cell.W_hh.grad, getattr(theirs, f"weight_hh_l{layer}").grad.numpy().T,
                     "float32", "matmul")
        assert_close(cell.bias_ih.grad, getattr(theirs, f"bias_ih_l{layer}").grad.numpy(),
                     "float32", "matmul")


@pytest.mark.parametrize("nonlinearity,with_h0", [("tanh", True), ("relu", False)])
def test_rnn(device, rng, nonlinearity, with_h0):
    ours = nn.RNN(4, 5, num_layers=2, nonlinearity=nonlinearity, device=device)
    theirs = torch.nn.RNN(4, 5, num_layers=2, nonlinearity=nonlinearity)
    copy_to_torch(ours.rnn_cells, theirs)
    x = rng.standard_normal((6, 3, 4)).astype(np.float32)
    h0 = rng.standard_normal((2, 3, 5)).astype(np.float32)
    xt = ndl.Tensor(x, device=device)
    out, h = ours(xt, ndl.Tensor(h0, device=device) if with_h0 else None)
    rx = torch.tensor(x, requires_grad=True)
    ref, ref_h = theirs(rx, torch.tensor(h0) if with_h0 else None)
    assert_close(out, ref.detach().numpy(), "float32", "matmul")
    assert_close(h, ref_h.detach().numpy(), "float32", "matmul")
    (out.sum() + h.sum()).backward()
    (ref.sum() + ref_h.sum()).backward()
    assert_close(xt.grad, rx.grad.numpy(), "float32", "matmul")
    compare_grads(ours.rnn_cells, theirs)


@pytest.mark.parametrize("with_state", [True, False])
def test_lstm(device, rng, with_state):
    ours = nn.LSTM(4, 5, num_layers=2, device=device)
    theirs = torch.nn.LSTM(4, 5, num_layers=2)
    copy_to_torch(ours.lstm_cells, theirs)
    x = rng.standard_normal((5, 3, 4)).astype(np.float32)
    h0, c0 = (rng.standard_normal((2, 3, 5)).astype(np.float32) for _ in range(2))
    xt = ndl.Tensor(x, device=device)
    state = (ndl.Tensor(h0, device=device), ndl.Tensor(c0, device=device))
    out, (h, c) = ours(xt, state if with_state else None)
    rx = torch.tensor(x, requires_grad=True)
    ref, (ref_h, ref_c) = theirs(rx, (torch.tensor(h0), torch.tensor(c0)) if with_state else None)
    for got, want in ((out, ref), (h, ref_h), (c, ref_c)):
        assert_close(got, want.detach().numpy(), "float32", "matmul")
    (out.sum() + c.sum()).backward()
    (ref.sum() + ref_c.sum()).backward()
    assert_close(xt.grad, rx.grad.numpy(), "float32", "matmul")
    compare_grads(ours.lstm_cells, theirs)


def test_sequence_shape_check(device):
    with pytest.raises(ndl.ShapeError, match="seq_len, batch, 4"):
        nn.LSTM(4, 5, device=device)(ndl.Tensor(np.zeros((3, 4)), device=device))


def test_embedding(device):
    emb = nn.Embedding(7, 3, device=device)
    ids = np.array([[1, 6], [1, 0]])
    out = emb(ndl.Tensor(ids, device=device))
    assert out.shape == (2, 2, 3)
    np.testing.assert_array_equal(out.numpy(), emb.weight.numpy()[ids])
    out.sum().backward()
    counts = np.bincount(ids.ravel(), minlength=7)[:, None] * np.ones((1, 3))
    np.testing.assert_array_equal(emb.weight.grad.numpy(), counts)
