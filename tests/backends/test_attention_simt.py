"""CUDA's float32 attention as tiled products (kernels/attention_simt.cu: head_dim 64, at
least 64 query rows a KV head) against float64, heads-first and token-major, with grouped
heads, causal and not, a KV cache longer than the keys used and rows that end mid-tile; and
that the kernel is the one that ran (nn.cu's attention_f32 takes the rest)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import needle.backend_ndarray as nd

DEV = nd.cuda(0)
pytestmark = pytest.mark.skipif(not DEV.enabled(), reason=f"cuda disabled: {DEV.reason}")

CASES = [  # batch, q_heads, kv_heads, q_len, kv_len, capacity, causal
    (2, 8, 8, 256, 256, 256, True),  # the GPT benchmark's layer, smaller batch
    (1, 4, 2, 100, 100, 128, True),  # grouped heads, rows that end mid-tile, a longer cache
    (2, 2, 1, 70, 200, 200, True),   # keys before the queries (a prefix in the cache)
    (1, 3, 3, 65, 130, 130, False),
    (1, 8, 1, 40, 40, 40, True),     # 320 rows of one KV head: tiles cross heads
]


def _reference(q, k, v, causal, kv_len):
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k[:, :, :kv_len], group, axis=1)
    v = np.repeat(v[:, :, :kv_len], group, axis=1)
    s = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        q_len = q.shape[2]
        allowed = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + (kv_len - q_len)
        s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _inputs(case, rng):
    b, hq, hkv, q_len, kv_len, cap, causal = case
    q = rng.standard_normal((b, hq, q_len, 64)).astype(np.float32)
    k = rng.standard_normal((b, hkv, cap, 64)).astype(np.float32)
    v = rng.standard_normal((b, hkv, cap, 64)).astype(np.float32)
    return q, k, v, _reference(*(x.astype(np.float64) for x in (q, k, v)), causal, kv_len)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}h{c[1]}/{c[2]}q{c[3]}kv{c[4]}"
                         f"{'c' if c[6] else ''}")
def test_heads_first_matches_float64(case):
    q, k, v, want = _inputs(case, np.random.default_rng(0))
    args = [nd.array(x, device=DEV) for x in (q, k, v)]
    with DEV.backend.profile() as prof:
        got = nd.attention(*args, causal=case[6], kv_len=case[4]).numpy()
    assert "attention_simt64_f32" in prof.totals
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"b{c[0]}h{c[1]}/{c[2]}q{c[3]}")
def test_token_major_rows_match_float64(case):
    """q as the query part of a fused QKV projection's rows; the output token-major."""
    b, hq, hkv, q_len, kv_len, cap, causal = case
    q, k, v, want = _inputs(case, np.random.default_rng(1))
    qkv = np.concatenate([q.transpose(0, 2, 1, 3),
                          np.zeros((b, q_len, 2 * hkv, 64), np.float32)], axis=2)
    rows = nd.array(qkv, device=DEV)
    qv = rows[:, :, :hq].permute((0, 2, 1, 3))
    with DEV.backend.profile() as prof:
        got = nd.attention(qv, nd.array(k, device=DEV), nd.array(v, device=DEV), causal=causal,
                           kv_len=kv_len)
    assert "attention_simt64_f32" in prof.totals and "compact_f32" not in prof.totals
    assert got.permute((0, 2, 1, 3)).is_compact()
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=2e-5)


def test_switched_off_the_other_kernel_agrees():
    case = CASES[1]
    q, k, v, want = _inputs(case, np.random.default_rng(2))
    args = [nd.array(x, device=DEV) for x in (q, k, v)]
    with DEV.backend.tuned(attention_simt=False):
        with DEV.backend.profile() as prof:
            other = nd.attention(*args, causal=True, kv_len=case[4]).numpy()
    assert "attention_simt64_f32" not in prof.totals and "attention_f32" in prof.totals
    simt = nd.attention(*args, causal=True, kv_len=case[4]).numpy()
    np.testing.assert_allclose(simt, other, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(other, want, rtol=2e-5, atol=2e-5)
