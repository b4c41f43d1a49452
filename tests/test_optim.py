"""Optimizers against hand-computed updates and against torch.optim, clipping, schedules and
exact resumption from a saved state."""

import math

import numpy as np
import pytest
import torch

import needle as ndl
from needle import optim
from needle.errors import ModelFormatError, NeedleError

from .conftest import supports

REF = ndl.cpu_numpy()  # formula tests run on the reference; device tests take ``device``
TARGET = np.array([[0.5, -1.0, 2.0], [1.5, 0.0, -0.5]])
START = np.array([[0.1, 0.2, -0.3], [0.4, -0.5, 0.6]])


def quadratic_grad(w: np.ndarray) -> np.ndarray:
    """Gradient of sum((w - target)² * weights): a tiny problem with uneven curvature."""
    return 2 * (w - TARGET) * np.array([1.0, 3.0, 0.5])


def run_needle(make, steps, device, dtype="float64"):
    p = ndl.Tensor(START, device=device, dtype=dtype)
    opt = make([p])
    for _ in range(steps):
        p.grad = ndl.Tensor(quadratic_grad(p.numpy()), device=device, dtype=dtype,
                            requires_grad=False)
        opt.step()
    return p.numpy()


def run_torch(make, steps):
    p = torch.tensor(START, requires_grad=True)
    opt = make([p])
    for _ in range(steps):
        p.grad = torch.tensor(quadratic_grad(p.detach().numpy()))
        opt.step()
    return p.detach().numpy()


CASES = {
    "sgd": (lambda ps: optim.SGD(ps, lr=0.05),
            lambda ps: torch.optim.SGD(ps, lr=0.05)),
    "sgd_momentum_wd": (lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.1),
                        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.1)),
    "sgd_nesterov_dampening": (
        lambda ps: optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3, nesterov=False),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3)),
    "sgd_nesterov": (lambda ps: optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True)),
    "adam": (lambda ps: optim.Adam(ps, lr=0.1),
             lambda ps: torch.optim.Adam(ps, lr=0.1)),
    "adam_l2": (lambda ps: optim.Adam(ps, lr=0.1, beta1=0.8, beta2=0.95, weight_decay=0.3),
                lambda ps: torch.optim.Adam(ps, lr=0.1, betas=(0.8, 0.95), weight_decay=0.3)),
    "adamw": (lambda ps: optim.AdamW(ps, lr=0.1, weight_decay=0.3),
              lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.3)),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_torch(case, device):
    ours, theirs = CASES[case]
    exact = supports(device, "float64")  # else float32 (Metal)
    np.testing.assert_allclose(run_needle(ours, 25, device, "float64" if exact else "float32"),
                               run_torch(theirs, 25), rtol=1e-9 if exact else 1e-4,
                               atol=1e-12 if exact else 1e-5)


def test_float32_matches_torch(device):
    ours, theirs = CASES["adamw"]
    np.testing.assert_allclose(run_needle(ours, 10, device, "float32"), run_torch(theirs, 10),
                               rtol=1e-5, atol=1e-6)


def test_hand_computed_adam_step():
    p = ndl.Tensor([1.0, -2.0], device=REF, dtype="float64")
    opt = optim.Adam([p], lr=0.1, beta1=0.9, beta2=0.99, eps=0.0)
    for g in ([0.5, 1.0], [-1.0, 2.0]):
        p.grad = ndl.Tensor(g, device=REF, dtype="float64", requires_grad=False)
        opt.step()
    g1, g2 = np.array([0.5, 1.0]), np.array([-1.0, 2.0])
    w = np.array([1.0, -2.0]) - 0.1 * np.sign(g1)  # the first Adam step moves by lr
    m = 0.9 * 0.1 * g1 + 0.1 * g2
    v = 0.99 * 0.01 * g1**2 + 0.01 * g2**2
    w = w - 0.1 * (m / (1 - 0.9**2)) / np.sqrt(v / (1 - 0.99**2))
    np.testing.assert_allclose(p.numpy(), w, rtol=1e-12)


def test_hand_computed_sgd_momentum():
    p = ndl.Tensor([1.0], device=REF, dtype="float64")
    opt = optim.SGD([p], lr=0.5, momentum=0.5)
    for g in (2.0, 4.0):
        p.grad = ndl.Tensor([g], device=REF, dtype="float64", requires_grad=False)
        opt.step()
    # u1 = 2, w = 1 - 1 = 0; u2 = 0.5*2 + 4 = 5, w = 0 - 2.5
    np.testing.assert_allclose(p.numpy(), [-2.5])


def test_step_builds_no_graph_and_skips_missing_grads():
    a = ndl.Tensor([1.0, 2.0])
    b = ndl.Tensor([3.0])
    opt = optim.Adam([a, b, a], lr=0.1)  # a listed twice is updated once
    assert len(opt.params) == 2
    a.grad = ndl.Tensor([1.0, 1.0], requires_grad=False)
    opt.step()
    assert a.is_leaf() and a.requires_grad and a.inputs == []
    np.testing.assert_allclose(a.numpy(), [0.9, 1.9], rtol=1e-6)
    np.testing.assert_array_equal(b.numpy(), [3.0])
    opt.zero_grad()
    assert a.grad is None
    assert opt.reset_grad == opt.zero_grad


def test_bad_arguments():
    with pytest.raises(NeedleError, match="empty"):
        optim.SGD([], lr=0.1)
    with pytest.raises(NeedleError, match="lr must be in"):
        optim.SGD([ndl.Tensor([1.0])], lr=-1)


def test_clip_grad_norm(device):
    a = ndl.Tensor([3.0, 0.0], device=device)
    b = ndl.Tensor([[4.0]], device=device)
    c = ndl.Tensor([1.0], device=device)  # no grad: ignored
    a.grad = ndl.Tensor([3.0, 0.0], device=device, requires_grad=False)
    b.grad = ndl.Tensor([[4.0]], device=device, requires_grad=False)
    norm = optim.clip_grad_norm([a, b, c], max_norm=1.0)
    assert math.isclose(float(norm), 5.0, rel_tol=1e-6)
    np.testing.assert_allclose(a.grad.numpy(), [0.6, 0.0], rtol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), [[0.8]], rtol=1e-5)
    norm = optim.clip_grad_norm([a, b], max_norm=10.0)  # already small: unchanged
    assert math.isclose(float(norm), 1.0, rel_tol=1e-5)
    np.testing.assert_allclose(a.grad.numpy(), [0.6, 0.0], rtol=1e-5)


def test_schedules_against_torch():
    def lrs(ours_sched, theirs_sched, steps=12):
        p = ndl.Tensor([1.0])
        opt = optim.SGD([p], lr=0.1)
        sched = ours_sched(opt)
        tp = torch.nn.Parameter(torch.ones(1))
        topt = torch.optim.SGD([tp], lr=0.1)
        tsched = theirs_sched(topt)
        ours, theirs = [], []
        for _ in range(steps):
            ours.append(opt.lr)
            theirs.append(topt.param_groups[0]["lr"])
            sched.step()
            topt.step()
            tsched.step()
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-15)

    lrs(lambda o: optim.CosineDecay(o, total_steps=10, min_lr=0.01),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=0.01), 10)
    lrs(lambda o: optim.LinearWarmup(o, warmup_steps=4),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 4)))


def test_cosine_with_warmup_shape():
    opt = optim.SGD([ndl.Tensor([1.0])], lr=1.0)
    sched = optim.CosineDecay(opt, total_steps=6, warmup_steps=2)
    lrs = [opt.lr]
    for _ in range(7):
        sched.step()
        lrs.append(opt.lr)
    np.testing.assert_allclose(lrs, [0.5, 1.0, 1.0, math.cos(math.pi / 8) ** 2, 0.5,
                                     math.sin(math.pi / 8) ** 2, 0.0, 0.0], atol=1e-12)


@pytest.mark.parametrize("case", ["sgd_momentum_wd", "adam", "adamw"])
def test_state_dict_resumes_exactly(case, tmp_path):
    make = CASES[case][0]
    p = ndl.Tensor(START, device=REF, dtype="float64")
    opt = make([p])
    sched = optim.LinearWarmup(opt, 3)
    for _ in range(4):
        p.grad = ndl.Tensor(quadratic_grad(p.numpy()), device=REF, dtype="float64",
                            requires_grad=False)
        opt.step()
        sched.step()
    ndl.save({"param": p.realize_cached_data(), "opt": opt.state_dict(),
              "sched": sched.state_dict()}, tmp_path / "ckpt.safetensors")
    ckpt = ndl.load(tmp_path / "ckpt.safetensors", device=REF)
    q = ndl.Tensor(ckpt["param"])
    opt2 = make([q])
    sched2 = optim.LinearWarmup(opt2, 3)
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    assert opt2.step_count == 4 and opt2.lr == opt.lr
    for _ in range(4):
        q.grad = ndl.Tensor(quadratic_grad(q.numpy()), device=REF, dtype="float64",
                            requires_grad=False)
        opt2.step()
        sched2.step()
        p.grad = ndl.Tensor(quadratic_grad(p.numpy()), device=REF, dtype="float64",
                            requires_grad=False)
        opt.step()
        sched.step()
    np.testing.assert_array_equal(q.numpy(), p.numpy())


def test_load_state_dict_errors():
    p = ndl.Tensor([1.0, 2.0])
    opt = optim.Adam([p])
    p.grad = ndl.Tensor([1.0, 1.0], requires_grad=False)
    opt.step()
    state = opt.state_dict()
    with pytest.raises(ModelFormatError, match="SGD"):
        optim.SGD([p]).load_state_dict(state)
    with pytest.raises(ModelFormatError, match="shape"):
        optim.Adam([ndl.Tensor([1.0])]).load_state_dict(state)
    with pytest.raises(ModelFormatError, match="parameter 5"):
        optim.Adam([p]).load_state_dict({**state, "state": {"5": state["state"]["0"]}})


def test_updates_in_place_and_leave_gradients_alone(device):
    p = ndl.Tensor(START, device=device)
    view = ndl.Tensor(START.T, device=device)
    view.data = view.realize_cached_data().transpose()  # a non-compact parameter
    twin = ndl.Tensor(p.realize_cached_data())  # shares p's array
    grad = ndl.Tensor(np.ones_like(START), device=device, requires_grad=False)
    for t in (p, view, twin):
        t.grad = grad  # autograd can hand one array to several leaves
    opt = optim.Adam([p, view, twin], lr=0.1)
    opt.step()
    for t in (p, view, twin):  # each updated once, from the shared starting values
        np.testing.assert_allclose(t.numpy(), START - 0.1, rtol=1e-6, atol=1e-6)
        assert t.realize_cached_data().is_compact()
    handle = p.realize_cached_data().handle
    opt.step()
    assert p.realize_cached_data().handle is handle  # now written into its own buffer
    np.testing.assert_allclose(p.numpy(), START - 0.2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(twin.numpy(), START - 0.2, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(grad.numpy(), np.ones_like(START))


def test_ndarray_in_place_operators(device):
    """The NDArray operators optimizers rely on update in place, as numpy and PyTorch do: a
    result that would change the shape or the dtype is an error (never a silent new array),
    and a view's update reaches the array it views."""
    a = ndl.backend_ndarray.array(np.arange(6.0).reshape(2, 3), device=device)
    handle = a.handle
    a += 1
    a *= ndl.backend_ndarray.array(np.array([1.0, 2.0, 3.0]), device=device)
    a -= 0.5
    a /= 2
    assert a.handle is handle
    expected = ((np.arange(6.0).reshape(2, 3) + 1) * [1, 2, 3] - 0.5) / 2
    np.testing.assert_allclose(a.numpy(), expected, rtol=1e-6)
    ints = ndl.backend_ndarray.array(np.arange(3), device=device)
    with pytest.raises(ndl.DTypeError, match="in-place div of a int64 array would give float32"):
        ints /= 2
    with pytest.raises(ndl.ShapeError, match="cannot change the array's shape"):
        ints += ndl.backend_ndarray.array(np.ones((2, 3), np.int64), device=device)
    np.testing.assert_array_equal(ints.numpy(), [0, 1, 2])
    column = a[:, 1]
    column += 1  # a view is written through
    np.testing.assert_allclose(a.numpy()[:, 1], expected[:, 1] + 1, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_parameters_keep_float32_state(device, dtype):
    """Squares of small gradients and eps underflow in float16; the moments and the update
    are computed in float32 and only the weights stay in the parameter's dtype."""
    rng = np.random.default_rng(0)
    w = ndl.Tensor(rng.standard_normal(8), device=device, dtype=dtype)
    opt = optim.Adam([w], lr=0.01)
    for _ in range(3):
        w.grad = ndl.Tensor(rng.standard_normal(8) * 1e-5, device=device, dtype=dtype,
                            requires_grad=False)
        opt.step()
    assert w.dtype == dtype and np.isfinite(w.numpy().astype(np.float32)).all()
    assert {b.dtype for b in opt.state[0].values()} == {"float32"}
    reloaded = optim.Adam([w], lr=0.01)
    reloaded.load_state_dict(opt.state_dict())
    assert reloaded.state[0]["v"].dtype == "float32"
