"""ndl.compile: a recorded training step replays to the same parameters as the eager step
(bitwise on the CPUs, within tolerance on GPUs), records anew for a new shape, and runs
eagerly, saying why, when the step cannot be replayed."""

import warnings

import numpy as np
import pytest

import needle as ndl
from needle import nn, optim

STEPS = 7


def _batches(n=STEPS, rows=6, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((rows, 8)).astype(np.float32), rng.integers(0, 4, rows))
            for _ in range(n)]


def _model(device):
    ndl.init.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16, device=device), nn.ReLU(),
                         nn.Linear(16, 4, device=device))


def _data(device, x, y):
    return (ndl.Tensor(x, device=device, requires_grad=False),
            ndl.Tensor(y, device=device, requires_grad=False))


def _train(device, compiled: bool, batches, body_runs=None):
    model = _model(device)
    opt = optim.AdamW(model.parameters(), lr=0.02)
    schedule = optim.CosineDecay(opt, total_steps=len(batches))
    loss_fn = nn.SoftmaxLoss()

    def step(x, y):
        if body_runs is not None:
            body_runs.append(1)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        schedule.step()  # changes lr every call: must not be frozen by the recording
        return loss

    fn = ndl.compile(step) if compiled else step
    losses = [fn(*_data(device, x, y)).numpy() for x, y in batches]
    return fn, model, opt, np.array(losses)


def test_compiled_step_matches_eager(device):
    batches = _batches()
    runs: list = []
    fn, model_c, opt_c, losses_c = _train(device, True, batches, runs)
    _, model_e, opt_e, losses_e = _train(device, False, batches)
    assert fn.fallback_reason(*_data(device, *batches[0])) is None
    stats = fn.stats(*_data(device, *batches[0]))
    assert stats["recorded"]
    assert len(runs) == 3  # two watched calls and the recording; the rest were replays
    assert opt_c.step_count == opt_e.step_count == STEPS
    exact = device.kind in ("cpu", "cpu_numpy")
    for pc, pe in zip(model_c.parameters(), model_e.parameters()):
        if exact:
            np.testing.assert_array_equal(pc.numpy(), pe.numpy())
        else:
            np.testing.assert_allclose(pc.numpy(), pe.numpy(), rtol=1e-4, atol=1e-5)
    if exact:
        np.testing.assert_array_equal(losses_c, losses_e)
    else:
        np.testing.assert_allclose(losses_c, losses_e, rtol=1e-4, atol=1e-5)
    assert len(set(losses_c.tolist())) == STEPS  # each replay returned its own loss
    if stats["graphs"]:  # graphs: a replay is a few launches instead of every op's
        assert stats["replay_launches"] < stats["eager_calls"] / 3


def test_recording_anew_for_a_new_shape():
    dev = ndl.cpu()
    small, big = _batches(5, rows=3, seed=1), _batches(5, rows=6, seed=2)
    order = [small[0], big[0], small[1], big[1], small[2], big[2], small[3], big[3],
             small[4], big[4]]
    fn, model_c, _, losses_c = _train(dev, True, order)
    _, model_e, _, losses_e = _train(dev, False, order)
    np.testing.assert_array_equal(losses_c, losses_e)
    for pc, pe in zip(model_c.parameters(), model_e.parameters()):
        np.testing.assert_array_equal(pc.numpy(), pe.numpy())
    for x, y in (small[0], big[0]):
        assert fn.stats(*_data(dev, x, y))["recorded"]


def _fallback(step, *args):
    fn = ndl.compile(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [fn(*args) for _ in range(4)]
    assert any(issubclass(w.category, ndl.CompileFallbackWarning) for w in caught)
    return fn.fallback_reason(*args), outs


def test_host_read_inside_the_step_runs_eagerly_with_the_reason():
    dev = ndl.cpu()
    model = _model(dev)
    opt = optim.SGD(model.parameters(), lr=0.1)
    logged = []

    def step(x, y):
        opt.zero_grad()
        loss = nn.SoftmaxLoss()(model(x), y)
        loss.backward()
        opt.step()
        logged.append(loss.item())  # a host read: not replayable
        return loss

    reason, outs = _fallback(step, *_data(dev, *_batches(1)[0]))
    assert ".item()" in reason
    assert len(logged) == 4  # every call ran the body
    assert [float(o.numpy()) for o in outs] == logged


def test_host_data_changing_between_calls_runs_eagerly():
    dev = ndl.cpu()
    rng = np.random.default_rng(0)

    def step(x):
        noise = ndl.Tensor(rng.standard_normal(x.shape).astype(np.float32), device=dev,
                           requires_grad=False)
        return (x + noise).sum()

    x = ndl.Tensor(np.ones((3, 3), np.float32), device=dev, requires_grad=False)
    reason, outs = _fallback(step, x)
    assert "differs between calls" in reason
    assert len({float(o.numpy()) for o in outs}) == 4


def test_state_carried_by_new_arrays_runs_eagerly():
    dev = ndl.cpu()
    ndl.init.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4, device=dev), nn.BatchNorm1d(4, device=dev))
    opt = optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        opt.step()
        return loss

    x = ndl.Tensor(np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32),
                   device=dev, requires_grad=False)
    reason, _ = _fallback(step, x)
    assert "previous call" in reason


def test_arguments_that_cannot_be_recorded():
    dev = ndl.cpu()
    reason, outs = _fallback(lambda: ndl.Tensor([1.0], device=dev).sum())
    assert "no tensor arguments" in reason and outs[0].numpy() == 1.0
    w = ndl.Tensor([1.0, 2.0], device=dev)
    reason, _ = _fallback(lambda a: (a * 2).sum(), w)
    assert "requires grad" in reason
    with pytest.raises(ndl.ArgumentTypeError, match="hashable"):
        ndl.compile(lambda a, b: a)(w, [1, 2])
    with pytest.raises(ndl.ArgumentTypeError, match="callable"):
        ndl.compile(3)


def test_replay_copies_new_inputs_and_returns_fresh_outputs():
    dev = ndl.cpu()
    fn = ndl.compile(lambda x, y: (x * y + 1.0, {"total": (x - y).sum()}))
    rng = np.random.default_rng(3)
    results = []
    for _ in range(6):
        a, b = rng.standard_normal((2, 5)).astype(np.float32)
        prod, extra = fn(ndl.Tensor(a, device=dev, requires_grad=False),
                         ndl.Tensor(b, device=dev, requires_grad=False))
        results.append((prod, extra["total"], a, b))
    for prod, total, a, b in results:  # earlier outputs were not overwritten by later calls
        np.testing.assert_array_equal(prod.numpy(), a * b + np.float32(1.0))
        np.testing.assert_allclose(total.numpy(), (a - b).sum(), rtol=1e-6)


def test_new_parameter_storage_records_anew_and_errors_retry():
    dev = ndl.cpu()
    batches = _batches(8)
    fn, model_c, opt_c, _ = _train(dev, True, batches[:4])
    _, model_e, opt_e, _ = _train(dev, False, batches[:4])
    # replace every parameter's storage (as loading a checkpoint does) on both sides
    for pc, pe in zip(model_c.parameters(), model_e.parameters()):
        pc.data = pe.data = ndl.Tensor(np.full(pc.shape, 0.01, np.float32), device=dev)
    loss_fn = nn.SoftmaxLoss()

    def eager(x, y):
        opt_e.zero_grad()
        loss = loss_fn(model_e(x), y)
        loss.backward()
        opt_e.step()
        return loss

    for x, y in batches[4:]:
        assert float(fn(*_data(dev, x, y)).numpy()) == float(eager(*_data(dev, x, y)).numpy())
    for pc, pe in zip(model_c.parameters(), model_e.parameters()):
        np.testing.assert_array_equal(pc.numpy(), pe.numpy())
    # a step that raises while being recorded is recorded on a later call
    runs: list = []

    def flaky(x):
        out = (x * 2.0).sum()
        runs.append(1)
        if len(runs) == 2:  # the second watched call
            raise ValueError("boom")
        return out

    fn2 = ndl.compile(flaky)
    x = ndl.Tensor(np.ones(3, np.float32), device=dev, requires_grad=False)
    assert float(fn2(x).numpy()) == 6.0
    with pytest.raises(ValueError, match="boom"):
        fn2(x)
    assert [float(fn2(x).numpy()) for _ in range(3)] == [6.0] * 3
    assert fn2.stats(x)["recorded"]


def test_other_threads_work_is_not_recorded():
    import threading
    dev = ndl.cpu()
    other = ndl.Tensor(np.zeros(4, np.float32), device=dev)
    other_opt = optim.SGD([other], lr=1.0)

    def side_work():  # another thread's training step, run while the step is being recorded
        other.grad = ndl.Tensor(np.ones(4, np.float32), device=dev, requires_grad=False)
        other_opt.step()

    def step(x):
        worker = threading.Thread(target=side_work)
        worker.start()
        worker.join()
        return (x * 3.0).sum()

    fn = ndl.compile(step)
    x = ndl.Tensor(np.ones(2, np.float32), device=dev, requires_grad=False)
    outs = [float(fn(x).numpy()) for _ in range(6)]
    assert outs == [6.0] * 6 and fn.stats(x)["recorded"]
    # the side thread ran with the three calls that ran the body, never in a replay
    np.testing.assert_array_equal(other.numpy(), np.full(4, -3.0, np.float32))
    assert other_opt.step_count == 3


def test_every_backend_function_is_known_to_the_recorder():
    """A backend function the recorder does not know is forwarded as is: in a deferred
    (fused) recording it would run once, while recording, and never at replay. Every public
    function of every backend is work, a host read or a service (recording.py's lists)."""
    import inspect

    import needle.backend_ndarray as nd
    from needle import recording
    from needle.backends.cuda.backend import CudaBackend
    from needle.backends.metal.backend import MetalBackend

    known = (recording._WORK | set(recording._HOST_READS) | recording.SERVICES
             | {"Array", "from_numpy"})
    for backend in (CudaBackend, MetalBackend, nd.cpu().backend, nd.cpu_numpy().backend):
        names = {n for n, v in inspect.getmembers(backend)
                 if not n.startswith("_") and callable(v) and not inspect.isclass(v)
                 and not inspect.ismodule(v)
                 and (not inspect.ismodule(backend)
                      or getattr(v, "__module__", "").startswith("needle"))}
        assert names <= known, (getattr(backend, "__name__", backend), sorted(names - known))


def test_capability_functions_replay_with_each_calls_input(device):
    """nd.matmul_swiglu (its own kernel where the backend declares matmul_swiglu) inside a
    compiled step is recorded like any work: every replay computes it from that call's
    input (a forwarded function would have kept the recording call's result)."""
    import needle.backend_ndarray as nd

    rng = np.random.default_rng(3)
    w = nd.array(rng.standard_normal((16, 8)).astype(np.float32), device=device)

    def step(x):
        return ndl.Tensor.make_const(nd.matmul_swiglu(x.realize_cached_data(), w))

    fn = ndl.compile(step, warn=False)
    for _ in range(5):
        x = rng.standard_normal((4, 8)).astype(np.float32)
        got = fn(ndl.Tensor(x, device=device, requires_grad=False)).numpy()
        gu = x.astype(np.float64) @ w.numpy().astype(np.float64).T
        g, u = gu[:, :8], gu[:, 8:]
        np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-4, atol=1e-5)
    assert fn.stats(ndl.Tensor(x, device=device, requires_grad=False))["recorded"]


@pytest.mark.parametrize("name", ["cpu_numpy", "cuda"])
def test_watching_a_step_holds_only_what_outlives_it(name):
    """The watched (eager) calls free their temporaries as an eager step does: what the
    watch keeps for comparing with the next call are the arrays still alive then (it kept
    every array a call made: a 1.1B LoRA step's 76 GiB against 20 eager)."""
    dev = ndl.cpu_numpy() if name == "cpu_numpy" else ndl.cuda()
    if not dev.enabled():
        pytest.skip(f"{name}: {dev.reason}")
    model = _model(dev)
    opt = optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        loss = (model(x) * 2.0 + 1.0).relu().sum()
        loss.backward()
        opt.step()
        return loss

    compiled = ndl.compile(step)
    x, _ = _data(dev, *_batches(1)[0])
    compiled(x)  # the loss dropped at once, as a loop that reads it drops it
    (entry,) = compiled._entries.values()
    entry.last.keep_survivors()  # what the next call is compared with
    held = entry.last.allocations
    assert 0 < len(held) <= 4  # the four gradients: not the step's temporaries
    assert len(held) < entry.eager_calls
