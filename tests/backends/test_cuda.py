"""The CUDA backend's own paths (the conformance suite in tests/backend_ndarray covers the
array API on cuda like on every device): split reductions, the matmul kernels (the TMA GEMM's
tests are in test_cuda_tma.py), attention, misaligned buffers, graphs, profiling, tracing,
memory, DLPack, the native launch.

Without a GPU only the first test runs: cuda() must say why it is disabled.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backends import cuda as cuda_backend
from needle.backends import numpy_ref
from needle.errors import DeviceError, OutOfMemoryError

DEV = nd.cuda(0)
gpu = pytest.mark.skipif(not DEV.enabled(), reason=f"cuda disabled: {DEV.reason}")
RNG = np.random.default_rng(7)


def test_disabled_cuda_says_why():
    if DEV.enabled():
        assert cuda_backend.device_count() >= 1
        assert not nd.cuda(cuda_backend.device_count()).enabled()
        assert "does not exist" in nd.cuda(cuda_backend.device_count()).reason
    else:
        assert cuda_backend.device_count() == 0
        reason = DEV.reason.lower()
        assert any(w in reason for w in ("driver", "cuda-bindings", "nvrtc", "device")), reason
        with pytest.raises(DeviceError, match="not available"):
            nd.array([1.0], device=DEV)


def on(x, dtype=None):
    return nd.array(x, device=DEV, dtype=dtype)


def relerr(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


# --- reductions: long rows and columns split across groups -----------------------------------
@gpu
@pytest.mark.parametrize("shape,axis", [((1, 3_000_017), 1), ((3, 1 << 20), 1),
                                        ((5000, 7), 0), ((4099, 300), 0), ((2, 777, 33), 1)])
def test_split_reductions(shape, axis):
    x = RNG.standard_normal(shape).astype(np.float32)
    a = on(x)
    assert relerr(a.sum(axis=axis).numpy(), x.astype(np.float64).sum(axis=axis)) < 1e-5
    np.testing.assert_array_equal(a.max(axis=axis).numpy(), x.max(axis=axis))
    np.testing.assert_array_equal(a.min(axis=axis).numpy(), x.min(axis=axis))
    np.testing.assert_array_equal(a.argmax(axis=axis).numpy(), x.argmax(axis=axis))


@gpu
def test_argmax_ties_and_nan_across_splits():
    x = np.zeros(2_000_003, np.float32)
    x[[5, 1_500_000]] = 3.0  # two equal maxima in different splits: the first wins
    assert on(x).argmax().item() == 5
    x[1_999_999] = np.nan  # NaN counts as the maximum
    assert on(x).argmax().item() == 1_999_999
    b = RNG.random(1_000_001) < 0.5
    assert on(b).sum().item() == int(b.sum())


# --- matmul ---------------------------------------------------------------------------------
def _mm_case(m, n, p, dtype, ta, tb, batch=1):
    npdt = nd.dtypes.to_numpy_dtype(dtype)
    a = RNG.standard_normal((batch, n, m) if ta else (batch, m, n)).astype(npdt)
    b = RNG.standard_normal((batch, p, n) if tb else (batch, n, p)).astype(npdt)
    A, B = on(a, dtype), on(b, dtype)
    A = A.permute((0, 2, 1)) if ta else A
    B = B.permute((0, 2, 1)) if tb else B
    a64 = a.astype(np.float64).transpose(0, 2, 1) if ta else a.astype(np.float64)
    b64 = b.astype(np.float64).transpose(0, 2, 1) if tb else b.astype(np.float64)
    return (A @ B).numpy(), a64 @ b64


@gpu
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("m,n,p", [(130, 67, 129), (256, 256, 256), (1, 300, 5), (257, 64, 8)])
def test_matmul_f32_all_layouts(m, n, p, ta, tb):
    got, want = _mm_case(m, n, p, "float32", ta, tb)
    assert relerr(got, want) < 1e-5


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("m,n,p", [(200, 136, 264), (128, 512, 128), (33, 7, 9)])
def test_matmul_half_tensor_cores_and_fallback(dtype, m, n, p, ta, tb):
    got, want = _mm_case(m, n, p, dtype, ta, tb, batch=2)
    assert relerr(got, want) < (1e-2 if dtype == "bfloat16" else 2e-3)


@gpu
@pytest.mark.parametrize("dtype", ["float64", "int32", "int64"])
def test_matmul_generic_dtypes(dtype):
    got, want = _mm_case(37, 45, 29, dtype, False, True)
    if dtype == "float64":
        assert relerr(got, want) < 1e-12
    else:
        a = RNG.integers(-50, 50, (3, 37, 45)).astype(dtype)
        b = RNG.integers(-50, 50, (45, 29)).astype(dtype)
        np.testing.assert_array_equal((on(a, dtype) @ on(b, dtype)).numpy(), a @ b)


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("n,p", [(4096, 1000), (4099, 77), (64, 4096)])
@pytest.mark.parametrize("tb", [False, True])
def test_gemv_decode_path(dtype, n, p, tb):
    got, want = _mm_case(1, n, p, dtype, False, tb)
    tol = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}[dtype]
    assert relerr(got, want) < tol


@gpu
def test_batched_matmul_with_broadcast_operand():
    a = RNG.standard_normal((4, 3, 50, 24)).astype(np.float32)
    w = RNG.standard_normal((24, 40)).astype(np.float32)
    got = (on(a) @ on(w).broadcast_to((4, 3, 24, 40))).numpy()
    assert relerr(got, a.astype(np.float64) @ w) < 1e-5


# --- attention ------------------------------------------------------------------------------
def _attention_ref(q, k, v, kv_len, scale, causal):
    out = numpy_ref.Array(q.size, "float64")
    arrs = []
    for x in (q, k, v):
        arr = numpy_ref.Array(x.size, "float64")
        numpy_ref.from_numpy(x.astype(np.float64), arr)
        arrs.append(arr)
    b, hq, sq, d = q.shape
    _, hkv, cap, _ = k.shape
    numpy_ref.attention(*arrs, out, b, hq, hkv, sq, kv_len, cap, d, scale, causal)
    return out.array.reshape(q.shape)


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("b,hq,hkv,sq,kv,cap,d,causal", [
    (2, 8, 2, 77, 77, 77, 64, True),      # prefill, grouped-query heads
    (1, 4, 4, 33, 50, 64, 128, False),    # a cache larger than kv_len
    (1, 32, 8, 1, 3000, 4096, 128, True),  # decode: split-K across groups
    (3, 2, 1, 1, 129, 130, 80, False),    # decode, odd head_dim
])
def test_attention_prefill_and_decode(dtype, b, hq, hkv, sq, kv, cap, d, causal):
    npdt = nd.dtypes.to_numpy_dtype(dtype)
    q = RNG.standard_normal((b, hq, sq, d)).astype(npdt)
    k = RNG.standard_normal((b, hkv, cap, d)).astype(npdt)
    v = RNG.standard_normal((b, hkv, cap, d)).astype(npdt)
    got = nd.attention(on(q, dtype), on(k, dtype), on(v, dtype), causal=causal,
                       kv_len=kv).numpy()
    want = _attention_ref(q, k, v, kv, 1 / np.sqrt(d), causal)
    tol = {"float32": 1e-5, "bfloat16": 1e-2, "float64": 1e-12}[dtype]
    assert relerr(got, want) < tol


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("b,hq,hkv,sq,kv,cap,d,causal", [
    (1, 8, 2, 200, 200, 200, 64, True),    # prefill, grouped-query heads, 800 rows per group
    (2, 4, 4, 100, 300, 320, 128, True),   # a chunk after 200 cached positions
    (1, 6, 2, 70, 129, 130, 64, False),    # kv_len not a multiple of the 64-key tile
    (1, 2, 1, 64, 64, 64, 128, True),
])
def test_tensor_core_attention(dtype, b, hq, hkv, sq, kv, cap, d, causal):
    """Half-precision prefill attention runs on the mma.sync kernel; cache slots past kv_len
    hold NaN, which it must never read."""
    npdt = nd.dtypes.to_numpy_dtype(dtype)
    q = RNG.standard_normal((b, hq, sq, d)).astype(npdt)
    k = RNG.standard_normal((b, hkv, cap, d)).astype(npdt)
    v = RNG.standard_normal((b, hkv, cap, d)).astype(npdt)
    k[:, :, kv:] = np.nan
    v[:, :, kv:] = np.nan
    with DEV.backend.profile() as prof:
        got = nd.attention(on(q, dtype), on(k, dtype), on(v, dtype), causal=causal,
                           kv_len=kv).numpy()
    assert any(name.startswith(f"attention_tc{d}_") for name in prof.totals), prof.table()
    want = _attention_ref(q, np.nan_to_num(k), np.nan_to_num(v), kv, 1 / np.sqrt(d), causal)
    assert relerr(got, want) < (1e-2 if dtype == "bfloat16" else 2e-3)


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("m,n,p,batch", [(8, 2048, 64, 4), (3, 100, 136, 2), (5, 5000, 24, 1),
                                         (1, 777, 16, 3)])
def test_skinny_matmul(dtype, m, n, p, batch):
    """A few rows times tall matrices (the decode step's probs @ V): one kernel, or split
    over k with the partial sums combined."""
    with DEV.backend.profile() as prof:
        got, want = _mm_case(m, n, p, dtype, False, False, batch=batch)
    assert f"matmul_skinny_{_SFX[dtype]}" in prof.totals, prof.table()
    tol = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}[dtype]
    assert relerr(got, want) < tol


_SFX = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("itype", ["int32", "int64"])
def test_half_scatter_add_rounds_once(dtype, itype):
    """A few indices into a half-precision array add in place, bit for bit like the
    reference: each row's values summed in float32 in index order with the old row, rounded
    once; repeated and out-of-range indices included."""
    npdt = nd.dtypes.to_numpy_dtype(dtype)
    rows, dim = 50, 70
    base = RNG.standard_normal((rows, dim)).astype(npdt)
    idx = np.array([3, 7, 3, 49, 0, 3, 7, 60], itype)
    vals = RNG.standard_normal((len(idx), dim)).astype(npdt)
    out = on(base, dtype)
    with DEV.backend.profile() as prof:
        nd.scatter_add(nd.array(idx, device=DEV), on(vals, dtype), rows, out=out)
    got = out.numpy()
    assert f"scatter_add_{_SFX[dtype]}_{itype[0]}{itype[3:]}" in prof.totals, prof.table()
    acc = base.astype(np.float32)
    for i, r in enumerate(idx):
        if 0 <= r < rows:
            acc[r] += vals[i].astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint16), acc.astype(npdt).view(np.uint16))


# --- misaligned and foreign buffers ---------------------------------------------------------
@gpu
def test_misaligned_dlpack_buffers_take_the_scalar_path():
    import torch

    t = torch.arange(1027, dtype=torch.float32, device="cuda")
    x = nd.from_dlpack(t[1:], device=DEV)  # 4 bytes past an aligned address
    y = nd.from_dlpack(t[3:1026], device=DEV)
    want = np.arange(1, 1027, dtype=np.float32)
    np.testing.assert_array_equal((x * 2.0).numpy(), want * 2)
    np.testing.assert_array_equal((x[:1023] + y).numpy(), want[:1023] + np.arange(3, 1026))
    assert relerr(x.sum().numpy(), want.sum()) < 1e-6


@gpu
def test_dlpack_zero_copy_with_torch_both_ways():
    import torch

    t = torch.randn(64, 33, device="cuda")
    a = nd.from_dlpack(t, device=DEV)
    np.testing.assert_array_equal(a.numpy(), t.cpu().numpy())
    t[0, 0] = 42.0
    assert a[0, 0].item() == 42.0  # torch writes, needle sees
    b = on(np.arange(12, dtype=np.float32).reshape(3, 4)) * 1.0
    u = torch.from_dlpack(b)
    assert u.device.type == "cuda" and u.shape == (3, 4)
    assert torch.equal(u.cpu(), torch.arange(12.0).reshape(3, 4))
    b[1, 1] = -1.0
    torch.cuda.synchronize()
    assert u[1, 1].item() == -1.0  # needle writes, torch sees
    tt = torch.from_dlpack(on(np.arange(6, dtype=np.float32).reshape(2, 3)).T)
    assert torch.equal(tt.cpu(), torch.arange(6.0).reshape(2, 3).T)  # strides survive


# --- graphs, profiling, tracing, memory -----------------------------------------------------
@gpu
def test_graph_capture_replays_with_new_inputs():
    be = DEV.backend
    x = on(np.ones((256, 256), np.float32))
    w = on(RNG.standard_normal((256, 256)).astype(np.float32))
    with be.capture() as graph:
        y = ((x @ w).relu() + 1.0).sum(axis=1)
    assert graph.kernels >= 3
    graph.replay()
    want = np.maximum(np.ones((256, 256)) @ w.numpy(), 0) + 1
    assert relerr(y.numpy(), want.sum(axis=1)) < 1e-5
    x[...] = 2.0  # new input, same buffer
    graph.replay()
    want = np.maximum(2 * np.ones((256, 256)) @ w.numpy(), 0) + 1
    assert relerr(y.numpy(), want.sum(axis=1)) < 1e-5
    graph.close()


def _programmatic_edges(graph) -> int | None:
    """How many of a captured graph's dependencies are programmatic (PDL) edges; None where
    these cuda-bindings cannot list edge types."""
    from needle.backends.cuda.driver import cu

    try:
        count = cu.cuGraphGetEdges(graph.graph)[-1]
        err, _, _, data, count = cu.cuGraphGetEdges(graph.graph, count)
    except (TypeError, ValueError):
        return None
    assert err == 0, err
    kind = cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    return sum(1 for d in data[:count] if d is not None and d.type == kind)


@gpu
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
def test_graph_of_dependent_kernels_replays_right_with_and_without_pdl(pdl):
    """On sm_90+ a capture launches kernels with programmatic stream serialization: each may
    be scheduled while its predecessor runs and waits for it at entry (pdl_entry). A chain of
    ~50 dependent kernels of different shapes (matmul, row sums, broadcasts, in-place
    updates) replays to the eager result, every time; the graph has programmatic edges
    exactly when the queue uses PDL."""
    be = DEV.backend
    assert be.queue.pdl == be.tuning.pdl
    assert be.tuning.pdl == (be.device.capability >= 90 and
                             os.environ.get("NEEDLE_PDL", "1") != "0")
    if pdl and not be.queue.pdl:
        pytest.skip("no programmatic dependent launch here (needs sm_90+; NEEDLE_PDL=0 "
                    "turns it off)")
    x = on(RNG.standard_normal((384, 512)).astype(np.float32))
    w = on((RNG.standard_normal((512, 512)) / 16).astype(np.float32))

    def chain():
        y = x
        for _ in range(8):
            y = (y @ w).relu() + 0.5
            y = y - y.sum(axis=1, keepdims=True) / 512.0
        out = y.sum(axis=0)
        out += 1.0
        return out

    want = chain().numpy()
    saved = be.queue.pdl
    be.queue.pdl = pdl
    try:
        with be.capture() as graph:
            got = chain()
    finally:
        be.queue.pdl = saved
    assert graph.kernels >= 40
    edges = _programmatic_edges(graph)
    if edges is not None:
        assert (edges > 0) == pdl, edges
    for _ in range(3):
        graph.replay()
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=2e-4)
    graph.close()


@gpu
def test_host_reads_are_refused_inside_a_capture():
    be = DEV.backend
    x = on(np.ones(8, np.float32))
    with pytest.raises(DeviceError, match="read data back to the host while recording"), \
            be.capture():
        (x + 1).numpy()
    assert ((x + 1).numpy() == 2).all()  # the queue still works afterwards


@gpu
def test_profiler_sums_kernel_time():
    be = DEV.backend
    a = on(RNG.standard_normal((512, 512)).astype(np.float32))
    with be.profile() as prof:
        for _ in range(3):
            (a @ a).exp()
    assert prof.totals["matmul_nn_f32"].calls == 3
    assert prof.totals["ewise_exp_f32"].calls == 3
    assert prof.total_ms > 0 and "matmul_nn_f32" in prof.table()


@gpu
def test_trace_prints_dispatches_copies_and_allocations(capsys):
    from needle.hal import trace

    trace.set_enabled(True)
    try:
        (on(np.ones(10, np.float32)) + 1.0).numpy()
    finally:
        trace.set_enabled(False)
    err = capsys.readouterr().err
    for word in ("alloc", "copy", "dispatch", "scalar_add_f32"):
        assert word in err, err


@gpu
def test_memory_stats_and_out_of_memory():
    be = DEV.backend
    before = be.memory_stats()
    a = on(np.ones(1 << 20, np.float32))
    s = be.memory_stats()
    assert s.in_use >= before.in_use + 4 * (1 << 20) and s.peak >= s.in_use
    del a
    with pytest.raises(OutOfMemoryError, match="requested"):
        nd.empty((1 << 46,), dtype="float32", device=DEV)
    assert (on(np.ones(4, np.float32)) + 1).numpy().tolist() == [2.0] * 4


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_decode_is_one_launch(dtype):
    """Capability fused_decode: attention_decode runs as one kernel (the last group of each
    KV head merges), right against the float64 reference."""
    from tests.backend_ndarray.test_decode_ops import DecodeState

    be = DEV.backend
    assert "fused_decode" in be.capabilities
    sfx = "bf16" if dtype == "bfloat16" else "f32"
    st = DecodeState(DEV, dtype, 8, 2, 64, 300, RNG)
    # (a 300-position cache is 2 tensor-core ranges: on sm_90 merged within a cluster)
    tc = (_tc_decode_kernel(be, 64, dtype, 300, be.tuning.decode_splits) if dtype == "bfloat16"
          else f"attention_decode_flash64_{sfx}")
    for kind, kernel in (("tc", tc), ("flash", f"attention_decode_flash64_{sfx}"),
                         ("split", f"attention_decode_fused_{sfx}")):
        with be.tuned(decode_attention=kind):
            for p in (200, 201):
                qkv = st.qkv()
                with be.profile() as prof:
                    fused = st.run(qkv, p).numpy()
                attention = {k: t.calls for k, t in prof.totals.items()
                             if k.startswith("attention")}
                assert attention == {kernel: 1}, prof.table()
                want = st.expected(qkv, p)
                assert relerr(fused, want) < (2e-2 if dtype == "bfloat16" else 1e-4), kind


@gpu
@pytest.mark.parametrize("splits", [1, 7, 64])
def test_flash_decode_ranges(splits):
    """Flash decoding with 1, 7 and 64 ranges per KV head (one group, odd cuts, the merge's
    two partials per lane) against the float64 step, far into a cache."""
    from tests.backend_ndarray.test_decode_ops import DecodeState

    be = DEV.backend
    st = DecodeState(DEV, "float32", 16, 2, 64, 9000, RNG)
    with be.tuned(decode_attention="flash", decode_splits=splits):
        for p in (0, 64, 4095, 8999):
            qkv = st.qkv()
            got = st.run(qkv, p).numpy()
            assert relerr(got, st.expected(qkv, p)) < 1e-4, (splits, p)


@gpu
@pytest.mark.parametrize("dtype,d,q_heads,kv_heads", [("bfloat16", 64, 32, 4),
                                                      ("float16", 64, 10, 2),
                                                      ("float16", 128, 6, 2),
                                                      ("bfloat16", 128, 16, 1)])
@pytest.mark.parametrize("splits", [1, 7, 64])
def test_tensor_core_decode_ranges(dtype, d, q_heads, kv_heads, splits):
    """attention_decode on tensor cores (decode_tc.cu: a KV head's query heads as the rows of
    an mma tile, 8, 5, 3 and 16 of them) with 1, 7 and 64 ranges per KV head, at the first
    position, tile edges and far into a cache, against the float64 step; one kernel. (The
    merge gives a head 16 or 32 threads of a warp: 5 heads of 64 leave half a warp idle.)"""
    from tests.backend_ndarray.test_decode_ops import DecodeState

    be = DEV.backend
    if not be.tuning.mma:
        pytest.skip("tensor-core decode needs sm_80")
    st = DecodeState(DEV, dtype, q_heads, kv_heads, d, 9000, RNG)
    with be.tuned(decode_attention="tc", decode_splits=splits):
        for p in (0, 63, 64, 4095, 8999):
            qkv = st.qkv()
            with be.profile() as prof:
                got = st.run(qkv, p).numpy()
            assert {k for k in prof.totals if k.startswith("attention")} == \
                {_tc_decode_kernel(be, d, dtype, 9000, splits)}
            tol = 2e-2 if dtype == "bfloat16" else 5e-3
            assert relerr(got, st.expected(qkv, p)) < tol, (splits, p)


@gpu
@pytest.mark.parametrize("dtype,q_heads,kv_heads", [("bfloat16", 4, 1), ("float16", 8, 4),
                                                    ("bfloat16", 16, 1)])
@pytest.mark.parametrize("splits", [1, 7, 64])
@pytest.mark.parametrize("window", [0, 512])
def test_flash_decode_of_256_wide_heads(dtype, q_heads, kv_heads, splits, window):
    """Gemma's 256-wide heads decode through the warp-per-head flash kernel (two 64 KiB
    tiles in flight; the tensor-core kernels take 64 and 128) with 1, 7 and 64 ranges a KV
    head, with and without a sliding window, against the float64 step; float32 keeps the
    split kernel (its tiles would not fit)."""
    from tests.backend_ndarray.test_decode_ops import DecodeState

    be = DEV.backend
    st = DecodeState(DEV, dtype, q_heads, kv_heads, 256, 3000, RNG)
    sfx = "bf16" if dtype == "bfloat16" else "f16"
    with be.tuned(decode_splits=splits):
        for p in (0, 63, 64, 700, 2999):
            qkv = st.qkv()
            with be.profile() as prof:
                got = st.run(qkv, p, window=window or None).numpy()
            assert {k for k in prof.totals if k.startswith("attention")} == \
                {f"attention_decode_flash256_{sfx}"}
            tol = 2e-2 if dtype == "bfloat16" else 5e-3
            assert relerr(got, st.expected(qkv, p, window or None)) < tol, (splits, p)
    wide = DecodeState(DEV, "float32", 4, 1, 256, 300, RNG)
    qkv = wide.qkv()
    with be.profile() as prof:
        got = wide.run(qkv, 200).numpy()
    assert "attention_decode_fused_f32" in prof.totals
    assert relerr(got, wide.expected(qkv, 200)) < 1e-4


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_paged_flash_kernel_of_256_wide_heads(dtype):
    """Serving's paged attention takes the flash kernel at head size 256 in half types (its
    values in the model-shapes test of test_paged.py), the general kernel in float32."""
    rng = np.random.default_rng(0)
    q = on(rng.standard_normal((3, 4, 256)).astype(np.float32)).astype(dtype)
    pool = [on(rng.standard_normal((8, 16, 1, 256)).astype(np.float32)).astype(dtype)
            for _ in range(2)]
    tables = np.array([[0, 1, 2, -1], [3, 4, -1, -1], [5, 6, 7, -1]], np.int32)
    be = DEV.backend
    with be.profile() as prof:
        nd.paged_attention(q, *pool, tables, np.arange(3, dtype=np.int32),
                           np.array([40, 20, 47], np.int32), 256 ** -0.5)
    sfx = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[dtype]
    want = f"paged_attention_flash256_{sfx}" if dtype != "float32" else f"paged_attention_{sfx}"
    assert want in prof.totals, prof.table()


def _tc_decode_kernel(be, d: int, dtype: str, capacity: int, splits: int) -> str:
    """The tensor-core decode kernel a cache takes: its most ranges a KV head are the
    splits, at most one per 4 (D 64) or 2 (D 128) tiles of 64 positions; 2-8 of them merge
    within a cluster where the device has clusters (sm_90)."""
    tiles = math.ceil(capacity / 64)
    ranges = min(splits, math.ceil(tiles / (4 if d == 64 else 2)))
    cluster = "c" if be.tuning.decode_cluster and 1 < ranges <= 8 else ""
    return f"attention_decode_tc{d}{cluster}_{'bf16' if dtype == 'bfloat16' else 'f16'}"


@gpu
@pytest.mark.parametrize("dtype,d,q_heads,kv_heads,capacity", [("bfloat16", 64, 32, 4, 2048),
                                                               ("float16", 64, 10, 2, 1500),
                                                               ("bfloat16", 128, 16, 1, 1024),
                                                               ("float16", 128, 6, 2, 700)])
@pytest.mark.parametrize("cluster", [True, False], ids=["cluster", "memory"])
def test_tensor_core_decode_cluster(dtype, d, q_heads, kv_heads, capacity, cluster):
    """sm_90: a cache of at most 8 tensor-core ranges a KV head (8 x 4 tiles of 64 positions
    at D = 64, 8 x 2 at D = 128) merges them within one thread-block cluster (the ...c
    kernels), where a range may be a single tile; positions with 1 to 8 ranges (some of
    fewer positions than a tile, some starting within one) against the float64 step, and
    the same with the cluster off (the merge through memory)."""
    from tests.backend_ndarray.test_decode_ops import DecodeState

    be = DEV.backend
    if not be.tuning.mma:
        pytest.skip("tensor-core decode needs sm_80")
    if cluster and not be.tuning.decode_cluster:
        pytest.skip("cluster decode off here (needs sm_90; NEEDLE_DECODE_CLUSTER=0 turns it off)")
    st = DecodeState(DEV, dtype, q_heads, kv_heads, d, capacity, RNG)
    sfx = "bf16" if dtype == "bfloat16" else "f16"
    kernel = f"attention_decode_tc{d}{'c' if cluster else ''}_{sfx}"
    with be.tuned(decode_attention="tc", decode_cluster=cluster):
        for p in (0, 64, 127, 256, 450, 600, capacity - 1):
            qkv = st.qkv()
            with be.profile() as prof:
                got = st.run(qkv, p).numpy()
            assert {k for k in prof.totals if k.startswith("attention")} == {kernel}
            tol = 2e-2 if dtype == "bfloat16" else 5e-3
            assert relerr(got, st.expected(qkv, p)) < tol, p


@gpu
def test_decode_bands_pick_the_cluster_kernel():
    """Capability decode_bands: a cache longer than a cluster's ranges (2,048 positions at
    D = 64, 1,024 at D = 128) has two bands; bounded by the first, a step takes the cluster
    kernel, also at positions past the bound (still exact against the float64 step);
    unbounded, the kernel that merges through memory. One band where the choice never
    changes (short caches, float32, the cluster or the bands turned off)."""
    from tests.backend_ndarray.test_decode_ops import DecodeState

    be = DEV.backend
    if not (be.tuning.mma and be.tuning.decode_cluster):
        pytest.skip("cluster decode needs sm_90 (NEEDLE_DECODE_CLUSTER=0 turns it off)")
    assert be.attention_decode_bands("bfloat16", 32, 4, 64, 4096) == (2048, 4096)
    assert be.attention_decode_bands("float16", 32, 8, 128, 4096) == (1024, 4096)
    assert be.attention_decode_bands("bfloat16", 32, 4, 64, 2048) == (2048,)
    assert be.attention_decode_bands("float32", 32, 4, 64, 4096) == (4096,)
    with be.tuned(decode_cluster=False):
        assert be.attention_decode_bands("bfloat16", 32, 4, 64, 4096) == (4096,)
    with be.tuned(decode_bands=False):
        assert be.attention_decode_bands("bfloat16", 32, 4, 64, 4096) == (4096,)
    for dtype, d, q_heads, kv_heads, capacity in (("bfloat16", 64, 32, 4, 4096),
                                                  ("float16", 128, 12, 2, 2500)):
        st = DecodeState(DEV, dtype, q_heads, kv_heads, d, capacity, RNG)
        bands = nd.attention_decode_bands(st.k_dev, q_heads)
        assert len(bands) == 2 and bands[-1] == capacity
        sfx = "bf16" if dtype == "bfloat16" else "f16"
        tol = 2e-2 if dtype == "bfloat16" else 5e-3
        for p, bound, kernel in ((0, bands[0], "c"), (700, bands[0], "c"),
                                 (bands[0] - 1, bands[0], "c"), (bands[0] + 5, None, ""),
                                 (capacity - 3, bands[0], "c"), (capacity - 2, None, "")):
            qkv = st.qkv()
            with be.profile() as prof:
                got = st.run(qkv, p, bound).numpy()
            assert {k for k in prof.totals if k.startswith("attention")} == \
                {f"attention_decode_tc{d}{kernel}_{sfx}"}, (p, bound)
            assert relerr(got, st.expected(qkv, p)) < tol, (dtype, p, bound)


@gpu
def test_precompile_then_use():
    """Capability precompile: inference's shards of a dtype start compiling on threads;
    the kernels then run (their lookups wait for their own compiles)."""
    be = DEV.backend
    units = be.precompile(["float16", "int32"])
    assert all(u.endswith((":f16", ":i32")) for u in units)
    assert not any(u.startswith("optim") for u in units)
    assert [u for u in units if u.endswith(":i32")] in ([], ["elementwise:i32"])
    be.wait_precompiled()
    x = on(RNG.standard_normal((64, 64)).astype(np.float32), "float16")
    assert relerr((x @ x).numpy().astype(np.float64), x.numpy().astype(np.float64) @
                  x.numpy().astype(np.float64)) < 2e-3


@gpu
def test_token_major_attention_reads_query_rows_in_place():
    """A prefill's q (the query heads of fused QKV rows, viewed heads-first) goes to the
    tensor-core kernel as it is: no copy before or after, and the same numbers as the
    heads-first call of the same kernel."""
    if not DEV.backend.tuning.mma:
        pytest.skip("tensor-core attention needs sm_80")
    npdt = nd.dtypes.to_numpy_dtype("bfloat16")
    qkv = on(RNG.standard_normal((1, 128, 12, 64)).astype(npdt), "bfloat16")
    k = on(RNG.standard_normal((1, 2, 160, 64)).astype(npdt), "bfloat16")
    v = on(RNG.standard_normal((1, 2, 160, 64)).astype(npdt), "bfloat16")
    q = qkv[:, :, :8].permute((0, 2, 1, 3))
    with DEV.backend.profile() as prof:
        got = nd.attention(q, k, v, causal=True, kv_len=128)
        heads = got.permute((0, 2, 1, 3)).reshape((1, 128, 512))
    assert "attention_tc64_bf16" in prof.totals, prof.table()
    assert not any(n.startswith(("compact", "transpose")) for n in prof.totals), prof.table()
    want = nd.attention(q.compact(), k, v, causal=True, kv_len=128)
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    np.testing.assert_array_equal(heads.numpy(), want.permute((0, 2, 1, 3)).numpy()
                                  .reshape(1, 128, 512))



def test_native_launch_module_is_built_and_used_where_there_is_a_driver(monkeypatch):
    """native/launch.cc builds on every machine (it opens libcuda at run time): available()
    says whether the driver's cuLaunchKernel was found; with a GPU the queue launches through
    it, a bad launch is a KernelLaunchError with the driver's reason, results match the
    cuda-bindings fallback, and NEEDLE_CUDA_NATIVE_LAUNCH=0 selects that fallback."""
    from needle.backends.cuda import _launch
    from needle.backends.cuda import queue as queue_module
    from needle.backends.cuda.queue import native_dispatch, native_launch
    from needle.errors import KernelLaunchError

    assert isinstance(_launch.available(), bool)
    assert _launch.BLOCK_BYTES == queue_module._SCRATCH  # one argument-block layout
    monkeypatch.setenv("NEEDLE_CUDA_NATIVE_LAUNCH", "0")
    assert native_launch() is None and native_dispatch() is None
    monkeypatch.delenv("NEEDLE_CUDA_NATIVE_LAUNCH")
    if not DEV.enabled():
        assert native_launch() is (_launch.launch if _launch.available() else None)
        if not _launch.available():  # no driver: dispatch says so before reading anything
            assert _launch.dispatch(0, (1, 1, 1), (1, 1, 1), 0, 0, (), b"") == -1
        return
    q = DEV.backend.queue
    assert _launch.available() and q.launch is not None and q._native_dispatch is not None
    x = on(np.arange(1000, dtype=np.float32))
    native = (x * 2.0 + 1.0).numpy()
    fast, q._native_dispatch = q._native_dispatch, None
    try:
        packed = (x * 2.0 + 1.0).numpy()  # packed in Python, launched natively
        launch, q.launch = q.launch, None
        try:
            fallback = (x * 2.0 + 1.0).numpy()  # cuda-bindings' cuLaunchKernel
        finally:
            q.launch = launch
    finally:
        q._native_dispatch = fast
    np.testing.assert_array_equal(native, packed)
    np.testing.assert_array_equal(native, fallback)
    k, t, _ = DEV.backend._geometry_1d("ewise_add_f32", "elementwise")
    with pytest.raises(KernelLaunchError, match="threads=\\(4096, 1, 1\\).*CUDA_ERROR"):
        q._submit((k, (1, 1, 1), (4096, 1, 1), b"", 0, q._argv_addr))
    with pytest.raises(KernelLaunchError, match="threads=\\(4096, 1, 1\\).*CUDA_ERROR"):
        q.dispatch(k, (1, 1, 1), (4096, 1, 1), (), b"")  # the native dispatch's error path


@gpu
def test_native_dispatch_reads_buffer_offsets_and_refuses_oversized_arguments():
    """The eager launch packs each buffer's handle + offset natively: a view into the middle
    of a block must be read there, not at the block's start; arguments over the 512-byte
    block are a KernelLaunchError (the Python path's message), not a launch of junk; a
    buffer without a handle is the Python error it raises."""
    from needle.backends.gpu.array import N_PARAMS, GpuArray
    from needle.errors import KernelLaunchError

    be = DEV.backend
    assert be.queue._native_dispatch is not None
    x = on(np.arange(1000, dtype=np.float32))
    block = x._handle.buffer
    view = GpuArray(block.view(400, 600 * 4), 600, "float32")  # elements 100..699
    out = be.Array(600, "float32")
    be.ewise_add(view, view, out)
    np.testing.assert_array_equal(be.to_numpy(out, (600,), (1,), 0),
                                  2 * np.arange(100, 700, dtype=np.float32))
    k, t, _ = be._geometry_1d("ewise_add_f32", "elementwise")
    too_many = (block,) * 70
    with pytest.raises(KernelLaunchError, match="arguments exceed the 512-byte launch block"):
        be.queue.dispatch(k, (1, 1, 1), (t, 1, 1), too_many, N_PARAMS.pack(1))
    fast, be.queue._native_dispatch = be.queue._native_dispatch, None
    try:  # the Python packing refuses them with the same error
        with pytest.raises(KernelLaunchError, match="exceed the 512-byte launch block"):
            be.queue.dispatch(k, (1, 1, 1), (t, 1, 1), too_many, N_PARAMS.pack(1))
    finally:
        be.queue._native_dispatch = fast
    with pytest.raises(AttributeError):
        be.queue.dispatch(k, (1, 1, 1), (t, 1, 1), (block, object(), block), N_PARAMS.pack(1))
    with pytest.raises(ValueError, match="three entries"):
        be.queue.dispatch(k, (1, 1), (t, 1, 1), (block, block, block), N_PARAMS.pack(1))
    with pytest.raises(ValueError, match="32 bits"):
        be.queue.dispatch(k, (2**32 + 1, 1, 1), (t, 1, 1), (block,) * 3, N_PARAMS.pack(1))
    with pytest.raises(OverflowError):
        be.queue.dispatch(k, (-1, 1, 1), (t, 1, 1), (block,) * 3, N_PARAMS.pack(1))


@gpu
def test_native_dispatch_places_raw_arguments():
    """By-value raw arguments (the TMA GEMM's tensor maps, the multi-tensor Adam's table)
    go through the native launch too: the same bits as the queue's Python packing; a raw
    launch after one with fewer fixed slots still finds its buffers; raw arguments past
    the 1,024-byte raw block are the Python path's KernelLaunchError, a non-bytes one a
    TypeError."""
    from needle import optim
    from needle.autograd import Tensor
    from needle.backends.cuda import _launch
    from needle.backends.cuda import queue as queue_module
    from needle.backends.gpu.array import N_PARAMS
    from needle.errors import KernelLaunchError

    be, q = DEV.backend, DEV.backend.queue
    assert q._native_dispatch is not None and _launch.RAW_BYTES == queue_module._RAW_SCRATCH

    def step_then_product():
        # Adam's multi-tensor launch: no buffers or params, one raw table (0 fixed slots);
        # then a half product (the TMA GEMM on Hopper: 4 buffers, params, 3 maps)
        w = Tensor(np.linspace(-1, 1, 4096, dtype=np.float32).reshape(64, 64), device=DEV,
                   requires_grad=True)
        opt = optim.Adam([w], lr=1e-2)
        (w * w).sum().backward()
        opt.step()
        a = on(RNG.standard_normal((256, 128)).astype(np.float32), "bfloat16")
        b = on(RNG.standard_normal((128, 192)).astype(np.float32), "bfloat16")
        return w.numpy(), (a @ b).numpy(), a, b

    placed = []  # the Python path's raw packing, counted: the native path must not use it
    place_raw = q._place_raw
    q._place_raw = lambda *args: placed.append(args[0].name) or place_raw(*args)
    try:
        state = RNG.bit_generator.state
        native = step_then_product()
        assert placed == []  # every raw launch above went through the native dispatch
        RNG.bit_generator.state = state
        fast, q._native_dispatch = q._native_dispatch, None
        try:
            packed = step_then_product()
        finally:
            q._native_dispatch = fast
        assert placed or not be.tuning.tma  # the TMA product's maps are raw arguments
    finally:
        del q._place_raw
    np.testing.assert_array_equal(native[0], packed[0])
    np.testing.assert_array_equal(native[1], packed[1])
    np.testing.assert_array_equal(native[1], (native[2] @ native[3]).numpy())  # a plan reused
    k, t, _ = be._geometry_1d("ewise_add_f32", "elementwise")
    block = be.Array(t, "float32").buffer
    with pytest.raises(KernelLaunchError, match="1024-byte raw block"):
        q.dispatch(k, (1, 1, 1), (t, 1, 1), (block,) * 3, N_PARAMS.pack(1),
                   raw_args=(bytes(600), bytes(600)))
    with pytest.raises(TypeError, match="bytes"):
        q.dispatch(k, (1, 1, 1), (t, 1, 1), (block,) * 3, N_PARAMS.pack(1),
                   raw_args=(bytearray(128),))
