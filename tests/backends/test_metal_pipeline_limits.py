"""Per-pipeline limits through the MSL emulator: each pipeline reports its own static
threadgroup memory (the kernel's ``threadgroup`` variables) and its own
``maxTotalThreadsPerThreadgroup`` (chosen per pipeline in tests, as register pressure does on
a Mac); kernels whose tiles need 256 threads fall back to smaller tiles below that.

The whole suite also runs with every pipeline at 256 and 128 threads in CI
(``NEEDLE_METAL_EMULATOR_MAX_THREADS``; .github/workflows/metal-emulated.yml).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import needle.backend_ndarray as nd

METAL = nd.metal()
pytestmark = pytest.mark.skipif(
    not METAL.enabled() or not getattr(sys.modules.get("Metal"), "NEEDLE_EMULATOR", False),
    reason="needs metal() through the MSL emulator (NEEDLE_METAL_EMULATOR=1)")


def _backend(monkeypatch, limits: dict[str, int]):
    """A fresh Metal backend whose pipelines report the given thread limits."""
    import Metal

    from needle.backends.metal.backend import MetalBackend
    from needle.backends.metal.device import MetalDevice

    monkeypatch.setattr(Metal, "pipeline_limits", dict(limits))
    return MetalBackend(MetalDevice(Metal))


def test_pipelines_report_their_static_threadgroup_memory():
    kernels = METAL.backend.device.executables
    assert kernels.kernel("nn", "attention_f32").static_shared == 32 * 32 * 4  # probs
    assert kernels.kernel("matmul", "matmul_nn_f32").static_shared == 2 * 128 * 16 * 4
    assert kernels.kernel("matmul", "matmul_i64").static_shared == 2 * 16 * 17 * 8
    assert kernels.kernel("nn", "softmax_f32").static_shared == 0


@pytest.mark.parametrize("head_dim, fused", [(74, True), (75, False)])
def test_fused_attention_cut_off_counts_static_memory(head_dim, fused):
    """(96 * head_dim + 32) * 4 bytes of tiles plus 4 KiB of probabilities must fit 32 KiB:
    head_dim 74 is the largest fused one, as on a Mac."""
    rng = np.random.default_rng(0)
    q, k, v = (nd.array(rng.standard_normal((1, 2, 3, head_dim)).astype(np.float32),
                        device=METAL) for _ in range(3))
    with METAL.backend.profile() as prof:
        out = nd.attention(q, k, v).numpy()
    kernel = METAL.backend.device.executables.kernel("nn", "attention_f32")
    assert ("attention_f32" in prof.totals) == (fused and kernel.max_threads >= 256)
    qn, kn, vn = (x.numpy() for x in (q, k, v))
    s = qn @ kn.transpose(0, 1, 3, 2) / np.sqrt(head_dim)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(out, p / p.sum(axis=-1, keepdims=True) @ vn, rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("limit", [128, 64, 32])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int32"])
def test_matmul_tiles_fall_back_below_256_threads(monkeypatch, limit, dtype):
    small = _backend(monkeypatch, {"matmul_*": limit})
    kernel = small.device.executables.kernel("matmul", "matmul_nn_f32")
    assert kernel.max_threads == limit
    rng = np.random.default_rng(1)
    a = rng.integers(-3, 4, (37, 45)).astype(dtype)
    b = rng.integers(-3, 4, (45, 29)).astype(dtype)
    x, y, out = small.Array(a.size, dtype), small.Array(b.size, dtype), small.Array(37 * 29, dtype)
    small.from_numpy(a, x)
    small.from_numpy(b, y)
    small.matmul(x, y, out, 37, 45, 29)
    got = small.to_numpy(out, (37, 29), (29, 1), 0)
    np.testing.assert_array_equal(got, (a.astype(np.float64) @ b).astype(dtype))


def test_attention_falls_back_below_256_threads(monkeypatch):
    small = _backend(monkeypatch, {"attention_*": 128, "matmul_*": 128})
    assert small.device.executables.kernel("nn", "attention_f32").max_threads == 128
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 4, 5, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 5, 16)).astype(np.float32)
    arrays = []
    for a in (q, k, v):
        arrays.append(small.Array(a.size, "float32"))
        small.from_numpy(a, arrays[-1])
    out = small.Array(q.size, "float32")
    small.attention(*arrays, out, 1, 4, 2, 5, 5, 5, 16, 0.25, True)
    kk, vv = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    s = q @ kk.transpose(0, 1, 3, 2) * 0.25 + np.triu(np.full((5, 5), -np.inf), 1)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(small.to_numpy(out, q.shape, (80 * 4, 80, 16, 1), 0),
                               p / p.sum(axis=-1, keepdims=True) @ vv, rtol=1e-4, atol=1e-6)


def test_limit_rules_from_the_environment(monkeypatch):
    import Metal

    monkeypatch.setenv("NEEDLE_METAL_EMULATOR_MAX_THREADS", "matmul_*=128, *=512")
    assert Metal.thread_limit("matmul_nn_f32", 1024) == 128
    assert Metal.thread_limit("softmax_f32", 1024) == 512
    monkeypatch.setenv("NEEDLE_METAL_EMULATOR_MAX_THREADS", "96")
    assert Metal.thread_limit("softmax_f32", 1024) == 96
    monkeypatch.setenv("NEEDLE_METAL_EMULATOR_MAX_THREADS", "100")
    with pytest.raises(ValueError, match="multiple of 32"):
        Metal.thread_limit("softmax_f32", 1024)
    monkeypatch.delenv("NEEDLE_METAL_EMULATOR_MAX_THREADS")
    assert Metal.thread_limit("softmax_f32", 672) == 672  # no rule: the derived limit
