"""Conformance of the fused optimizer updates ``adam_update`` and ``sgd_update``.

Each device runs a few steps from the same parameters and gradients as the reference
(``cpu_numpy``), and the weights and state buffers must agree after every step. The
reference itself is checked against the unfused formulas of needle.optim, written out here
in numpy: bit for bit in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.errors import DTypeError, NeedleError, ShapeError

from ..conftest import assert_close, check_unsupported_dtype
from .compare import FLOATS, np_dtype, on

SIZES = ((0,), (1,), (7,), (33, 3))
BIG = (1_000_003,)

ADAM = {
    "plain": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False),
    "l2": dict(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.3, decoupled=False),
    "adamw": dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True),
}
SGD = {
    "plain": dict(lr=0.1),
    "momentum_wd": dict(lr=0.05, momentum=0.9, weight_decay=0.1),
    "dampening": dict(lr=0.05, momentum=0.8, dampening=0.3),
    "nesterov": dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01),
}


def _inputs(rng, shape, dtype, steps):
    """Parameters and one gradient per step, of magnitudes from 1e-6 to 10, in ``dtype``."""
    w = rng.uniform(-2, 2, shape).astype(np_dtype(dtype))
    scales = 10.0 ** rng.integers(-6, 2, size=shape)
    grads = [(rng.uniform(-1, 1, shape) * scales).astype(np_dtype(dtype)) for _ in range(steps)]
    return w, grads


def _run_adam(device, w, grads, cfg):
    """(param, m, v) after each step, as numpy arrays."""
    p = on(device, w)
    state = nd.state_dtype(p.dtype)
    m, v = nd.zeros(w.shape, state, device), nd.zeros(w.shape, state, device)
    out = []
    for step, g in enumerate(grads, start=1):
        nd.adam_update(p, on(device, g), m, v, step=step, **cfg)
        out.append((p.numpy(), m.numpy(), v.numpy()))
    return out


def _run_sgd(device, w, grads, cfg):
    """(param, momentum buffer or None) after each step."""
    p = on(device, w)
    buf = nd.empty(w.shape, nd.state_dtype(p.dtype), device) if cfg.get("momentum") else None
    out = []
    for step, g in enumerate(grads):
        nd.sgd_update(p, on(device, g), buf, first=step == 0, **cfg)
        out.append((p.numpy(), None if buf is None else buf.numpy()))
    return out


def _compare(got, ref, dtype):
    for step, (g_step, r_step) in enumerate(zip(got, ref)):
        for name, g, r in zip(("param", "state 1", "state 2"), g_step, r_step):
            if r is None:
                assert g is None
                continue
            try:
                assert_close(g, r, dtype if name == "param" else nd.state_dtype(dtype))
            except AssertionError as e:
                raise AssertionError(f"{name} after step {step + 1}: {e}") from None


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SIZES)
@pytest.mark.parametrize("config", ADAM)
def test_adam_update_matches_reference(device, dtype, shape, config, rng):
    if check_unsupported_dtype(device, dtype):
        return
    w, grads = _inputs(rng, shape, dtype, 3)
    _compare(_run_adam(device, w, grads, ADAM[config]),
             _run_adam(nd.cpu_numpy(), w, grads, ADAM[config]), dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SIZES)
@pytest.mark.parametrize("config", SGD)
def test_sgd_update_matches_reference(device, dtype, shape, config, rng):
    if check_unsupported_dtype(device, dtype):
        return
    w, grads = _inputs(rng, shape, dtype, 3)
    _compare(_run_sgd(device, w, grads, SGD[config]),
             _run_sgd(nd.cpu_numpy(), w, grads, SGD[config]), dtype)


def test_big_updates_match_reference(device, rng):
    """A size that spreads over threads and groups, with a remainder."""
    w, grads = _inputs(rng, BIG, "float32", 2)
    _compare(_run_adam(device, w, grads, ADAM["adamw"]),
             _run_adam(nd.cpu_numpy(), w, grads, ADAM["adamw"]), "float32")
    _compare(_run_sgd(device, w, grads, SGD["nesterov"]),
             _run_sgd(nd.cpu_numpy(), w, grads, SGD["nesterov"]), "float32")


def test_special_values_propagate(device):
    w = np.array([1.0, -1.0, 0.5, 2.0, 0.0], np.float32)
    g = np.array([np.inf, np.nan, 0.0, -0.0, 1e-30], np.float32)
    _compare(_run_adam(device, w, [g, g], ADAM["l2"]),
             _run_adam(nd.cpu_numpy(), w, [g, g], ADAM["l2"]), "float32")
    _compare(_run_sgd(device, w, [g, g], SGD["momentum_wd"]),
             _run_sgd(nd.cpu_numpy(), w, [g, g], SGD["momentum_wd"]), "float32")


def test_gradient_of_another_dtype_is_cast_to_the_parameters(device):
    p = nd.array(np.ones(4), device=device, dtype="float32")
    g = nd.array(np.arange(4), device=device, dtype="int32")
    nd.sgd_update(p, g, None, lr=0.5)
    np.testing.assert_allclose(p.numpy(), 1 - 0.5 * np.arange(4))


# --- the reference against the unfused formulas ----------------------------------------------

def _unfused_adam(w, grads, lr, beta1, beta2, eps, weight_decay, decoupled):
    """needle.optim.Adam/AdamW's step as separate whole-array operations, in order."""
    m = v = None
    for step, g in enumerate(grads, start=1):
        if decoupled:
            w = w * (1 - lr * weight_decay)
        elif weight_decay:
            g = g + w * weight_decay
        g2 = g * g * (1 - beta2)
        m = g * (1 - beta1) if m is None else m * beta1 + g * (1 - beta1)
        v = g2 if v is None else v * beta2 + g2
        root_bc2 = math.sqrt(1 - beta2 ** step)
        w = w - m / (np.sqrt(v) + eps * root_bc2) * (lr * root_bc2 / (1 - beta1 ** step))
    return w, m, v


def _unfused_sgd(w, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    u = None
    for g in grads:
        if weight_decay:
            g = g + w * weight_decay
        if momentum:
            u = g.copy() if u is None else u * momentum + (g * (1 - dampening) if dampening
                                                           else g)
            g = g + u * momentum if nesterov else u
        w = w - g * lr
    return w, u


@pytest.mark.parametrize("config", ADAM)
def test_reference_adam_is_the_unfused_formula_bit_for_bit(config, rng):
    w, grads = _inputs(rng, (50,), "float64", 4)
    got = _run_adam(nd.cpu_numpy(), w, grads, ADAM[config])[-1]
    for g, want in zip(got, _unfused_adam(w, grads, **ADAM[config])):
        np.testing.assert_array_equal(g, want)


@pytest.mark.parametrize("config", SGD)
def test_reference_sgd_is_the_unfused_formula_bit_for_bit(config, rng):
    w, grads = _inputs(rng, (50,), "float64", 4)
    p, u = _run_sgd(nd.cpu_numpy(), w, grads, SGD[config])[-1]
    want_p, want_u = _unfused_sgd(w, grads, **SGD[config])
    np.testing.assert_array_equal(p, want_p)
    if want_u is not None:
        np.testing.assert_array_equal(u, want_u)


# --- bad input ---------------------------------------------------------------------------------

def test_bad_operands_raise(device):
    def arr(shape=(4,), dtype="float32"):
        return nd.zeros(shape, dtype, device)

    p, g = arr(), arr()
    hyper = dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(ShapeError, match="compact"):
        nd.adam_update(arr((4, 2)).transpose(), arr((2, 4)), arr((2, 4)), arr((2, 4)), **hyper)
    with pytest.raises(ShapeError, match="grad has shape"):
        nd.adam_update(p, arr((5,)), arr(), arr(), **hyper)
    with pytest.raises(DTypeError, match="m must be a compact float32"):
        nd.adam_update(p, g, arr(dtype="int32"), arr(), **hyper)
    with pytest.raises(DTypeError, match="floating-point"):
        nd.adam_update(arr(dtype="int32"), g, arr(), arr(), **hyper)
    with pytest.raises(NeedleError, match="step counts from 1"):
        nd.adam_update(p, g, arr(), arr(), **{**hyper, "step": 0})
    with pytest.raises(NeedleError, match="momentum buffer"):
        nd.sgd_update(p, g, None, lr=0.1, momentum=0.9)
    with pytest.raises(NeedleError, match="momentum buffer"):
        nd.sgd_update(p, g, arr(), lr=0.1)
    with pytest.raises(ShapeError, match="momentum_buf has shape"):
        nd.sgd_update(p, g, arr((3,)), lr=0.1, momentum=0.9)


def test_native_backend_checks_its_buffers():
    """The C++ functions validate what they are given (no crash on a direct call)."""
    cpu = nd.cpu()
    if not cpu.enabled():
        pytest.skip(f"cpu disabled: {cpu.reason}")
    be = cpu.backend
    a, short, ints = be.Array(4, "float32"), be.Array(3, "float32"), be.Array(4, "int32")
    with pytest.raises(ShapeError):
        be.adam_update(a, a, short, a, 0.1, 0.9, 0.99, 1e-8, 0.0, 1, False)
    with pytest.raises(DTypeError):
        be.adam_update(ints, ints, a, a, 0.1, 0.9, 0.99, 1e-8, 0.0, 1, False)
    with pytest.raises(DTypeError):
        be.sgd_update(a, ints, None, 0.1, 0.0, 0.0, 0.0, False, False)
    with pytest.raises(NeedleError, match="momentum buffer"):
        be.sgd_update(a, a, None, 0.1, 0.9, 0.0, 0.0, False, False)
