"""Mixed precision: autocast's dtype rules, float32 master weights, bfloat16 training on the
digits converging like float32, and the float16 loss scaler."""

import threading

import numpy as np
import pytest

import needle as ndl
from needle import nn, optim
from needle.data import DigitsDataset
from needle.errors import ArgumentError

CPU = ndl.cpu()


def t(a, device=CPU, dtype="float32", requires_grad=False):
    return ndl.Tensor(np.asarray(a, np.float32), device=device, dtype=dtype,
                      requires_grad=requires_grad)


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_autocast_dtype_rules(low):
    rng = np.random.default_rng(0)
    x = t(rng.standard_normal((4, 3)), requires_grad=True)
    w = t(rng.standard_normal((3, 5)), requires_grad=True)
    img = t(rng.standard_normal((2, 5, 5, 3)))
    k = t(rng.standard_normal((3, 3, 3, 4)))
    with ndl.autocast(low):
        y = x @ w
        assert y.dtype == low  # matmuls run in the low dtype
        assert ndl.conv(img, k, padding=1).dtype == low
        assert y.sum().dtype == "float32"  # reductions, softmax and losses in float32
        assert ndl.mean(y).dtype == "float32"
        assert ndl.softmax(y).dtype == "float32"
        assert ndl.log_softmax(y).dtype == "float32"
        assert ndl.logsumexp(y, axes=(1,)).dtype == "float32"
        hot = ndl.Tensor(np.eye(5, dtype=np.float32)[[0, 1, 2, 3]], device=CPU, dtype=low,
                         requires_grad=False)
        assert ndl.softmax_cross_entropy(y, hot).dtype == "float32"
        assert (y + t(np.ones((4, 5)))).dtype == "float32"  # promotion as usual elsewhere
        assert (y * 2).dtype == low
        with ndl.autocast(enabled=False):
            assert (x @ w).dtype == "float32"
        assert ndl.amp.autocast_dtype() == low
        loss = y.sum()
    assert ndl.amp.autocast_dtype() is None
    assert (x @ w).dtype == "float32"  # off again after the block
    loss.backward()
    # master weights: parameters and their gradients stay float32
    assert w.dtype == w.grad.dtype == x.grad.dtype == "float32"
    ref = np.ones((4, 5), np.float32) @ w.numpy().T  # d(sum(x @ w))/dx
    np.testing.assert_allclose(x.grad.numpy(), ref, rtol=3e-2, atol=3e-2)


def test_autocast_is_per_thread_and_checks_its_dtype():
    seen = []
    with ndl.autocast("bfloat16"):
        worker = threading.Thread(target=lambda: seen.append(ndl.amp.autocast_dtype()))
        worker.start()
        worker.join()
    assert seen == [None]
    with pytest.raises(ArgumentError, match="bfloat16 or float16"):
        with ndl.autocast("float32"):
            pass


def _digits(n):
    data = DigitsDataset(train=True)
    x = np.stack([np.asarray(data[i][0], np.float32).reshape(-1) for i in range(n)])
    y = np.array([int(data[i][1]) for i in range(n)])
    return x, y


def _train_mlp(low, steps=60, batch=64):
    x, y = _digits(steps * batch // 4)
    ndl.init.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 64, device=CPU), nn.ReLU(), nn.Linear(64, 10, device=CPU))
    opt = optim.Adam(model.parameters(), lr=0.01)
    loss_fn = nn.SoftmaxLoss()
    losses = []
    for s in range(steps):
        i = (s * batch) % (len(y) - batch)
        xb = ndl.Tensor(x[i:i + batch], device=CPU, requires_grad=False)
        yb = ndl.Tensor(y[i:i + batch], device=CPU, requires_grad=False)
        with ndl.autocast(low, enabled=low is not None):
            loss = loss_fn(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.dtype == "float32" for p in model.parameters())
    return np.array(losses)


def test_bf16_mlp_on_digits_converges_like_fp32():
    fp32, bf16 = _train_mlp(None), _train_mlp("bfloat16")
    assert fp32[-10:].mean() < 0.3 * fp32[:5].mean()  # it learned
    assert abs(bf16[-10:].mean() - fp32[-10:].mean()) < 0.05
    assert not np.array_equal(fp32, bf16)  # the products really ran in bfloat16


def test_bf16_demo_cnn_converges_like_fp32():
    from needle.demo import build_model
    x, y = _digits(256)
    x = x.reshape(-1, 1, 8, 8)
    finals = []
    for low in (None, "bfloat16"):
        ndl.init.manual_seed(5)
        model = build_model(CPU)
        opt = optim.Adam(model.parameters(), lr=0.01)
        loss_fn = nn.SoftmaxLoss()
        losses = []
        for s in range(24):
            i = (s * 32) % (len(y) - 32)
            xb = ndl.Tensor(x[i:i + 32], device=CPU, requires_grad=False)
            yb = ndl.Tensor(y[i:i + 32], device=CPU, requires_grad=False)
            with ndl.autocast(low or "bfloat16", enabled=low is not None):
                loss = loss_fn(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < 0.5 * losses[0]
        finals.append(np.mean(losses[-6:]))
    assert abs(finals[0] - finals[1]) < 0.1


def test_grad_scaler_skips_overflowing_fp16_step_and_backs_off():
    rng = np.random.default_rng(1)
    w = ndl.Tensor(rng.standard_normal((8, 4)), device=CPU, dtype="float16")
    x = ndl.Tensor(rng.standard_normal((16, 8)) * 100, device=CPU, dtype="float16",
                   requires_grad=False)
    opt = optim.SGD([w], lr=0.1)
    scaler = ndl.amp.GradScaler(init_scale=2.0 ** 16, growth_interval=2)
    before = w.numpy().copy()
    loss = (x @ w).sum()
    opt.zero_grad()
    scaler.scale(loss).backward()  # 2**16 * ~1600 overflows float16 (max 65504)
    assert scaler.step(opt) is False
    scaler.update()
    np.testing.assert_array_equal(w.numpy(), before)  # the step was skipped
    assert scaler.scale_value == 2.0 ** 15 and scaler.skipped_steps == 1
    scaler.scale_value = 1.0 / 64  # small enough: finite gradients
    for _ in range(2):
        loss = (x @ w).sum()
        opt.zero_grad()
        scaler.scale(loss).backward()
        assert scaler.step(opt) is True
        scaler.update()
    assert not np.array_equal(w.numpy(), before)
    assert scaler.scale_value == 1.0 / 32  # grew after growth_interval clean steps
    # the unscaled gradient is the true one: d(sum(x @ w))/dw = x^T 1
    expected = x.numpy().astype(np.float32).T @ np.ones((16, 4), np.float32)
    np.testing.assert_allclose(w.grad.numpy().astype(np.float32), expected, rtol=2e-2)


def test_autocast_on_every_device(device):
    rng = np.random.default_rng(2)
    x = t(rng.standard_normal((2, 4, 8)), device=device, requires_grad=True)
    w = t(rng.standard_normal((8, 8)), device=device, requires_grad=True)
    with ndl.autocast("bfloat16"):
        h = x @ w
        q = ndl.reshape(h, (2, 1, 4, 8))
        att = ndl.scaled_dot_product_attention(q, q, q, causal=True)
        assert h.dtype == att.dtype == "bfloat16"
        loss = ndl.mean(att * att)
        assert loss.dtype == "float32"
    loss.backward()
    assert x.grad.dtype == w.grad.dtype == "float32"
    # the same graph in float32: the bfloat16 gradient is close to it
    x32 = t(x.numpy(), device=device, requires_grad=True)
    w32 = t(w.numpy(), device=device, requires_grad=True)
    q32 = ndl.reshape(x32 @ w32, (2, 1, 4, 8))
    a32 = ndl.scaled_dot_product_attention(q32, q32, q32, causal=True)
    ndl.mean(a32 * a32).backward()
    ref = w32.grad.numpy()
    assert np.abs(w.grad.numpy() - ref).max() < 0.05 * np.abs(ref).max()
