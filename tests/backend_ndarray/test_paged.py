"""The paged-attention family (capability ``paged_attention``) on every enabled device
against the reference (numpy_ref/paged.py), and the reference against plain attention."""

from __future__ import annotations

import numpy as np
import pytest

from needle import backend_ndarray as nd
from needle.errors import ArgumentError, IndexOutOfRangeError, ShapeError

from ..conftest import check_unsupported_dtype

TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}


def _pool(rng, num_pages, page_size, kv_heads, d):
    return (rng.standard_normal((num_pages, page_size, kv_heads, d)).astype(np.float32),
            rng.standard_normal((num_pages, page_size, kv_heads, d)).astype(np.float32))


def _case(rng, q_heads=4, kv_heads=2, d=16, page_size=4, num_pages=48):
    """Three sequences of lengths 1, 9 and 150 (more than one 128-position chunk) on shuffled
    pages; queries: the last position of each, and three prompt positions of the third."""
    lengths = [1, 9, 150]
    max_pages = -(-max(lengths) // page_size)
    order = rng.permutation(num_pages)
    tables = -np.ones((3, max_pages), np.int32)
    used = 0
    for s, n in enumerate(lengths):
        need = -(-n // page_size)
        tables[s, :need] = order[used:used + need]
        used += need
    seq_of = np.array([0, 1, 2, 2, 2, 2], np.int32)
    positions = np.array([0, 8, 149, 0, 5, 127], np.int32)
    q = rng.standard_normal((len(seq_of), q_heads, d)).astype(np.float32)
    kp, vp = _pool(rng, num_pages, page_size, kv_heads, d)
    return q, kp, vp, tables, seq_of, positions


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_paged_attention_matches_reference(device, dtype, rng):
    if check_unsupported_dtype(device, dtype):  # the refusal checked instead
        return
    q, kp, vp, tables, seq_of, positions = _case(rng)
    ref = nd.cpu_numpy()

    def run(dev):
        a = [nd.array(x, dtype=dtype, device=dev) for x in (q, kp, vp)]
        return nd.paged_attention(a[0], a[1], a[2], tables, seq_of, positions, 0.3).numpy()

    want, got = run(ref), run(device)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                               rtol=TOL[dtype], atol=TOL[dtype])


def _model_case(rng, q_heads, kv_heads, d, lengths, page_size=16):
    """Sequences of ``lengths`` on shuffled pages of 16 positions, one query per sequence at
    its last position plus two earlier queries of the longest: a serving step's shapes."""
    max_pages = -(-max(lengths) // page_size)
    num_pages = sum(-(-n // page_size) for n in lengths) + 3
    order = rng.permutation(num_pages)
    tables, used = -np.ones((len(lengths), max_pages), np.int32), 0
    for s, n in enumerate(lengths):
        need = -(-n // page_size)
        tables[s, :need] = order[used:used + need]
        used += need
    longest = int(np.argmax(lengths))
    seq_of = np.array(list(range(len(lengths))) + [longest, longest], np.int32)
    positions = np.array([n - 1 for n in lengths] + [63, 64], np.int32)
    q = rng.standard_normal((len(seq_of), q_heads, d)).astype(np.float32)
    kp, vp = _pool(rng, num_pages, page_size, kv_heads, d)
    return q, kp, vp, tables, seq_of, positions


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads", [(32, 4, 64), (8, 1, 128), (12, 12, 64), (16, 2, 80),
                                   (4, 1, 256), (8, 4, 256)], ids=str)
def test_paged_attention_model_shapes(device, dtype, heads, rng):
    """Head sizes 64, 128 and 256 (Gemma's) with 1 to 16 query heads per KV head over
    sequences of 1 to 700 positions (CUDA: the flash kernel, its ranges merged in the kernel
    for the long ones, at 256 in half types only; head size 80 takes the general kernel)."""
    if check_unsupported_dtype(device, dtype):  # the refusal checked instead
        return
    q, kp, vp, tables, seq_of, positions = _model_case(rng, *heads, [1, 17, 130, 700, 64])

    def run(dev):
        a = [nd.array(x, dtype=dtype, device=dev) for x in (q, kp, vp)]
        return nd.paged_attention(a[0], a[1], a[2], tables, seq_of, positions,
                                  heads[2] ** -0.5).numpy()

    want, got = run(nd.cpu_numpy()), run(device)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                               rtol=TOL[dtype], atol=TOL[dtype])
    bad = tables.copy()
    bad[3, 40] = -1  # a hole far into the longest sequence: NaN for its queries only
    a = [nd.array(x, dtype=dtype, device=device) for x in (q, kp, vp)]
    out = nd.paged_attention(a[0], a[1], a[2], bad, seq_of, positions).numpy()
    hit = np.isin(np.arange(len(seq_of)), [3])  # positions 63, 64 of seq 3 end before page 40
    assert np.isnan(out[hit]).all() and not np.isnan(out[~hit]).any()


def test_reference_equals_dense_causal_attention(rng):
    """Pages gathered in table order are the dense cache: plain attention agrees."""
    q, kp, vp, tables, seq_of, positions = _case(rng)
    dev = nd.cpu_numpy()
    got = nd.paged_attention(*(nd.array(x, device=dev) for x in (q, kp, vp)), tables, seq_of,
                             positions, 0.3).numpy()
    for t, (s, p) in enumerate(zip(seq_of, positions)):
        slots = tables[s][np.arange(p + 1) // 4] * 4 + np.arange(p + 1) % 4
        k = kp.reshape(-1, 2, 16)[slots].transpose(1, 0, 2)[None]  # (1, kv, p+1, d)
        v = vp.reshape(-1, 2, 16)[slots].transpose(1, 0, 2)[None]
        dense = nd.attention(nd.array(q[t][None, :, None, :], device=dev),
                             nd.array(k, device=dev), nd.array(v, device=dev), scale=0.3,
                             causal=True).numpy()
        np.testing.assert_allclose(got[t], dense[0, :, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_write_stores_rows_and_skips_padding(device, dtype, rng):
    if check_unsupported_dtype(device, dtype):  # the refusal checked instead
        return
    kp, vp = (nd.array(np.zeros((5, 4, 2, 8), np.float32), dtype=dtype, device=device)
              for _ in range(2))
    k = rng.standard_normal((3, 2, 8)).astype(np.float32)
    v = rng.standard_normal((3, 2, 8)).astype(np.float32)
    slots = np.array([7, -1, 19], np.int32)
    nd.paged_write(nd.array(k, dtype=dtype, device=device),
                   nd.array(v, dtype=dtype, device=device), slots, kp, vp)
    flat_k, flat_v = kp.numpy().reshape(20, 2, 8), vp.numpy().reshape(20, 2, 8)
    cast = nd.array(k, dtype=dtype, device=nd.cpu_numpy()).numpy()
    np.testing.assert_array_equal(flat_k[7], cast[0])
    np.testing.assert_array_equal(flat_k[19], cast[2])
    assert np.count_nonzero(flat_k.astype(np.float32)) == 2 * 16 - np.sum(cast[[0, 2]] == 0)
    np.testing.assert_array_equal(flat_v[7], nd.array(v, dtype=dtype,
                                                      device=nd.cpu_numpy()).numpy()[0])


def test_bad_page_ids_give_nan_and_bad_arguments_raise(device, rng):
    q, kp, vp, tables, seq_of, positions = _case(rng)
    a = [nd.array(x, device=device) for x in (q, kp, vp)]
    bad = tables.copy()
    bad[1, 0] = 10_000  # a page id outside the pool: NaN for sequence 1's query only
    out = nd.paged_attention(a[0], a[1], a[2], bad, seq_of, positions).numpy()
    assert np.isnan(out[1]).all() and not np.isnan(np.delete(out, 1, axis=0)).any()
    with pytest.raises(IndexOutOfRangeError, match="seq_of"):
        nd.paged_attention(a[0], a[1], a[2], tables, seq_of + 3, positions)
    with pytest.raises(IndexOutOfRangeError, match="positions"):
        nd.paged_attention(a[0], a[1], a[2], tables, seq_of, positions + 1000)
    with pytest.raises(ShapeError, match="q must be"):
        nd.paged_attention(a[0].reshape((6, 64)), a[1], a[2], tables, seq_of, positions)
    with pytest.raises(IndexOutOfRangeError, match="slot"):
        nd.paged_write(a[1][0, :1], a[1][0, :1], [500], a[1], a[2])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads,window", [((8, 2, 64), 70), ((4, 4, 128), 5),
                                          ((4, 1, 256), 40), ((16, 2, 80), 300)], ids=str)
def test_paged_attention_sliding_window(device, dtype, heads, window, rng):
    """A sliding window: token t attends to positions p - window + 1..p of its sequence
    (CUDA: the flash kernel's ranges over the window at head sizes 64 and 128, the general
    kernel's chunks from its start otherwise); the reference against plain windowed
    attention over the gathered cache."""
    if check_unsupported_dtype(device, dtype):  # the refusal checked instead
        return
    q, kp, vp, tables, seq_of, positions = _model_case(rng, *heads, [1, 17, 130, 700, 64])

    def run(dev, w):
        a = [nd.array(x, dtype=dtype, device=dev) for x in (q, kp, vp)]
        return nd.paged_attention(a[0], a[1], a[2], tables, seq_of, positions,
                                  heads[2] ** -0.5, w).numpy().astype(np.float64)

    want = run(nd.cpu_numpy(), window)
    np.testing.assert_allclose(run(device, window), want, rtol=TOL[dtype], atol=TOL[dtype])
    q_heads, kv_heads, d = heads
    dense = nd.cpu_numpy()
    for t, (s, p) in enumerate(zip(seq_of, positions)):  # the reference is plain attention
        lo = max(0, p - window + 1)
        j = np.arange(lo, p + 1)
        slots = tables[s][j // 16] * 16 + j % 16
        k = kp.reshape(-1, kv_heads, d)[slots].transpose(1, 0, 2)[None]
        v = vp.reshape(-1, kv_heads, d)[slots].transpose(1, 0, 2)[None]
        one = nd.attention(*(nd.array(x, dtype=dtype, device=dense)
                             for x in (q[t][None, :, None], k, v)), d ** -0.5).numpy()
        np.testing.assert_allclose(want[t], one.reshape(q_heads, d).astype(np.float64),
                                   rtol=TOL[dtype], atol=TOL[dtype])
    with pytest.raises(ArgumentError, match="window"):
        nd.paged_attention(*(nd.array(x, device=device) for x in (q, kp, vp)), tables, seq_of,
                           positions, None, 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads,window", [((8, 4, 256), None), ((8, 4, 256), 40),
                                          ((8, 2, 64), None), ((4, 4, 128), 70),
                                          ((16, 2, 80), None)], ids=str)
def test_paged_attention_soft_capped(device, dtype, heads, window, rng):
    """Gemma 2's soft-capped scores (cap · tanh(s / cap) after the scale): each device
    against the reference, and the reference against the cap applied by hand to the
    gathered cache (CUDA: the flash kernels at 64, 128 and 256, the general one at 80)."""
    if check_unsupported_dtype(device, dtype):  # the refusal checked instead
        return
    q, kp, vp, tables, seq_of, positions = _model_case(rng, *heads, [1, 17, 130, 700, 64])
    cap = 1.5

    def run(dev, softcap):
        a = [nd.array(x, dtype=dtype, device=dev) for x in (q, kp, vp)]
        return nd.paged_attention(a[0], a[1], a[2], tables, seq_of, positions, 0.5, window,
                                  softcap).numpy().astype(np.float64)

    want = run(nd.cpu_numpy(), cap)
    np.testing.assert_allclose(run(device, cap), want, rtol=TOL[dtype], atol=TOL[dtype])
    assert np.abs(run(nd.cpu_numpy(), None) - want).max() > 10 * TOL[dtype]  # the cap binds
    q_heads, kv_heads, d = heads
    rounded = [nd.array(x, dtype=dtype, device=nd.cpu_numpy()).numpy().astype(np.float64)
               for x in (q, kp, vp)]
    for t, (s, p) in enumerate(zip(seq_of, positions)):
        j = np.arange(max(0, p - window + 1) if window else 0, p + 1)
        slots = tables[s][j // 16] * 16 + j % 16
        k = rounded[1].reshape(-1, kv_heads, d)[slots].repeat(q_heads // kv_heads, axis=1)
        v = rounded[2].reshape(-1, kv_heads, d)[slots].repeat(q_heads // kv_heads, axis=1)
        scores = cap * np.tanh(np.einsum("hd,thd->ht", rounded[0][t], k) * 0.5 / cap)
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(want[t], np.einsum("ht,thd->hd", weights, v),
                                   rtol=TOL[dtype], atol=TOL[dtype])
    with pytest.raises(ArgumentError, match="softcap"):
        run(device, -1.0)
