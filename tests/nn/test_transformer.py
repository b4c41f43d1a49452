"""Attention and Transformer layers against a numpy reference."""

import numpy as np
import pytest

import needle as ndl
from needle import nn

from ..conftest import assert_close


def reference_attention(mha, x, context, causal):
    """The same layer written out in numpy: projections, repeated KV heads, softmax."""
    def proj(linear, v):
        return v @ linear.weight.numpy() + linear.bias.numpy()

    b, s, d = x.shape
    hd, h, kvh = mha.head_dim, mha.num_heads, mha.num_kv_heads
    q = proj(mha.q_proj, x).reshape(b, s, h, hd).transpose(0, 2, 1, 3)
    sk = context.shape[1]
    k = proj(mha.k_proj, context).reshape(b, sk, kvh, hd).transpose(0, 2, 1, 3)
    v = proj(mha.v_proj, context).reshape(b, sk, kvh, hd).transpose(0, 2, 1, 3)
    k, v = np.repeat(k, h // kvh, axis=1), np.repeat(v, h // kvh, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    if causal:
        visible = np.arange(sk)[None, :] <= np.arange(s)[:, None] + (sk - s)
        scores = np.where(visible, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = (p @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
    return proj(mha.out_proj, out)


@pytest.mark.parametrize("kv_heads,causal,cross", [(4, False, False), (2, True, False),
                                                   (1, False, True)])
def test_multihead_attention(device, rng, kv_heads, causal, cross):
    mha = nn.MultiHeadAttention(16, 4, num_kv_heads=kv_heads, causal=causal, device=device)
    assert mha.k_proj.weight.shape == (16, 4 * kv_heads)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    context = rng.standard_normal((2, 7, 16)).astype(np.float32) if cross else x
    xt = ndl.Tensor(x, device=device)
    out = mha(xt, ndl.Tensor(context, device=device) if cross else None)
    assert_close(out, reference_attention(mha, x, context, causal), "float32", "matmul")
    out.sum().backward()
    assert xt.grad.shape == x.shape and mha.k_proj.weight.grad.shape == (16, 4 * kv_heads)


def test_attention_argument_checks(device):
    with pytest.raises(ndl.ShapeError, match="divisible"):
        nn.MultiHeadAttention(10, 4, device=device)
    with pytest.raises(ndl.ShapeError, match="divisible"):
        nn.MultiHeadAttention(16, 4, num_kv_heads=3, device=device)
    with pytest.raises(ndl.ShapeError, match="batch, seq, 16"):
        nn.MultiHeadAttention(16, 4, device=device)(ndl.Tensor(np.zeros((5, 16)), device=device))


def test_transformer_layer_formula(device, rng):
    layer = nn.TransformerLayer(8, 2, 12, causal=True, device=device)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)

    def ln(v, norm):
        mu, var = v.mean(-1, keepdims=True), v.var(-1, keepdims=True)
        return (v - mu) / np.sqrt(var + 1e-5) * norm.weight.numpy() + norm.bias.numpy()

    h = x + reference_attention(layer.attn, ln(x, layer.attn_norm), ln(x, layer.attn_norm), True)
    first, last = layer.mlp.layers[0], layer.mlp.layers[3]
    hidden = np.maximum(ln(h, layer.mlp_norm) @ first.weight.numpy() + first.bias.numpy(), 0)
    expected = h + hidden @ last.weight.numpy() + last.bias.numpy()
    assert_close(layer(ndl.Tensor(x, device=device)), expected, "float32", "matmul")


def test_transformer_is_causal_and_trains(device, rng):
    model = nn.Transformer(16, 32, num_layers=2, num_heads=4, num_kv_heads=2, device=device,
                           max_len=8)
    x = rng.standard_normal((6, 2, 16)).astype(np.float32)  # (seq, batch, dim)
    out = model(ndl.Tensor(x, device=device))
    assert out.shape == (6, 2, 16)
    changed = x.copy()
    changed[4:] = rng.standard_normal((2, 2, 16))  # the future must not change the past
    out2 = model(ndl.Tensor(changed, device=device))
    assert_close(out2.numpy()[:4], out.numpy()[:4], "float32", "matmul")
    assert not np.allclose(out2.numpy()[4:], out.numpy()[4:])
    batch_first = nn.Transformer(16, 32, 1, num_heads=4, batch_first=True, device=device)
    assert batch_first(ndl.Tensor(x, device=device)).shape == (6, 2, 16)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ndl.ShapeError, match="max_len"):
        model(ndl.Tensor(np.zeros((9, 1, 16)), device=device))
