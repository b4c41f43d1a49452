"""The CUDA backend's TMA-fed Hopper GEMM (kernels/gemm_tma.cu, tuning "tma") and what
it rests on: tile widths, launch plans, the raw by-value launch arguments that carry its
tensor maps, and the maps' own limits. Split from test_cuda.py, whose helpers it uses.

Without a Hopper GPU only the tests that need no device run (compiling, argument slots,
map limits).
"""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backends.cuda.tuning import K_MAJOR_WIDTHS, TMA_WIDTHS, tma_width
from needle.errors import DeviceError

from .test_cuda import _SFX, DEV, RNG, _mm_case, on, relerr


# --- TMA GEMM (gemm_tma.cu, tuning "tma": Hopper) ------------------------------------------
def _has_tma() -> bool:
    return DEV.enabled() and DEV.backend.tuning.tma


tma = pytest.mark.skipif(not _has_tma(), reason="needs a Hopper GPU (device feature 'tma')")
_TMA_TOL = {"bfloat16": 1e-2, "float16": 2e-3}


def _tma_name(width: int, n_major: bool, dtype: str) -> str:
    """gemm_tma.cu's kernel for a tile ``width`` wide (the 256-wide one is unsuffixed)."""
    return f"matmul_tma{'' if width == 256 else width}_{'nn_' if n_major else ''}{_SFX[dtype]}"


def _tma_product(a, b, dtype, poison=True, n_major=False, width=None, groups=None):
    """A[z] @ B[z]^T through GpuBackend.matmul into an output poisoned with NaN; a (batch, m,
    n) and b (batch, p, n) numpy arrays (the TMA kernel's own layouts). With ``n_major`` B
    is stored as (batch, n, p) and passed untransposed (matmul_tma_nn). Returns the result
    and the names of the kernels that ran."""
    batch, m, n = a.shape
    p = b.shape[1]
    A = on(a, dtype)
    B = on(np.ascontiguousarray(b.transpose(0, 2, 1)) if n_major else b, dtype)
    out = nd.NDArray.make((batch, m, p), device=DEV, dtype=dtype)
    if poison:
        out.fill(np.nan)
    # (products of <= 128 rows would take the skinny kernel, skinny.cu)
    with (DEV.backend.tuned(skinny_tc=0, tma_tile=width, tma_groups=groups),
          DEV.backend.profile() as prof):
        DEV.backend.matmul(A.handle, B.handle, out.handle, m, n, p, batch=batch,
                           stride_a=m * n, stride_b=p * n, transpose_b=not n_major)
        got = out.numpy()
    return got, set(prof.totals)


@tma
@pytest.mark.parametrize("width", [256, 128, 64])
@pytest.mark.parametrize("n_major", [False, True], ids=["b_k_major", "b_n_major"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m,n,p,batch", [(128, 64, 256, 1), (200, 72, 264, 1), (130, 136, 264, 3),
                                         (1000, 520, 776, 2), (128, 4096, 512, 1),
                                         (256, 192, 328, 1)])
def test_tma_matmul_matches_float64(dtype, m, n, p, batch, n_major, width):
    """Exact tiles, ragged edges in m, n and p (partly and, for N-major B, wholly zero-filled
    boxes; k-tiles past n), batches: every output element written (NaN poison) and the
    product right, for B stored K-major (matmul_tma) and N-major (matmul_tma_nn), with
    tiles 256, 128 and 64 wide (their pipelines 4, 6 and 8 stages deep)."""
    npdt = nd.dtypes.to_numpy_dtype(dtype)
    a = RNG.standard_normal((batch, m, n)).astype(npdt)
    b = RNG.standard_normal((batch, p, n)).astype(npdt)
    got, kernels = _tma_product(a, b, dtype, n_major=n_major, width=width)
    assert _tma_name(width, n_major, dtype) in kernels, kernels
    assert not np.isnan(got.astype(np.float32)).any()
    want = a.astype(np.float64) @ b.astype(np.float64).transpose(0, 2, 1)
    assert relerr(got, want) < _TMA_TOL[dtype]


@tma
@pytest.mark.parametrize("width", [80, 160, 176])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m,n,p", [(128, 64, 176), (200, 72, 264), (130, 136, 328),
                                   (1000, 520, 2560), (2048, 2048, 2560), (512, 256, 11264),
                                   (512, 2048, 2560), (300, 200, 184)])
def test_tma_80_160_and_176_wide_tiles_match_float64(dtype, m, n, p, width):
    """80-, 160- and 176-wide tiles (K-major B): 64-column chunks stored by TMA, the last
    16, 32 or 48 columns by the threads (a TMA box would write into the next tile's); ragged
    columns (184, 264 and 328: the last tile partly or mostly past p), the 2,560 and 11,264
    columns of a 1.1B layer's q/k/v and gate/up products (512 x 2,560 x 2,048: its q/k/v at
    512 rows, which take 80-wide tiles); every output written (NaN poison)."""
    npdt = nd.dtypes.to_numpy_dtype(dtype)
    a = RNG.standard_normal((1, m, n)).astype(npdt)
    b = RNG.standard_normal((1, p, n)).astype(npdt)
    got, kernels = _tma_product(a, b, dtype, width=width)
    assert f"matmul_tma{width}_{_SFX[dtype]}" in kernels, kernels
    assert not np.isnan(got.astype(np.float32)).any()
    want = a.astype(np.float64) @ b.astype(np.float64).transpose(0, 2, 1)
    assert relerr(got, want) < _TMA_TOL[dtype]
    narrow, _ = _tma_product(a, b, dtype, width=128)  # the same sums for every output
    np.testing.assert_array_equal(got, narrow)


@tma
@pytest.mark.parametrize("groups", [1, 3, 7])
@pytest.mark.parametrize("width", [256, 128, 64])
@pytest.mark.parametrize("n_major", [False, True], ids=["b_k_major", "b_n_major"])
def test_tma_groups_walk_many_tiles_across_the_batch(n_major, width, groups):
    """The persistent grid with fewer groups than tiles: each group walks several tiles,
    crossing from one matrix of the batch to the next, its pipeline's stage counter running
    on across tiles (6 k-tiles a tile: not a multiple of the 4, 6 or 8 stages), while its
    consumers write one tile out as the next one's stages load. Every output is written and
    bitwise equal to one group per tile (the same products, summed in the same order)."""
    a = RNG.standard_normal((3, 300, 328)).astype(np.float32)
    b = RNG.standard_normal((3, 520, 328)).astype(np.float32)
    got, kernels = _tma_product(a, b, "bfloat16", n_major=n_major, width=width, groups=groups)
    assert _tma_name(width, n_major, "bfloat16") in kernels, kernels
    one_each, _ = _tma_product(a, b, "bfloat16", n_major=n_major, width=width, groups=1 << 20)
    assert not np.isnan(got.astype(np.float32)).any()
    np.testing.assert_array_equal(got, one_each)
    want = a.astype(np.float64) @ b.astype(np.float64).transpose(0, 2, 1)
    assert relerr(got, want) < _TMA_TOL["bfloat16"]


@tma
@pytest.mark.parametrize("n_major", [False, True], ids=["b_k_major", "b_n_major"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tma_matmul_4096_sampled(dtype, n_major):
    """A large product with the automatic tile (256 wide at 4096: tma_width)."""
    npdt = nd.dtypes.to_numpy_dtype(dtype)
    n = 4096
    a = RNG.standard_normal((1, n, n), dtype=np.float32).astype(npdt)
    b = RNG.standard_normal((1, n, n), dtype=np.float32).astype(npdt)
    got, kernels = _tma_product(a, b, dtype, n_major=n_major)
    assert _tma_name(256, n_major, dtype) in kernels, kernels
    assert not np.isnan(got.astype(np.float32)).any()
    rows = np.sort(RNG.choice(n, 96, replace=False))
    want = a[0, rows].astype(np.float64) @ b[0].astype(np.float64).T
    assert relerr(got[0, rows], want) < _TMA_TOL[dtype]
    cols = np.sort(RNG.choice(n, 96, replace=False))
    want = a[0].astype(np.float64) @ b[0, cols].astype(np.float64).T
    assert relerr(got[0][:, cols], want) < _TMA_TOL[dtype]


@tma
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("m,n,p,batch", [(200, 136, 264, 2), (384, 256, 512, 1)])
def test_tma_matmul_through_ndarray(dtype, ta, tb, m, n, p, batch):
    """NDArray @ with transposed operands (copied or passed as they are) takes a TMA kernel:
    B stored transposed is K-major (matmul_tma), B as written is N-major (matmul_tma_nn,
    no copy of B)."""
    width = tma_width(m, p, batch, DEV.backend.device.compute_units,
                      K_MAJOR_WIDTHS if tb else TMA_WIDTHS)
    with DEV.backend.profile() as prof:
        got, want = _mm_case(m, n, p, dtype, ta, tb, batch=batch)
    assert _tma_name(width, not tb, dtype) in prof.totals, prof.table()
    if not ta and not tb:
        assert not any(k.startswith(("compact", "transpose")) for k in prof.totals), \
            prof.table()
    assert relerr(got, want) < _TMA_TOL[dtype]


@tma
def test_tma_matmul_falls_back_for_broadcast_small_and_on_request():
    """A batch stride of 0 (one matrix broadcast over the batch), operands smaller than a
    box, and the tuning gemm="wgmma" (NEEDLE_GEMM=wgmma) take the cp.async wgmma kernel."""
    a = RNG.standard_normal((136, 64)).astype(np.float32)
    b = RNG.standard_normal((3, 64, 264)).astype(np.float32)
    A, B = on(a, "bfloat16"), on(b, "bfloat16")
    want = a.astype(nd.dtypes.to_numpy_dtype("bfloat16")).astype(np.float64) @ \
        b.astype(nd.dtypes.to_numpy_dtype("bfloat16")).astype(np.float64)
    with DEV.backend.profile() as prof:
        got = (A @ B).numpy()
    assert not any(k.startswith("matmul_tma") for k in prof.totals), prof.table()
    assert relerr(got, want) < 1e-2
    with DEV.backend.profile() as prof:
        got, want = _mm_case(136, 64, 56, "bfloat16", False, True)  # p < 64
    assert not any(k.startswith("matmul_tma") for k in prof.totals), prof.table()
    assert relerr(got, want) < 1e-2
    with DEV.backend.tuned(gemm="wgmma"), DEV.backend.profile() as prof:
        got = (on(b[0], "bfloat16").T @ on(b[1], "bfloat16")).numpy()
    assert any(k.startswith("matmul_wgmma") for k in prof.totals), prof.table()
    with DEV.backend.profile() as prof:
        got2 = (on(b[0], "bfloat16").T @ on(b[1], "bfloat16")).numpy()
    assert any(k.startswith("matmul_tma") and "_nn_" in k for k in prof.totals), prof.table()
    assert relerr(got2, got) < 1e-2


@tma
def test_tma_matmul_keeps_its_launch_plan_per_operands_and_tuning():
    """A repeated product reuses its launch plan (tensor maps included) and goes straight to
    it whatever the output buffer; new operand addresses make a new plan; a change of tuning
    forgets them all (the route may change with it); every result stays right."""
    be = DEV.backend
    npdt = nd.dtypes.to_numpy_dtype("bfloat16")
    av, bv = (RNG.standard_normal(s).astype(npdt) for s in ((256, 192), (192, 512)))
    a, b = on(av, "bfloat16"), on(bv, "bfloat16")
    want = av.astype(np.float64) @ bv.astype(np.float64)
    be._tma_plans.clear()
    be._direct_plans.clear()
    for _ in range(3):
        with be.profile() as prof:
            assert relerr((a @ b).numpy(), want) < 1e-2
    assert "matmul_tma64_nn_bf16" in prof.totals, prof.table()  # tma_width's choice here
    assert len(be._tma_plans) == 1 and len(be._direct_plans) == 1
    a2 = on(av, "bfloat16")
    assert relerr((a2 @ b).numpy(), want) < 1e-2
    assert len(be._tma_plans) == 2 and len(be._direct_plans) == 2
    assert relerr((a2.T.compact().T @ b).numpy(), want) < 1e-2  # A transposed: copied,
    assert len(be._direct_plans) == 2  # so its route is not kept
    with be.tuned(tma_tile=128), be.profile() as prof:
        assert len(be._direct_plans) == 0
        assert relerr((a @ b).numpy(), want) < 1e-2
    assert "matmul_tma128_nn_bf16" in prof.totals, prof.table()
    with be.profile() as prof:
        assert relerr((a @ b).numpy(), want) < 1e-2
    assert "matmul_tma64_nn_bf16" in prof.totals and "matmul_tma128_nn_bf16" not in \
        prof.totals, prof.table()


@tma
@pytest.mark.parametrize("width", [None, 80, 160, 176])
@pytest.mark.parametrize("offset", [0, 4])
def test_tma_outputs_that_tma_cannot_store_are_stored_value_by_value(offset, width):
    """The TMA GEMM stores C by TMA, whose start must be 16-byte aligned and whose rows
    16-byte multiples: an output 8 bytes into its buffer gets its values stored one by one
    by the same kernel (so do float32 rows of 130 or 258 values under TF32: test_tf32.py;
    half rows that are not 16-byte multiples never reach this kernel). Every output is
    right, and nothing around it is written."""
    be, dtype, p = DEV.backend, "bfloat16", 520
    npdt = nd.dtypes.to_numpy_dtype(dtype)
    av = RNG.standard_normal((256, 192)).astype(npdt)
    bv = RNG.standard_normal((p, 192)).astype(npdt)
    a, b = on(av, dtype), on(bv, dtype)
    want = av.astype(np.float64) @ bv.astype(np.float64).T
    block = be._new_array(256 * p + 2 * offset, dtype)
    be.fill(block, np.nan)
    item = np.dtype(npdt).itemsize
    out = type(block)(block.buffer.view(item * offset, item * 256 * p), 256 * p, dtype)
    with be.tuned(skinny_tc=0, tma_tile=width), be.profile() as prof:
        be.matmul(a.handle, b.handle, out, 256, 192, p, transpose_b=True)
    assert any(name.startswith(f"matmul_tma{width or ''}") for name in prof.totals), \
        prof.table()
    got = be.to_numpy(out, (256, p), (p, 1), 0)
    assert relerr(got, want) < _TMA_TOL[dtype]
    whole = be.to_numpy(block, (256 * p + 2 * offset,), (1,), 0).astype(np.float32)
    assert np.isnan(whole[:offset]).all() and np.isnan(whole[offset + 256 * p:]).all()


def test_outputs_without_a_tma_map_are_known_before_the_driver():
    """_c_map answers None (store values one by one) for an output TMA cannot store,
    without asking the driver: an unaligned start, rows that are not 16-byte multiples, a
    map the checks refuse (more than 2^32 rows)."""
    from needle.backends.cuda.backend import CudaBackend

    assert CudaBackend._c_map("bfloat16", 0x1008, 256, 520, 1) is None
    assert CudaBackend._c_map("bfloat16", 0x1000, 256, 516, 1) is None
    assert CudaBackend._c_map("float32", 0x1000, 256, 130, 3) is None
    assert CudaBackend._c_map("bfloat16", 0x1000, 1 << 33, 520, 1) is None


@tma
def test_tma_matmul_in_a_graph_replays_with_new_inputs():
    """The tensor maps are by-value launch arguments: capture copies them, so a replay reads
    the captured buffers' new contents."""
    be = DEV.backend
    npdt = nd.dtypes.to_numpy_dtype("bfloat16")
    x = on(RNG.standard_normal((256, 512)).astype(npdt), "bfloat16")
    w = on(RNG.standard_normal((512, 256)).astype(npdt), "bfloat16")
    with be.capture() as graph:
        y = x @ w
    for _ in range(2):
        xv = RNG.standard_normal((256, 512)).astype(npdt)
        x[...] = on(xv, "bfloat16")
        graph.replay()
        want = xv.astype(np.float64) @ w.numpy().astype(np.float64)
        assert relerr(y.numpy(), want) < 1e-2
    graph.close()


def test_gemm_tma_compiles_for_hopper_and_older_archs():
    """gemm_tma.cu builds for sm_90a (TMA, mbarriers, setmaxnreg, m64n{256,128,64} wgmma,
    every tile width) and, with empty bodies, for sm_80 and sm_90 (CI's every-file compile
    covers those too)."""
    from needle.backends.cuda import compiler

    try:
        compiler.nvrtc_version()
    except DeviceError as e:
        pytest.fail(f"NVRTC unavailable: {e} (pip install 'needle[cuda]')")
    source = (compiler.KERNEL_DIR / "gemm_tma.cu").read_text()
    ptx = compiler.compile_source(source, "gemm_tma", "compute_90a", ptx=True).decode()
    for word in ("cp.async.bulk.tensor.3d", "mbarrier.try_wait.parity", "setmaxnreg.inc",
                 "setmaxnreg.dec", "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16",
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16",
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16",
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16", ".entry matmul_tma_bf16",
                 ".entry matmul_tma128_nn_bf16", ".entry matmul_tma64_f16",
                 "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16", ".entry matmul_tma160_f16",
                 "wgmma.mma_async.sync.aligned.m64n176k16.f32.f16", ".entry matmul_tma176_bf16",
                 "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16", ".entry matmul_tma80_f16"):
        assert word in ptx, word
    for arch in ("sm_90a", "sm_90", "sm_80"):
        assert compiler.compile_source(source, "gemm_tma", arch)[:4] == b"\x7fELF", arch


def test_raw_launch_arguments_get_aligned_slots():
    """CudaQueue's by-value arguments (tensor maps): each copied to a 64-byte-aligned place,
    listed after the buffer and params slots; the usual slots unchanged; the same arguments
    object again (a cached launch plan's) reuses the block, others are copied (no driver
    needed)."""
    import ctypes

    from needle.backends.cuda.queue import CudaQueue

    q = CudaQueue.__new__(CudaQueue)
    q._scratch = ctypes.create_string_buffer(512)
    base = ctypes.addressof(q._scratch)
    q._argv = (ctypes.c_void_p * 64)(*[base + 8 * i for i in range(64)])
    q._raw = q._raw_argv = None
    q._raw_args = q._raw_fixed = q._raw_argv_addr = None

    class K:
        name = "k"

    raws = (bytes(range(128)), bytes(range(100, 228)), b"\x07" * 8)
    addr = q._place_raw(K, 4, raws)
    argv = ctypes.cast(addr, ctypes.POINTER(ctypes.c_void_p))
    assert [argv[i] for i in range(4)] == [base + 8 * i for i in range(4)]
    for j, raw in enumerate(raws):
        ptr = argv[4 + j]
        assert ptr % 64 == 0 and ctypes.string_at(ptr, len(raw)) == raw
    assert argv[5] - argv[4] == 128 and argv[6] - argv[5] == 128
    assert [q._argv[i] for i in range(8)] == [base + 8 * i for i in range(8)]  # untouched
    assert q._place_raw(K, 4, raws) == addr  # the same object: nothing copied again
    other = (b"\x01" * 128,)
    argv = ctypes.cast(q._place_raw(K, 4, other), ctypes.POINTER(ctypes.c_void_p))
    assert ctypes.string_at(argv[4], 128) == other[0]
    argv = ctypes.cast(q._place_raw(K, 2, other), ctypes.POINTER(ctypes.c_void_p))
    assert argv[2] % 64 == 0 and ctypes.string_at(argv[2], 128) == other[0]  # 2 fixed slots


def test_tensor_map_limits_are_checked_before_the_driver():
    from needle.backends.cuda import tensor_map

    tensor_map.check_tiled("bfloat16", 0x1000, (4096, 4096, 1), (8192, 8192 * 4096),
                           (64, 256, 1))
    with pytest.raises(DeviceError, match="16-byte aligned"):
        tensor_map.check_tiled("bfloat16", 0x1008, (64, 64), (128,), (64, 64))
    with pytest.raises(DeviceError, match="multiples of 16"):
        tensor_map.check_tiled("float16", 0x1000, (60, 64), (120,), (64, 64))
    with pytest.raises(DeviceError, match="swizzle"):
        tensor_map.check_tiled("float32", 0x1000, (64, 64), (256,), (64, 64))
    with pytest.raises(DeviceError, match="batch stride"):
        tensor_map.matrix_map("bfloat16", 0x1000, 128, 64, 3, 0, 128)


@tma
@pytest.mark.parametrize("groups", [None, 2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m,n,p", [(128, 64, 128), (300, 200, 520), (2048, 2048, 5632)])
def test_glu_gemm_writes_the_activation_in_one_pass(dtype, m, n, p, groups):
    """nd.matmul_swiglu on Hopper: one matmul_tma_glu launch (no product, no swiglu kernel),
    every output written (NaN poison through the workspace is impossible: none is used) and
    the float64 product's SwiGLU within the roundings of gate and up to the dtype (the
    product and then swiglu) and of the output; with one group an SM, and with two groups
    walking all the tiles."""
    npdt = nd.dtypes.to_numpy_dtype(dtype)
    x = on(RNG.standard_normal((m, n)).astype(npdt) / 4, dtype)
    w = on(RNG.standard_normal((2 * p, n)).astype(npdt) / 4, dtype)
    nd.matmul_swiglu(x, w)  # the first TMA product also zeroes the groups' tile counter
    with DEV.backend.tuned(tma_groups=groups), DEV.backend.profile() as prof:
        got = nd.matmul_swiglu(x, w)
    assert set(prof.totals) == {f"matmul_tma_glu_{_SFX[dtype]}"}, prof.table()
    product = x.numpy().astype(np.float64) @ w.numpy().astype(np.float64).T
    gate, up = product[:, :p], product[:, p:]
    want = gate / (1 + np.exp(-gate)) * up
    assert not np.isnan(got.numpy().astype(np.float32)).any()
    ulp = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11  # half an ulp, relative
    # gate and up each rounded (|silu'| <= 1.1), then the output: 1.1 + 1 + 1 half-ulps,
    # and the float32 sums' own error (far below a half-ulp of these magnitudes)
    bound = ulp * (1.1 * np.abs(gate * up) + 2 * np.abs(want)) + 1e-4 * (np.abs(gate) + np.abs(up))
    assert np.all(np.abs(got.numpy().astype(np.float64) - want) <= bound)


@tma
@pytest.mark.parametrize("m,kernel", [(127, "matmul_skinny_tc128_"), (128, "matmul_tma")])
def test_128_rows_fill_a_tma_tile_and_take_the_tma_gemm(m, kernel):
    """X @ W^T of up to 127 rows takes the skinny kernel (W read once); 128 rows fill the
    TMA GEMM's tile, which is faster there (1.3-2.3x on the H100's layer shapes)."""
    xv = RNG.standard_normal((m, 512)).astype(np.float32)
    wv = RNG.standard_normal((384, 512)).astype(np.float32)
    x, w = on(xv, "bfloat16"), on(wv, "bfloat16")
    with DEV.backend.profile() as prof:
        got = (x @ w.permute((1, 0))).numpy().astype(np.float64)
    assert any(name.startswith(kernel) for name in prof.totals), prof.table()
    assert relerr(got, xv.astype(np.float64) @ wv.astype(np.float64).T) < _TMA_TOL["bfloat16"]
