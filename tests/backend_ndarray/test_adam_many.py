"""``adam_update_many``: many parameters' Adam steps together (capability
``multi_tensor_adam``; CUDA launches 16 parameters at a time). Each parameter's weights and
moments must be bitwise those of ``adam_update`` of that parameter alone on the same device,
whatever its size, dtype or place in the list; the optimizer takes this path."""

from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
import needle.backend_ndarray as nd
from needle.errors import DTypeError, NeedleError, ShapeError

from ..conftest import supports
from .compare import np_dtype

# sizes around the CUDA kernel's 2,048 elements a group, empty ones, and more parameters than
# one launch takes (16), so that tensors share launches and a launch ends mid-list
SHAPES = [(0,), (1,), (7,), (2048,), (2049,), (33, 3), (4095,), (70001,), (512, 4),
          (3, 0), (16,), (1000,), (5, 7, 11), (2047,), (9,), (130,), (65,), (300, 3), (2,)]
HYPER = dict(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)


def _problem(rng, device, dtypes):
    """(params, grads, ms, vs) on ``device``, the dtypes taking turns."""
    params, grads, ms, vs = [], [], [], []
    for i, shape in enumerate(SHAPES * 2):
        dt = dtypes[i % len(dtypes)]
        w = rng.uniform(-2, 2, shape).astype(np_dtype(dt))
        g = (rng.uniform(-1, 1, shape) * 10.0 ** rng.integers(-6, 2, size=shape))
        params.append(nd.array(w, device=device))
        grads.append(nd.array(g.astype(np_dtype(dt)), device=device))
        state = nd.state_dtype(dt)
        ms.append(nd.zeros(shape, state, device))
        vs.append(nd.zeros(shape, state, device))
    return params, grads, ms, vs


def _copies(arrays):
    return [a.copy() for a in arrays]


@pytest.mark.parametrize("decoupled", [False, True])
def test_many_is_each_parameter_alone_bitwise(device, decoupled, rng):
    dtypes = [d for d in ("float32", "bfloat16", "float16", "float64") if supports(device, d)]
    params, grads, ms, vs = _problem(rng, device, dtypes)
    alone = [_copies(params), _copies(ms), _copies(vs)]
    for step in (1, 2, 3):
        nd.adam_update_many(params, grads, ms, vs, step=step, decoupled=decoupled, **HYPER)
        for w, g, m, v in zip(*alone[:1], grads, *alone[1:]):
            nd.adam_update(w, g, m, v, step=step, decoupled=decoupled, **HYPER)
    for i in range(len(params)):
        for name, got, want in (("param", params[i], alone[0][i]), ("m", ms[i], alone[1][i]),
                                ("v", vs[i], alone[2][i])):
            a, b = got.numpy(), want.numpy()
            assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), \
                f"{name} of parameter {i} {params[i].shape} {params[i].dtype}"


def test_optimizer_step_matches_one_update_per_parameter(device, rng):
    """AdamW over a small model's parameters (more than one launch's worth) gives the
    values of adam_update applied to each parameter in turn."""
    model = ndl.nn.Sequential(*[ndl.nn.Linear(8, 8, device=device) for _ in range(10)])
    params = model.parameters()
    opt = ndl.optim.AdamW(params, lr=0.01, weight_decay=0.05)
    ws = [p.realize_cached_data().copy() for p in params]
    state = [(nd.zeros(w.shape, "float32", device), nd.zeros(w.shape, "float32", device))
             for w in ws]
    for step in (1, 2):
        for p in params:
            p.grad = ndl.Tensor(rng.standard_normal(p.shape).astype(np.float32), device=device)
        opt.step()
        for w, p, (m, v) in zip(ws, params, state):
            nd.adam_update(w, p.grad.realize_cached_data(), m, v, lr=0.01, beta1=0.9,
                           beta2=0.999, eps=1e-8, weight_decay=0.05, step=step,
                           decoupled=True)
    for w, p in zip(ws, params):
        assert np.array_equal(p.numpy(), w.numpy())


def test_cuda_launches_sixteen_parameters_at_a_time(rng):
    dev = nd.cuda()
    if not dev.enabled():
        pytest.skip(f"cuda disabled: {dev.reason}")
    params, grads, ms, vs = _problem(rng, dev, ["float32"])  # 38 parameters, 4 empty
    with dev.backend.profile() as prof:
        nd.adam_update_many(params, grads, ms, vs, step=1, **HYPER)
    assert {name: t.calls for name, t in prof.totals.items()} == {"adam_update_many_f32": 3}


def test_bad_lists_raise(rng):
    dev = nd.cpu_numpy()
    params, grads, ms, vs = _problem(rng, dev, ["float32"])
    with pytest.raises(ShapeError, match="38 parameters, 37 gradients"):
        nd.adam_update_many(params, grads[1:], ms, vs, step=1, **HYPER)
    with pytest.raises(NeedleError, match="step counts from 1"):
        nd.adam_update_many(params, grads, ms, vs, step=0, **HYPER)
    wrong = list(ms)
    wrong[5] = nd.zeros(ms[5].shape, "float64", dev)
    with pytest.raises(DTypeError, match=r"parameter 5\).*m must be a compact float32"):
        nd.adam_update_many(params, grads, wrong, vs, step=1, **HYPER)
    short = list(vs)
    short[3] = nd.zeros((1,), "float32", dev)
    with pytest.raises(ShapeError, match=r"parameter 3\).*v has shape \(1,\)"):
        nd.adam_update_many(params, grads, ms, short, step=1, **HYPER)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_cuda_adam_is_the_reference_bit_for_bit(dtype, rng):
    """optim.cu rounds each product and sum on its own (no fused multiply-add), in
    numpy_ref's order, so the CUDA update (alone and many at a time) is the reference's."""
    dev = nd.cuda()
    if not dev.enabled():
        pytest.skip(f"cuda disabled: {dev.reason}")
    ref = _problem(np.random.default_rng(5), nd.cpu_numpy(), [dtype])
    got = _problem(np.random.default_rng(5), dev, [dtype])
    for step in (1, 2):
        nd.adam_update_many(*ref, step=step, decoupled=True, **HYPER)
        nd.adam_update_many(*got, step=step, decoupled=True, **HYPER)
    for column_ref, column_got in zip(ref, got):
        for a, b in zip(column_ref, column_got):
            assert np.array_equal(a.numpy(), b.numpy(), equal_nan=True)


def test_cuda_backend_refuses_mixed_lists(rng):
    """The backend function takes one dtype and equal lists (nd.adam_update_many groups and
    checks them); called directly with others it raises rather than misreading memory."""
    dev = nd.cuda()
    if not dev.enabled():
        pytest.skip(f"cuda disabled: {dev.reason}")
    params, grads, ms, vs = _problem(rng, dev, ["float32", "bfloat16"])
    handles = [[a.handle for a in column] for column in (params, grads, ms, vs)]
    hyper = (0.1, 0.9, 0.99, 1e-8, 0.0, 1, False)
    with pytest.raises(DTypeError, match="share a dtype"):
        dev.backend.adam_update_many(*handles, *hyper)
    with pytest.raises(ShapeError, match="one gradient and two moments"):
        dev.backend.adam_update_many(handles[0], handles[1][:-1], handles[2], handles[3], *hyper)
