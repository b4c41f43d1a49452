"""The fused attention backward (capability ``attention_backward``: numpy_ref/nn.py, CUDA's
kernels/attention_simt_bwd.cu for float32 with head_dim 64 and attention_tc_bwd.cu for
float16/bfloat16 with head_dim 64 or 128) against float64 gradients, on
heads-first arrays and on heads-first views of token-major rows, with grouped heads, causal
and not, keys before the queries, rows ending mid-tile and several key blocks; that the CUDA
kernels are the ones that ran and that the result does not depend on the run; that the
Tensor gradient takes it and still composes where it does not apply or a graph is built; and
the forward that keeps each row's softmax statistics for it (``attention_with_stats``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import needle as ndl
import needle.backend_ndarray as nd
from needle.backends.api import has
from needle.backprop import grad
from needle.errors import DTypeError, ShapeError
from needle.ops import ops_nn

CUDA = nd.cuda(0)
DEVICES = [pytest.param(nd.cpu_numpy(), id="numpy_ref"),
           pytest.param(CUDA, id="cuda", marks=pytest.mark.skipif(
               not CUDA.enabled(), reason=f"cuda disabled: {CUDA.reason}"))]

CASES = [  # batch, q_heads, kv_heads, q_len, kv_len, causal
    (2, 8, 8, 256, 256, True),   # the GPT benchmark's layer, smaller batch
    (1, 4, 2, 100, 100, True),   # grouped heads, rows ending mid-tile
    (2, 2, 1, 70, 200, True),    # keys before the queries
    (1, 3, 3, 65, 130, False),
    (1, 8, 1, 40, 40, True),     # 320 rows of one KV head: tiles cross heads
    (1, 2, 2, 3, 50, False),     # fewer rows than a tile, one key block
]


def _ids(c):
    return f"b{c[0]}h{c[1]}/{c[2]}q{c[3]}kv{c[4]}{'c' if c[5] else ''}"


def _reference(q, k, v, dout, causal):
    """float64 (dq, dk, dv) and the output, composed step by step."""
    group = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = 1 / math.sqrt(q.shape[-1])
    s = q @ kr.swapaxes(-1, -2) * scale
    if causal:
        q_len, kv_len = q.shape[2], k.shape[2]
        allowed = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + (kv_len - q_len)
        s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ vr
    dp = dout @ vr.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    b, hkv, kv_len, d = k.shape
    dq = ds @ kr * scale
    dk = (ds.swapaxes(-1, -2) @ q * scale).reshape(b, hkv, group, kv_len, d).sum(2)
    dv = (p.swapaxes(-1, -2) @ dout).reshape(b, hkv, group, kv_len, d).sum(2)
    return out, (dq, dk, dv)


def _inputs(case, seed):
    b, hq, hkv, q_len, kv_len, causal = case
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, q_len, 64))
    k = rng.standard_normal((b, hkv, kv_len, 64))
    v = rng.standard_normal((b, hkv, kv_len, 64))
    dout = rng.standard_normal((b, hq, q_len, 64))
    out, want = _reference(q, k, v, dout, causal)
    return [x.astype(np.float32) for x in (q, k, v, out, dout)], want


def _check(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-4, atol=1e-4 * np.abs(w).max())


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_heads_first_matches_float64(dev, case):
    arrays, want = _inputs(case, 0)
    args = [nd.array(x, device=dev) for x in arrays]
    got = nd.attention_backward(*args, causal=case[5])
    assert got is not None
    _check(got, want)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[4]], ids=_ids)
def test_token_major_views_match_float64(dev, case):
    """q, k, v as heads-first views of one fused QKV projection's rows, out and dout of
    token-major arrays: nothing is copied heads-first, and the gradients come back as
    heads-first views of token-major arrays."""
    b, hq, hkv, q_len, kv_len, causal = case  # q_len == kv_len: one projection's rows
    (q, k, v, out, dout), want = _inputs(case, 1)
    rows = np.concatenate([x.transpose(0, 2, 1, 3) for x in (q, k, v)], axis=2)
    qkv = nd.array(rows, device=dev)
    qv = qkv[:, :, :hq].permute((0, 2, 1, 3))
    kv = qkv[:, :, hq:hq + hkv].permute((0, 2, 1, 3))
    vv = qkv[:, :, hq + hkv:].permute((0, 2, 1, 3))
    ov, dov = (nd.array(x.transpose(0, 2, 1, 3), device=dev).permute((0, 2, 1, 3))
               for x in (out, dout))
    if dev is CUDA:
        with dev.backend.profile() as prof:
            got = nd.attention_backward(qv, kv, vv, ov, dov, causal=causal)
        assert "attention_simt64_bwd_f32" in prof.totals
        assert "compact_f32" not in prof.totals
    else:
        got = nd.attention_backward(qv, kv, vv, ov, dov, causal=causal)
    assert all(g.permute((0, 2, 1, 3)).is_compact() for g in got)
    _check(got, want)


@pytest.mark.skipif(not CUDA.enabled(), reason=f"cuda disabled: {CUDA.reason}")
def test_cuda_kernels_ran_and_the_result_is_the_same_every_run():
    """Several key blocks: dQ's shares are summed in block order, so two runs agree bitwise."""
    arrays, _ = _inputs(CASES[0], 2)
    args = [nd.array(x, device=CUDA) for x in arrays]
    with CUDA.backend.profile() as prof:
        first = [g.numpy() for g in nd.attention_backward(*args, causal=True)]
    assert {"attention_simt64_stats_f32", "attention_simt64_bwd_f32"} <= set(prof.totals)
    for _ in range(3):
        again = [g.numpy() for g in nd.attention_backward(*args, causal=True)]
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not CUDA.enabled(), reason=f"cuda disabled: {CUDA.reason}")
def test_cuda_declines_what_its_kernels_do_not_cover():
    """head_dim 32 (float32 and float16), head_dim 96 in bfloat16, float32 with head_dim 128
    and the switched-off tuning (NEEDLE_ATTENTION_BACKWARD=0): None, nothing launched (the
    caller composes)."""
    rng = np.random.default_rng(3)
    for d, dtype in ((32, "float32"), (32, "float16"), (96, "bfloat16"), (128, "float32")):
        arrays = [nd.array(rng.standard_normal((1, 2, 64, d)).astype(np.float32),
                           device=CUDA).astype(dtype) for _ in range(5)]
        with CUDA.backend.profile() as prof:
            assert nd.attention_backward(*arrays, causal=True) is None
        assert not prof.totals
    arrays, _ = _inputs(CASES[1], 4)
    with CUDA.backend.tuned(attention_backward=False):
        assert nd.attention_backward(*[nd.array(x, device=CUDA) for x in arrays]) is None


def test_bad_shapes_are_clear_errors():
    dev = nd.cpu_numpy()
    a = nd.array(np.zeros((1, 4, 8, 64), np.float32), device=dev)
    k = nd.array(np.zeros((1, 3, 8, 64), np.float32), device=dev)
    with pytest.raises(ShapeError, match="multiple of the KV heads"):
        nd.attention_backward(a, k, k, a, a)
    with pytest.raises(ShapeError, match="4-d"):
        nd.attention_backward(a, a, a, a, a.reshape((4, 8, 64)))
    with pytest.raises(DTypeError, match="one floating dtype"):
        nd.attention_backward(a, a, a, a, a.astype("float64"))


def _tensor_grads(dev, case, seed, create_graph=False, fused=True):
    b, hq, hkv, q_len, kv_len, causal = case
    rng = np.random.default_rng(seed)
    q, k, v = (ndl.Tensor(rng.standard_normal(s).astype(np.float32), device=dev)
               for s in ((b, hq, q_len, 64), (b, hkv, kv_len, 64), (b, hkv, kv_len, 64)))
    w = ndl.Tensor(rng.standard_normal((b, hq, q_len, 64)).astype(np.float32), device=dev,
                   requires_grad=False)
    out = ops_nn.scaled_dot_product_attention(q, k, v, causal=causal)
    calls = []
    real = nd.attention_backward

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs) if fused else None

    ops_nn.nd.attention_backward = spy
    try:
        grads = grad((out * w).sum(), [q, k, v], create_graph=create_graph)
    finally:
        ops_nn.nd.attention_backward = real
    return [g.numpy() for g in grads], calls


@pytest.mark.parametrize("dev", DEVICES)
def test_tensor_gradient_takes_the_fused_backward(dev):
    """The fused gradients equal the composed ones (which the backend's absence gives)."""
    case = CASES[1]
    fused, calls = _tensor_grads(dev, case, 5)
    assert calls and has(dev.backend, "attention_backward")
    composed, _ = _tensor_grads(dev, case, 5, fused=False)
    for a, b in zip(fused, composed):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())


def test_create_graph_composes_a_differentiable_gradient():
    """With create_graph the gradient is itself a graph: the fused path (constants) is not
    asked, and the composed gradients are those of the fused path."""
    dev = nd.cpu_numpy()
    graph, calls = _tensor_grads(dev, CASES[5], 6, create_graph=True)
    assert not calls
    plain, calls = _tensor_grads(dev, CASES[5], 6)
    assert calls
    for a, b in zip(graph, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _stats_reference(q, k, causal):
    group = q.shape[1] // k.shape[1]
    s = q @ np.repeat(k, group, axis=1).swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        q_len, kv_len = q.shape[2], k.shape[2]
        allowed = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + (kv_len - q_len)
        s = np.where(allowed, s, -np.inf)
    m = s.max(-1)
    return np.concatenate([m.reshape(-1), (1 / np.exp(s - m[..., None]).sum(-1)).reshape(-1)])


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[5]], ids=_ids)
def test_forward_keeps_the_softmax_statistics(dev, case):
    """attention_with_stats: the output of attention and each row's max and 1 / sum, which
    the backward then reads (and gives the same gradients as recomputing them)."""
    (q, k, v, out, dout), want = _inputs(case, 7)
    args = [nd.array(x, device=dev) for x in (q, k, v)]
    got, stats = nd.attention_with_stats(*args, causal=case[5])
    assert stats is not None
    np.testing.assert_allclose(got.numpy(), out, rtol=2e-5, atol=2e-5)
    ref = _stats_reference(*(x.astype(np.float64) for x in (q, k)), case[5])
    np.testing.assert_allclose(stats.numpy(), ref, rtol=2e-5, atol=1e-6)
    d = nd.array(dout, device=dev)
    with_stats = nd.attention_backward(*args, got, d, causal=case[5], stats=stats)
    _check(with_stats, want)
    plain = nd.attention_backward(*args, got, d, causal=case[5])
    for a, b in zip(with_stats, plain):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not CUDA.enabled(), reason=f"cuda disabled: {CUDA.reason}")
def test_cuda_training_step_reuses_the_forward_statistics():
    """A forward whose inputs need gradients runs the statistics-keeping kernel, and the
    backward then skips its statistics pass."""
    b, hq, hkv, q_len, kv_len, causal = CASES[1]
    rng = np.random.default_rng(8)
    q, k, v = (ndl.Tensor(rng.standard_normal(s).astype(np.float32), device=CUDA)
               for s in ((b, hq, q_len, 64), (b, hkv, kv_len, 64), (b, hkv, kv_len, 64)))
    with CUDA.backend.profile() as prof:
        out = ops_nn.scaled_dot_product_attention(q, k, v, causal=causal)
        out.sum().backward()
        q.grad.numpy()
    assert {"attention_simt64_train_f32", "attention_simt64_bwd_f32"} <= set(prof.totals)
    assert "attention_simt64_stats_f32" not in prof.totals
    with ndl.no_grad():
        with CUDA.backend.profile() as prof:
            ops_nn.scaled_dot_product_attention(q, k, v, causal=causal).numpy()
    assert "attention_simt64_train_f32" not in prof.totals


@pytest.mark.parametrize("dev", DEVICES)
def test_forward_with_statistics_reads_token_major_projections(dev):
    """q, k and v as heads-first views of token-major projections (separate arrays, as a
    model's q, k and v Linear layers give them): read where they are, nothing copied."""
    case = CASES[1]
    b, hq, hkv, q_len, kv_len, causal = case
    (q, k, v, out, _), _ = _inputs(case, 9)
    views = [nd.array(x.transpose(0, 2, 1, 3), device=dev).permute((0, 2, 1, 3))
             for x in (q, k, v)]
    if dev is CUDA:
        with dev.backend.profile() as prof:  # (reading got copies it heads-first: later)
            got, stats = nd.attention_with_stats(*views, causal=causal)
        assert "attention_simt64_train_f32" in prof.totals
        assert "compact_f32" not in prof.totals
    else:
        got, stats = nd.attention_with_stats(*views, causal=causal)
    np.testing.assert_allclose(got.numpy(), out, rtol=2e-5, atol=2e-5)
    ref = _stats_reference(*(x.astype(np.float64) for x in (q, k)), causal)
    np.testing.assert_allclose(stats.numpy(), ref, rtol=2e-5, atol=1e-6)


# ---- float16 and bfloat16 (CUDA: attention_tc_bwd.cu on tensor cores) -----------------------

HALF_CASES = [  # batch, q_heads, kv_heads, q_len, kv_len, causal
    (2, 4, 4, 256, 256, True),   # several key blocks and query tiles
    (1, 4, 2, 100, 100, True),   # grouped heads, rows ending mid-tile
    (2, 2, 1, 70, 200, True),    # keys before the queries
    (1, 3, 3, 65, 130, False),
    (1, 8, 1, 40, 40, True),     # 320 rows of one KV head: tiles cross heads
]
# the largest error allowed, relative to the gradient's largest value: the kernels round P
# and dS to the dtype before their products, as FlashAttention does (float16 keeps 3 more
# bits than bfloat16)
HALF_TOLERANCE = {"float16": 4e-3, "bfloat16": 2.5e-2}


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to dtype, back in float64 (the values the kernels see)."""
    return nd.array(x.astype(np.float32), device=nd.cpu_numpy()).astype(dtype).numpy() \
        .astype(np.float64)


def _half_inputs(case, d, dtype, seed):
    b, hq, hkv, q_len, kv_len, causal = case
    rng = np.random.default_rng(seed)
    q, k, v, dout = (_rounded(rng.standard_normal(s), dtype)
                     for s in ((b, hq, q_len, d), (b, hkv, kv_len, d), (b, hkv, kv_len, d),
                               (b, hq, q_len, d)))
    out, want = _reference(q, k, v, dout, causal)
    return [q, k, v, _rounded(out, dtype), dout], want


def _check_half(got, want, dtype):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == dtype
        err = np.abs(g.numpy().astype(np.float64) - w).max() / np.abs(w).max()
        assert err < HALF_TOLERANCE[dtype], f"error {err:.2e} of the largest value"


def _on(dev, arrays, dtype):
    return [nd.array(x.astype(np.float32), device=dev).astype(dtype) for x in arrays]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", HALF_CASES, ids=_ids)
def test_half_precision_matches_float64(dev, dtype, d, case):
    """Gradients in the inputs' dtype, with the statistics recomputed (no forward kept
    them) and with the ones ``attention_with_stats`` kept, whose output and statistics
    are checked too."""
    arrays, want = _half_inputs(case, d, dtype, 10)
    q, k, v, out, dout = _on(dev, arrays, dtype)
    _check_half(nd.attention_backward(q, k, v, out, dout, causal=case[5]), want, dtype)
    got, stats = nd.attention_with_stats(q, k, v, causal=case[5])
    assert stats is not None and got.dtype == dtype
    err = np.abs(got.numpy().astype(np.float64) - arrays[3]).max() / np.abs(arrays[3]).max()
    assert err < HALF_TOLERANCE[dtype]
    ref = _stats_reference(q.numpy().astype(np.float64), k.numpy().astype(np.float64),
                           case[5])
    np.testing.assert_allclose(stats.numpy(), ref, rtol=1e-3, atol=1e-3)
    _check_half(nd.attention_backward(q, k, v, got, dout, causal=case[5], stats=stats), want,
                dtype)


@pytest.mark.skipif(not CUDA.enabled(), reason=f"cuda disabled: {CUDA.reason}")
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_half_reads_token_major_views_on_tensor_cores(d):
    """q, k, v as heads-first views of one fused QKV projection's rows, out and dout
    token-major: the tensor-core kernels run, nothing is copied heads-first, and the result
    does not depend on the run."""
    case, dtype = HALF_CASES[1], "bfloat16"
    b, hq, hkv, q_len, kv_len, causal = case
    (q, k, v, out, dout), want = _half_inputs(case, d, dtype, 11)
    rows = np.concatenate([x.transpose(0, 2, 1, 3) for x in (q, k, v)], axis=2)
    qkv = _on(CUDA, [rows], dtype)[0]
    qv = qkv[:, :, :hq].permute((0, 2, 1, 3))
    kv = qkv[:, :, hq:hq + hkv].permute((0, 2, 1, 3))
    vv = qkv[:, :, hq + hkv:].permute((0, 2, 1, 3))
    ov, dov = (x.permute((0, 2, 1, 3)) for x in _on(CUDA, [out.transpose(0, 2, 1, 3),
                                                          dout.transpose(0, 2, 1, 3)], dtype))
    with CUDA.backend.profile() as prof:
        got = nd.attention_backward(qv, kv, vv, ov, dov, causal=causal)
    assert {f"attention_tc{d}_bwd_dqs_bf16", f"attention_tc{d}_bwd_dkv_bf16"} <= set(prof.totals)
    assert not any(name.startswith("compact") for name in prof.totals)
    _check_half(got, want, dtype)
    again = nd.attention_backward(qv, kv, vv, ov, dov, causal=causal)
    for a, b_ in zip(got, again):
        np.testing.assert_array_equal(a.numpy(), b_.numpy())


@pytest.mark.skipif(not CUDA.enabled(), reason=f"cuda disabled: {CUDA.reason}")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", [HALF_CASES[1], HALF_CASES[4]], ids=_ids)
def test_cuda_half_dk_dv_walk_whole_or_in_parts(d, case):
    """Few key blocks: the dK/dV walk over the grouped query heads is split into parts whose
    float32 sums are added after (attention_tc*_sum_parts); unsplit (tuning
    ``attention_backward_parts`` off) it is one walk. Both match float64."""
    dtype = "float16"
    arrays, want = _half_inputs(case, d, dtype, 13)
    args = _on(CUDA, arrays, dtype)
    with CUDA.backend.profile() as prof:
        split = nd.attention_backward(*args, causal=case[5])
    assert f"attention_tc{d}_sum_parts_f16" in prof.totals
    with CUDA.backend.tuned(attention_backward_parts=False):
        with CUDA.backend.profile() as prof:
            whole = nd.attention_backward(*args, causal=case[5])
    assert f"attention_tc{d}_sum_parts_f16" not in prof.totals
    _check_half(split, want, dtype)
    _check_half(whole, want, dtype)


@pytest.mark.skipif(not CUDA.enabled(), reason=f"cuda disabled: {CUDA.reason}")
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_autocast_step_runs_attention_on_tensor_cores_both_ways(d):
    """A bfloat16-autocast forward and backward: the statistics-keeping tensor-core forward,
    then the dQ and dK/dV kernels reading them (not the float32 kernels, not the
    recomputing dQ); the gradients agree with float32's."""
    b, hq, hkv, q_len, kv_len, causal = HALF_CASES[1]
    rng = np.random.default_rng(12)
    shapes = ((b, hq, q_len, d), (b, hkv, kv_len, d), (b, hkv, kv_len, d))
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    w = rng.standard_normal((b, hq, q_len, d)).astype(np.float32)

    def grads(autocast):
        q, k, v = (ndl.Tensor(x, device=CUDA) for x in values)
        weight = ndl.Tensor(w, device=CUDA, requires_grad=False)
        with CUDA.backend.profile() as prof:
            if autocast:
                with ndl.autocast("bfloat16"):
                    out = ops_nn.scaled_dot_product_attention(q, k, v, causal=causal)
            else:
                out = ops_nn.scaled_dot_product_attention(q, k, v, causal=causal)
            (out.astype("float32") * weight).sum().backward()
            result = [t.grad.numpy() for t in (q, k, v)]
        return result, set(prof.totals)

    half, kernels = grads(True)
    assert {f"attention_tc{d}_train_bf16", f"attention_tc{d}_bwd_dq_bf16",
            f"attention_tc{d}_bwd_dkv_bf16"} <= kernels
    assert not any(n.startswith(("attention_simt", f"attention_tc{d}_bwd_dqs"))
                   for n in kernels)
    full, _ = grads(False)
    for a, b_ in zip(half, full):
        assert np.abs(a - b_).max() < 2.5e-2 * np.abs(b_).max()
