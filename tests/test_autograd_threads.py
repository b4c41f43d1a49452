"""Grad mode is per thread (#19 item 8): threads training independent models each get the
gradients a single-threaded run gets, and a thread working under no_grad leaves the others'
recording on."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import needle as ndl
from needle import nn
from needle.errors import GradientError

THREADS = 4
STEPS = 40


def _train(seed: int, device, barrier: threading.Barrier | None) -> list[np.ndarray]:
    """A small MLP trained with SGD for STEPS steps; the gradients of every step, in order.

    The barrier (when given) makes the threads step in lock-step so that their forward,
    backward and no_grad update phases overlap as much as possible.
    """
    rng = np.random.default_rng(seed)
    w1 = ndl.Tensor(rng.standard_normal((6, 8)).astype(np.float32), device=device)
    w2 = ndl.Tensor(rng.standard_normal((8, 3)).astype(np.float32), device=device)
    x = ndl.Tensor(rng.standard_normal((5, 6)).astype(np.float32), device=device,
                   requires_grad=False)
    grads = []
    for _ in range(STEPS):
        if barrier is not None:
            barrier.wait(timeout=60)  # a thread that failed breaks the barrier for all
        loss = ((x @ w1).relu() @ w2).sum()
        loss.backward()  # runs the backward pass under this thread's own no_grad
        grads.append(np.concatenate([w1.grad.numpy().ravel(), w2.grad.numpy().ravel()]))
        with ndl.no_grad():  # the optimizer-style update: must not switch others off
            w1.data = w1 - w1.grad * 0.01
            w2.data = w2 - w2.grad * 0.01
        w1.grad = w2.grad = None
    return grads


def _run_threads(target, args_per_thread) -> list:
    results: list = [None] * len(args_per_thread)
    errors: list[BaseException] = []

    def wrap(i, args):
        try:
            results[i] = target(*args)
        except BaseException as e:  # noqa: BLE001 (reported in the main thread below)
            errors.append(e)
            for a in args:  # release the other threads from a lock-step barrier
                if isinstance(a, threading.Barrier):
                    a.abort()

    threads = [threading.Thread(target=wrap, args=(i, a)) for i, a in enumerate(args_per_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a training thread hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("device", [ndl.cpu_numpy(), ndl.cpu()], ids=["cpu_numpy", "cpu"])
def test_four_threads_training_get_single_threaded_gradients(device):
    assert device.enabled(), device.reason  # both CPU backends are part of the install
    expected = [_train(seed, device, None) for seed in range(THREADS)]
    barrier = threading.Barrier(THREADS)
    got = _run_threads(_train, [(seed, device, barrier) for seed in range(THREADS)])
    for seed in range(THREADS):
        assert len(got[seed]) == STEPS
        for step in range(STEPS):
            np.testing.assert_allclose(got[seed][step], expected[seed][step], rtol=1e-5,
                                       atol=1e-6, err_msg=f"thread {seed}, step {step}")
    assert ndl.is_grad_enabled()


def test_no_grad_thread_beside_training_thread():
    """A 'server' thread sits inside no_grad the whole time the trainer trains."""
    inside_no_grad = threading.Event()
    trainer_done = threading.Event()
    server_saw: list[bool] = []

    def server():
        with ndl.no_grad():
            w = ndl.Tensor(np.ones((4, 4), np.float32))
            while not trainer_done.is_set():
                y = w @ w
                server_saw.append(y.requires_grad or ndl.is_grad_enabled())
                inside_no_grad.set()
        return True

    def trainer():
        assert inside_no_grad.wait(timeout=30)
        try:
            return _train(7, ndl.cpu_numpy(), None)
        finally:
            trainer_done.set()

    results = _run_threads(lambda f: f(), [(server,), (trainer,)])
    np.testing.assert_allclose(np.stack(results[1]), np.stack(_train(7, ndl.cpu_numpy(), None)),
                               rtol=1e-5, atol=1e-6)
    assert server_saw and not any(server_saw)  # the server never recorded a graph


def test_new_threads_start_with_grad_enabled():
    seen = []
    with ndl.no_grad():
        t = threading.Thread(target=lambda: seen.append(ndl.is_grad_enabled()))
        t.start()
        t.join()
    assert seen == [True]


def test_grad_mode_restored_on_exception_and_as_decorator():
    with pytest.raises(RuntimeError), ndl.no_grad():
        raise RuntimeError("inside")
    assert ndl.is_grad_enabled()
    with ndl.no_grad():
        with pytest.raises(RuntimeError), ndl.enable_grad():
            assert ndl.is_grad_enabled()
            raise RuntimeError("inside")
        assert not ndl.is_grad_enabled()

    @ndl.no_grad()
    def infer(x):
        assert not ndl.is_grad_enabled()
        return x * 2.0

    x = ndl.Tensor([1.0, 2.0])
    assert not infer(x).requires_grad and not infer(x).requires_grad  # decorator re-enters
    assert ndl.is_grad_enabled()
    # a failing backward leaves grad mode on
    with pytest.raises(GradientError):
        (ndl.Tensor([1.0], requires_grad=False) * 2.0).backward()
    assert ndl.is_grad_enabled()


def test_set_grad_enabled_function_and_context():
    with ndl.set_grad_enabled(False):
        assert not ndl.is_grad_enabled()
    assert ndl.is_grad_enabled()
    ndl.set_grad_enabled(False)
    try:
        assert not (ndl.Tensor([1.0]) * 2.0).requires_grad
    finally:
        ndl.set_grad_enabled(True)
    assert (ndl.Tensor([1.0]) * 2.0).requires_grad


def test_module_training_in_threads():
    """nn modules and an optimizer per thread: the loss falls in every thread."""
    def fit(seed):
        rng = np.random.default_rng(seed)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = ndl.optim.SGD(model.parameters(), lr=0.05)
        x = ndl.Tensor(rng.standard_normal((32, 4)).astype(np.float32), requires_grad=False)
        y = ndl.Tensor(rng.standard_normal((32, 1)).astype(np.float32), requires_grad=False)
        losses = []
        for _ in range(30):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss.numpy()))
            with ndl.no_grad():
                model(x)  # an evaluation between steps
        return losses

    for losses in _run_threads(fit, [(s,) for s in range(THREADS)]):
        assert losses[-1] < losses[0]
