"""Prefill products with int8 / int4 weights on Hopper (kernels/quant_gemm.cu: W dequantized in
registers as the warpgroup MMA's operand) against the float64 product of the dequantized
matrix, and against the workspace form (dequantize + the GEMM, NEEDLE_QUANT_GEMM=off):
ragged tokens and rows, both bit widths, offsets, per-row and grouped scales, tiles whole and
split between the grid's groups (stream-K); and which products "auto" gives it."""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backends.cuda import compiler
from needle.backends.cuda import quant_gemm as qgm
from needle.backends.gpu.array import cdiv
from needle.quant.format import QuantSpec
from tests.conftest import assert_close

DEV = nd.cuda(0)
HOPPER = DEV.enabled() and DEV.backend.tuning.tma
needs_hopper = pytest.mark.skipif(not HOPPER,
                                  reason="the quantized GEMM needs an sm_90a GPU (Hopper)")


@pytest.fixture(autouse=True)
def _always():
    """By default the kernel takes only products whose tiles fill the GPU; these tests give it
    small ones too (NEEDLE_QUANT_GEMM=always)."""
    if not HOPPER:
        yield
        return
    with DEV.backend.tuned(quant_gemm="always"):
        yield


def _case(m, n, k, bits, group, symmetric, dtype):
    rng = np.random.default_rng(zlib.crc32(repr((m, n, k, bits, group, symmetric)).encode()))
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    w[0, :3] = [0.5, -0.4, 0.0]  # an outlier in the first group
    w[-1, -5:] = [0.3, 0.0, -0.6, 0.1, 0.2]  # and in the last row's last group
    packed = nd.QuantizedMatrix.quantize(w, bits, group, symmetric, device=DEV)
    x = nd.array(rng.standard_normal((m, k)).astype(np.float32), device=DEV, dtype=dtype)
    return x, packed


def _exact(x, packed, dtype):
    """The float64 product with W's float32 values, or (dtype) with W rounded to dtype."""
    return x.numpy().astype(np.float64) @ packed.dequantize(dtype).numpy().astype(np.float64).T


def _reference(x, packed, mode, dtype):
    """The float64 product a kernel's numbers are held to: the exact form ("g") multiplies
    W's float32 values (rounded nowhere), the dequantizing forms W rounded to dtype."""
    return _exact(x, packed, "float32" if mode == "g" else dtype)


def _kernels(x, packed):
    with DEV.backend.profile() as prof:
        got = nd.quant_matmul(x, packed).numpy().astype(np.float64)
    # less the zeroing of the tiles' counters at the process's first use
    return got, {name for name in prof.totals if not name.startswith("fill_")}


@pytest.fixture(params=[128, 256], ids=["tokens128", "tokens256"])
def tokens(request, monkeypatch):
    """Tokens a tile: every product below runs with either tile (the host's rule moved)."""
    monkeypatch.setattr(qgm, "token_tile", lambda m, n, sms: request.param)
    return request.param


def _mode(bits, group, symmetric, k, tokens):
    """The kernel's suffix: offsets ("o"); with 128 tokens a tile, symmetric groups of one a
    row, or of whole 64-value k steps (int4: of 128 values or more), summed exactly and
    scaled once ("g"); smaller groups, and any with 256 tokens, dequantized value by value."""
    per_row = group is None or group >= k
    if not symmetric:
        return "o"
    exact = tokens == 128 and (per_row or group >= (128 if bits == 4 else 64))
    return "g" if exact else ""


def _name(bits, group, symmetric, k, dtype, tokens):
    """The kernel a product takes: 256 tokens a tile ("_t256", 64-value steps); with 128, int4
    dequantized value by value with 128-value k steps ("_k128") where k is a multiple of 128
    and a step's groups fit the scale box (groups of 32 or more); 64-value steps otherwise
    (int8 and the exact form always)."""
    mode = _mode(bits, group, symmetric, k, tokens)
    wide = bits == 4 and mode != "g" and k % 128 == 0 and (group is None or group >= 32)
    tile = "_t256" if tokens == 256 else "_k128" if wide else ""
    return f"qgemm{bits}{mode}{tile}_{'bf16' if dtype == 'bfloat16' else 'f16'}"


@needs_hopper
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m,n,k,bits,group,symmetric", [
    (17, 128, 64, 4, 64, True),  # the fewest rows it takes, one k step, one group a row
    (130, 200, 256, 4, 32, False),  # ragged tokens and rows, two groups a k step, offsets
    (512, 384, 2048, 4, 128, True),  # a prefill's shape: a group over two k steps
    (300, 130, 256, 4, 16, True),  # four groups a k step
    (257, 256, 5632, 4, 64, False),  # the down projection's k
    (64, 136, 320, 8, None, True),  # int8 per row (one scale a row)
    (200, 300, 512, 8, 32, True),  # int8 in groups of 32 (GGUF Q8_0's form)
    (129, 64, 1024, 8, 256, True),  # int8 in groups over four k steps
    (1100, 2048, 512, 4, 128, True),  # more tiles than multiprocessors: groups walk several
    (200, 256, 2048, 8, None, True),  # int8 per row, each tile split between 3-4 groups
    (300, 256, 4096, 4, 256, True),  # groups over four k steps, tiles split on group bounds
    (140, 192, 1024, 4, 64, True),  # int4 groups of 64: dequantized in 128-value steps
    (100, 256, 192, 4, None, True),  # int4 per row, k an odd number of 64-value steps
    (90, 256, 1024, 4, None, True),  # int4 per row, k a multiple of 128 (exact: 64-value steps)
    (150, 128, 448, 4, 16, False),  # offsets, k an odd number of 64-value steps
    (70, 256, 1536, 4, 128, True),  # groups of 128, twelve 128-value steps
    (260, 384, 2048, 4, 64, False),  # offsets in groups of 64: two groups a 128-value step
    (96, 320, 1024, 4, 32, True),  # int4 symmetric groups of 32: 128-value steps
    (120, 256, 1024, 4, None, False),  # int4 per row with offsets: 128-value steps
])
def test_many_rows_dequantize_in_registers(m, n, k, bits, group, symmetric, dtype, tokens):
    x, packed = _case(m, n, k, bits, group, symmetric, dtype)
    got, kernels = _kernels(x, packed)
    mode = _mode(bits, group, symmetric, k, tokens)
    (name,) = kernels
    assert name == _name(bits, group, symmetric, k, dtype, tokens), kernels
    assert_close(got, _reference(x, packed, mode, dtype), dtype, "matmul")
    with DEV.backend.tuned(quant_gemm="off"):
        before, old = _kernels(x, packed)
    assert not any(name.startswith("qgemm") for name in old), old
    # the workspace form's products are those of W rounded to dtype: the same as the
    # dequantizing modes' (sums in another order); "g" is a weight's rounding from it
    assert_close(got, before, dtype, "matmul", scale=2.0 if mode == "g" else None)


def test_k_step_rule_and_shared_memory():
    """The host's choice of tile, form and k step (no GPU needed): 256 tokens a tile for
    products of many tiles (dequantizing, 64-value steps); with 128, 128-value steps for int4
    dequantized value by value where k allows it and the scale box holds a step's groups,
    the exact form for int4 from groups of 128, int8 from 64; every kernel's stages fit
    Hopper's 227 KiB of shared memory a group, as many as the kernel's."""
    wide, short, t128, t256 = qgm.WIDE_STEP, qgm.K_STEP, qgm.TOKENS, qgm.WIDE_TOKENS
    # 256 tokens where every group gets a whole tile and m pads no further than with 128
    assert qgm.token_tile(512, 11264, 132) == t256  # 176 tiles
    assert qgm.token_tile(512, 2048, 132) == t128  # 32 tiles: split between groups
    assert qgm.token_tile(384, 11264, 132) == t128  # 2 tiles of 256 rows pad 384 to 512
    assert qgm.token_tile(700, 11264, 132) == t256 and qgm.token_tile(16, 1 << 16, 132) == t128
    # "auto" beyond 768 rows: 256-token tiles, two or more a group (1.1B gate/up at 2,048
    # tokens: 704 tiles), not fewer (q/k/v: 160)
    assert qgm.takes(2048, 704, 2048, 132, t256) and not qgm.takes(2048, 160, 2048, 132, t256)
    assert not qgm.takes(2049, 704, 2048, 132, t256) and not qgm.takes(1024, 999, 2048, 132, t128)
    assert qgm.takes(768, 96, 5632, 132, t128) and not qgm.takes(512, 80, 2048, 132, t128)
    assert qgm.k_step(4, 2048, 64, False, False, t128) == wide  # int4 + offsets, groups of 64
    assert qgm.k_step(4, 2048, 32, False, False, t128) == wide  # four groups a step: the box
    assert qgm.k_step(4, 2048, 16, False, False, t128) == short  # eight: more than the box
    assert qgm.k_step(4, 448, 32, False, False, t128) == short  # k odd in 64-value steps
    assert qgm.k_step(4, 2048, 128, False, True, t128) == short  # the exact form
    assert qgm.k_step(8, 2048, 32, False, False, t128) == short  # int8: 64-value steps
    assert qgm.k_step(4, 2048, 64, False, False, t256) == short  # 256 tokens: 64-value steps
    assert qgm.exact_form(4, 128, False, False, t128) and qgm.exact_form(8, 64, False, False, t128)
    assert not qgm.exact_form(4, 64, False, False, t128)  # int4 g64: dequantized
    assert qgm.exact_form(4, 64, True, False, t128)
    assert not qgm.exact_form(4, 256, False, True, t128)  # offsets
    assert not qgm.exact_form(8, None, True, False, t256)  # 256 tokens: never exact
    for kt, tk in qgm.STAGES:
        for bits in (4, 8):
            assert qgm.shared_bytes(bits, kt, tk) <= 227 * 1024
    assert qgm.kernel_name(4, "bfloat16", True, False, wide, t128) == "qgemm4o_k128_bf16"
    assert qgm.kernel_name(8, "float16", True, False, short, t128) == "qgemm8o_f16"
    assert qgm.kernel_name(8, "float16", False, False, short, t256) == "qgemm8_t256_f16"
    # the kernel's stage counts are the host's (which sizes shared memory from them)
    source = (compiler.KERNEL_DIR / "quant_gemm.cu").read_text()
    (found,) = re.findall(r"return TK == 256 \? (\d+) : KT == 64 \? (\d+) : (\d+);", source)
    assert {(short, t256): int(found[0]), (short, t128): int(found[1]),
            (wide, t128): int(found[2])} == qgm.STAGES


@needs_hopper
def test_auto_takes_short_products_and_long_shares():
    """"auto" (the default): up to 256 rows of x take the kernel; up to 768 where each
    multiprocessor's share is a 2,048-wide tile's k steps or more; up to 2,048 where every
    multiprocessor gets two or more 256-token tiles; other products the workspace form."""
    sms = DEV.backend.device.compute_units
    wide = 128 * (sms // 4 + 1)  # 512 rows: a few more tiles than multiprocessors
    t128, t256 = "qgemm4_k128_bf16", "qgemm4_t256_bf16"
    many = 256 * cdiv(sms, 4)  # 1,024 rows: two 256-token tiles a multiprocessor or more
    for m, n, k, name in [(40, 256, 256, t128), (256, 256, 256, t128), (512, 256, 256, None),
                          (512, wide, 2048, t128), (769, wide, 2048, None),
                          (1024, many, 1024, t256), (2049, many, 1024, None)]:
        x, packed = _case(m, n, k, 4, 64, True, "bfloat16")
        with DEV.backend.tuned(quant_gemm="auto"):
            got, kernels = _kernels(x, packed)
        # int4 groups of 64: a dequantizing kernel, W rounded to x's dtype either way
        taken = {kernel for kernel in kernels if kernel.startswith("qgemm")}
        assert taken == ({name} if name else set()), (m, n, k, kernels)
        assert_close(got, _exact(x, packed, "bfloat16"), "bfloat16", "matmul")


@needs_hopper
@pytest.mark.parametrize("m,n,k,group", [(512, 256, 2048, 128), (64, 2048, 2048, 128),
                                         (9, 128, 8192, None)])
def test_split_tiles_sum_the_same_every_call(m, n, k, group):
    """Tiles split between groups are summed by their owner (the group holding the first k
    steps), the parts added in group order: repeated calls (and a captured graph's replays)
    give the same bits, and the tiles' counters are left at zero for the next launch."""
    x, packed = _case(m, n, k, 4, group, True, "bfloat16")
    first = nd.quant_matmul(x, packed).numpy()
    for _ in range(3):
        assert np.array_equal(nd.quant_matmul(x, packed).numpy(), first)
    with DEV.backend.capture() as graph:  # two launches back to back, each left ready
        a, b = nd.quant_matmul(x, packed), nd.quant_matmul(x, packed)
    try:
        for _ in range(3):
            graph.replay()
            assert np.array_equal(a.numpy(), first) and np.array_equal(b.numpy(), first)
    finally:
        graph.close()
    # the exact form's W is float32; the dequantizing form's (256 tokens a tile) bfloat16
    mode = _mode(4, group, True, k, qgm.token_tile(m, n, DEV.backend.device.compute_units))
    assert_close(first.astype(np.float64), _reference(x, packed, mode, "bfloat16"), "bfloat16",
                 "matmul")
    counters = DEV.backend._counter_array
    assert counters is not None
    assert not DEV.backend.to_numpy(counters, (counters.size,), (1,), 0).any()


@needs_hopper
@pytest.mark.parametrize("bits,group", [(4, 128), (8, 64), (4, None), (8, None)])
def test_zero_groups_and_scales_far_apart(bits, group, tokens):
    """Groups of scale 0 (whose packed integers, never zero here, must add nothing) and
    scales 2^-40 to 2^40 apart within a row, in the exact form ("g": each group's sums scaled
    into a total) and with 256 tokens a tile (W's values dequantized to bfloat16)."""
    m, n, k = 300, 256, 1024
    rng = np.random.default_rng(bits * 1000 + (group or 0))
    spec = QuantSpec(bits, group or k, False)
    groups = spec.groups(k)
    words = rng.integers(0, 2**32, size=(n, spec.words(k)), dtype=np.uint64).astype(np.uint32)
    scales = np.exp2(rng.integers(-40, 41, size=(n, groups))).astype(np.float32)
    scales *= rng.uniform(1, 2, size=scales.shape).astype(np.float32)
    scales[::3, groups // 2] = 0.0  # every third row's middle group (per row: the row)
    scales[5, :] = 0.0  # a row of zero groups only
    packed = nd.QuantizedMatrix.from_packed(words, scales, None, spec, k, device=DEV)
    x = nd.array(rng.standard_normal((m, k)).astype(np.float32), device=DEV, dtype="bfloat16")
    got, kernels = _kernels(x, packed)
    mode = _mode(bits, group, True, k, tokens)
    assert kernels == {_name(bits, group, True, k, "bfloat16", tokens)}
    want = _reference(x, packed, mode, "bfloat16")
    assert np.isfinite(got).all() and not got[:, 5].any()
    # each output column (a row of W) against its own largest value: rows are 2^80 apart
    big = np.abs(want).max(axis=0, keepdims=True) + np.finfo(np.float32).tiny
    assert_close(got / big, want / big, "bfloat16", "matmul")


@needs_hopper
@pytest.mark.parametrize("group,name", [(128, "qgemm4g_bf16"), (32, "qgemm4_k128_bf16")])
def test_non_finite_x_gives_non_finite_rows(group, name):
    x, packed = _case(40, 128, 512, 4, group, True, "bfloat16")
    host = x.numpy().astype(np.float32)
    host[3, 5], host[7, 100] = np.inf, np.nan
    got, kernels = _kernels(nd.array(host, device=DEV, dtype="bfloat16"), packed)
    assert kernels == {name}
    assert not np.isfinite(got[3]).any() and np.isnan(got[7]).all()
    assert np.isfinite(np.delete(got, [3, 7], axis=0)).all()


@needs_hopper
def test_other_products_keep_their_forms():
    """float32 x, k not a multiple of 64, groups that are no power of two and a group count
    that is no multiple of 4 take the workspace form, with the same numbers."""
    for m, n, k, bits, group, dtype in [(40, 64, 256, 4, 64, "float32"),
                                        (40, 64, 96, 4, 32, "bfloat16"),
                                        (40, 64, 384, 8, 48, "bfloat16"),
                                        (40, 64, 384, 4, 64, "bfloat16")]:
        x, packed = _case(m, n, k, bits, group, True, dtype)
        got, kernels = _kernels(x, packed)
        assert not any(name.startswith("qgemm") for name in kernels), (m, k, group, kernels)
        assert_close(got, _exact(x, packed, dtype), dtype, "matmul", scale=float(np.sqrt(k)))


@needs_hopper
def test_an_empty_k_gives_zeros():
    """k = 0 (a product of nothing): zeros, by the workspace form (the kernel's shares would
    hold no work and leave out unwritten)."""
    packed = nd.QuantizedMatrix.quantize(np.zeros((64, 0), np.float32), 4, 64, True, device=DEV)
    x = nd.array(np.zeros((40, 0), np.float32), device=DEV, dtype="bfloat16")
    got, kernels = _kernels(x, packed)
    assert not any(name.startswith("qgemm") for name in kernels), kernels
    assert got.shape == (40, 64) and not got.any()
