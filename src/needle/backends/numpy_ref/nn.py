"""Transformer functions: softmax, norms, RoPE, the SwiGLU gates and attention."""

from __future__ import annotations

import numpy as np

from .core import Array, _f, _store, _view
from .elementwise import _sigmoid
from .reduce import matmul

# --- transformer ------------------------------------------------------------------------
# Row functions see compact (rows, dim) inputs and work along the last axis.

def softmax(a: Array, out: Array, dim: int) -> None:
    x = _f(a.array).reshape(-1, dim)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x - x.max(axis=1, keepdims=True))
        _store(out, (e / e.sum(axis=1, keepdims=True)).reshape(-1))


def log_softmax(a: Array, out: Array, dim: int) -> None:
    x = _f(a.array).reshape(-1, dim)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        z = x - x.max(axis=1, keepdims=True)
        _store(out, (z - np.log(np.exp(z).sum(axis=1, keepdims=True))).reshape(-1))


def rmsnorm(x: Array, w: Array, out: Array, dim: int, eps: float) -> None:
    """out = x / sqrt(mean(x**2) + eps) * w, per row."""
    v = _f(x.array).reshape(-1, dim)
    r = 1 / np.sqrt((v * v).mean(axis=1, keepdims=True) + np.asarray(eps, v.dtype))
    _store(out, (v * r * _f(w.array)).reshape(-1))


def add_rmsnorm(x: Array, delta: Array, w: Array, total: Array, out: Array, dim: int,
                eps: float) -> None:
    """The pre-norm residual step in one pass, per row: ``total = x + delta`` (rounded to the
    dtype, as a separate add would), then ``out = rmsnorm(total) * w`` from the rounded sum.
    ``total`` may be ``x`` itself (the residual stream updated in place)."""
    s = (_f(x.array) + _f(delta.array)).astype(x.array.dtype)
    _store(total, s)
    v = _f(s).reshape(-1, dim)
    r = 1 / np.sqrt((v * v).mean(axis=1, keepdims=True) + np.asarray(eps, v.dtype))
    _store(out, (v * r * _f(w.array)).reshape(-1))


def add_rmsnorm_post(x: Array, delta: Array, dw: Array, w: Array, total: Array, out: Array,
                     dim: int, eps: float) -> None:
    """``add_rmsnorm`` of ``rmsnorm(delta) * dw`` (rounded to the dtype, as a separate rmsnorm
    would): Gemma 2's and 3's sandwich norms, the block's output normed before it joins the
    residual stream and the next pre-norm taken."""
    d = _f(delta.array).reshape(-1, dim)
    rd = 1 / np.sqrt((d * d).mean(axis=1, keepdims=True) + np.asarray(eps, d.dtype))
    normed = (d * rd * _f(dw.array)).astype(x.array.dtype).reshape(-1)
    s = (_f(x.array) + _f(normed)).astype(x.array.dtype)
    _store(total, s)
    v = _f(s).reshape(-1, dim)
    r = 1 / np.sqrt((v * v).mean(axis=1, keepdims=True) + np.asarray(eps, v.dtype))
    _store(out, (v * r * _f(w.array)).reshape(-1))


def layernorm(x: Array, w: Array, b: Array, out: Array, dim: int, eps: float) -> None:
    """out = (x - mean) / sqrt(var + eps) * w + b, per row (biased variance)."""
    v = _f(x.array).reshape(-1, dim)
    mu = v.mean(axis=1, keepdims=True)
    var = ((v - mu) ** 2).mean(axis=1, keepdims=True)
    y = (v - mu) / np.sqrt(var + np.asarray(eps, v.dtype)) * _f(w.array) + _f(b.array)
    _store(out, y.reshape(-1))


def rope(x: Array, cos: Array, sin: Array, out: Array,
         batch: int, seq: int, heads: int, head_dim: int) -> None:
    """Rotary embedding, half-split layout, on x of shape (batch, seq, heads, head_dim).

    cos and sin are (seq, head_dim // 2). With x1, x2 the two halves of the last axis:
    out = concat(x1*cos - x2*sin, x2*cos + x1*sin).
    """
    v = _f(x.array).reshape(batch, seq, heads, head_dim)
    h = head_dim // 2
    c = _f(cos.array).reshape(1, seq, 1, h)
    s = _f(sin.array).reshape(1, seq, 1, h)
    x1, x2 = v[..., :h], v[..., h:]
    _store(out, np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(-1))


def silu_mul(a: Array, b: Array, out: Array) -> None:
    """out = silu(a) * b (SwiGLU's gate)."""
    x = _f(a.array)
    _store(out, x * _sigmoid(x) * _f(b.array))


def swiglu(x: Array, out: Array, dim: int) -> None:
    """out = silu(x[:, :dim]) * x[:, dim:] per row of x (rows, 2 * dim): ``silu_mul`` of the
    two halves of a fused gate-and-up projection, without splitting it first."""
    v = _f(x.array).reshape(-1, 2 * dim)
    a = v[:, :dim]
    _store(out, (a * _sigmoid(a) * v[:, dim:]).reshape(-1))


def qk_rmsnorm(x: Array, q_weight: Array, k_weight: Array, out: Array, rows: int,
               q_heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
    """The per-head norms of a fused q/k/v projection (Qwen3, Gemma 3): x holds ``rows``
    head rows of ``head_dim`` values, each token's q_heads query heads, then kv_heads key
    heads, then kv_heads value heads; query rows become rmsnorm(row) * q_weight, key rows
    rmsnorm(row) * k_weight (as ``rmsnorm``: float32, rounded once), value rows are copied."""
    heads = q_heads + 2 * kv_heads
    v = _f(x.array).reshape(-1, heads, head_dim)
    r = 1 / np.sqrt((v * v).mean(axis=2, keepdims=True) + np.asarray(eps, v.dtype))
    w = np.concatenate([np.broadcast_to(_f(q_weight.array), (q_heads, head_dim)),
                        np.broadcast_to(_f(k_weight.array), (kv_heads, head_dim))])
    y = v.copy()
    y[:, :q_heads + kv_heads] = v[:, :q_heads + kv_heads] * r[:, :q_heads + kv_heads] * w
    _store(out, y.reshape(-1))


def geglu(x: Array, out: Array, dim: int) -> None:
    """out = gelu_tanh(x[:, :dim]) * x[:, dim:] per row of x (rows, 2 * dim): the GeGLU of
    a fused gate-and-up projection (Gemma), GELU in PyTorch's tanh form
    0.5 a (1 + tanh(sqrt(2 / pi) (a + 0.044715 a^3))), computed in float32 (float64 for
    float64) and rounded once."""
    v = _f(x.array).reshape(-1, 2 * dim)
    a = v[:, :dim]
    inner = (a + a * a * a * 0.044715) * np.sqrt(2 / np.pi).astype(a.dtype)
    _store(out, (a * (np.tanh(inner) + 1) * 0.5 * v[:, dim:]).reshape(-1))


def matmul_swiglu(a: Array, w: Array, out: Array, m: int, n: int, p: int) -> None:
    """out (m, p) = swiglu(a @ wᵀ) for a (m, n) and a fused gate/up weight w (2p, n), gate
    rows first (capability ``matmul_swiglu``): the product is rounded to the dtype before
    the activation, so the numbers are those of ``matmul`` then ``swiglu``."""
    _product_then(swiglu, a, w, out, m, n, p)


def matmul_geglu(a: Array, w: Array, out: Array, m: int, n: int, p: int) -> None:
    """``matmul_swiglu`` with Gemma's GeGLU (capability ``matmul_geglu``): the numbers of
    ``matmul`` then ``geglu``."""
    _product_then(geglu, a, w, out, m, n, p)


def _product_then(gated, a: Array, w: Array, out: Array, m: int, n: int, p: int) -> None:
    """The (m, 2p) gate/up product, rounded to the dtype, then ``gated`` (swiglu, geglu)."""
    product = Array(m * 2 * p, out.dtype)
    matmul(a, w, product, m, n, 2 * p, transpose_b=True)
    gated(product, out, p)


def attention(q: Array, k: Array, v: Array, out: Array, batch: int, q_heads: int,
              kv_heads: int, q_len: int, kv_len: int, kv_capacity: int, head_dim: int,
              scale: float, causal: bool, window: int = 0, softcap: float = 0.0) -> None:
    """Scaled dot-product attention with grouped-query heads.

    q and out are (batch, q_heads, q_len, head_dim); k and v are (batch, kv_heads,
    kv_capacity, head_dim) of which the first kv_len positions are used (a KV cache).
    Query head h reads KV head h // (q_heads // kv_heads). With ``causal``, query i sits at
    position kv_len - q_len + i and sees keys j <= that position; with a sliding ``window``
    > 0 also only keys j > that position - window. With ``softcap`` > 0 (Gemma 2) the scaled
    scores s become softcap · tanh(s / softcap) before the mask and the softmax.
    """
    qq = _f(q.array).reshape(batch, q_heads, q_len, head_dim)
    _store(out, _attend(qq, k, v, kv_heads, kv_len, kv_capacity, scale, causal, window,
                        softcap).reshape(-1))


def attention_token_major(q: Array, k: Array, v: Array, out: Array, batch: int, q_heads: int,
                          kv_heads: int, q_len: int, kv_len: int, kv_capacity: int,
                          head_dim: int, scale: float, causal: bool, q_row: int,
                          window: int = 0, softcap: float = 0.0) -> None:
    """``attention`` with q and out in token-major rows (capability
    ``token_major_attention``): query head h of position i in batch b starts at element
    (b * q_len + i) * q_row + h * head_dim of q (q_row >= q_heads * head_dim: the rows of a
    fused QKV projection, whose query heads come first); out is (batch, q_len, q_heads,
    head_dim). A prefill then needs no heads-first copies of q and of the output."""
    rows = _f(q.array)[:batch * q_len * q_row].reshape(batch, q_len, q_row)
    qq = rows[:, :, :q_heads * head_dim].reshape(batch, q_len, q_heads, head_dim)
    o = _attend(qq.transpose(0, 2, 1, 3), k, v, kv_heads, kv_len, kv_capacity, scale, causal,
                window, softcap)
    _store(out, o.transpose(0, 2, 1, 3).reshape(-1))


def _attend(qq: np.ndarray, k: Array, v: Array, kv_heads: int, kv_len: int, kv_capacity: int,
            scale: float, causal: bool, window: int = 0, softcap: float = 0.0) -> np.ndarray:
    """softmax(q kᵀ · scale) v for qq (batch, q_heads, q_len, head_dim) in compute dtype."""
    batch, q_heads, _, head_dim = qq.shape
    group = q_heads // kv_heads
    kk = _f(k.array).reshape(batch, kv_heads, kv_capacity, head_dim)[:, :, :kv_len]
    vv = _f(v.array).reshape(batch, kv_heads, kv_capacity, head_dim)[:, :, :kv_len]
    kk = np.repeat(kk, group, axis=1)
    vv = np.repeat(vv, group, axis=1)
    return np.matmul(_softmax_last(_scores(qq, kk, scale, causal, window, softcap)), vv)


def _scores(qq: np.ndarray, kk: np.ndarray, scale: float, causal: bool,
            window: int = 0, softcap: float = 0.0) -> np.ndarray:
    """scale q kᵀ for qq (batch, heads, q_len, d) and kk repeated to the same heads; with
    ``causal`` the keys past each query's position (kv_len - q_len + i) score -inf, and with
    a ``window`` > 0 those at or before that position - window too."""
    q_len, kv_len = qq.shape[2], kk.shape[2]
    s = soft_cap(np.matmul(qq, kk.transpose(0, 1, 3, 2)) * np.asarray(scale, qq.dtype), softcap)
    if causal:
        qpos = np.arange(q_len)[:, None] + (kv_len - q_len)
        key = np.arange(kv_len)[None, :]
        seen = key <= qpos
        if window > 0:
            seen &= key > qpos - window
        s = np.where(seen, s, -np.inf)
    return s


def _softmax_last(s: np.ndarray) -> np.ndarray:
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return p


def attention_backward(q: Array, k: Array, v: Array, out: Array, dout: Array, dq: Array,
                       dk: Array, dv: Array, batch: int, q_heads: int, kv_heads: int,
                       q_len: int, kv_len: int, head_dim: int, scale: float, causal: bool,
                       rows: tuple[int, ...], stats: Array | None = None) -> None:
    """The gradients of ``out = attention(q, k, v)`` given ``dout`` (capability
    ``attention_backward``), in one call and without the caller holding (q_len, kv_len)
    matrices: dq (like q), dk and dv (like k). q, out, dout and dq have (batch, q_heads,
    q_len, head_dim) elements, k, v, dk and dv (batch, kv_heads, kv_len, head_dim), each
    found through ``rows``: for q, k, v, out, dout, dq, dk, dv in that order, the strides in
    elements of batch, head and position (a row's head_dim values are contiguous), then the
    eight arrays' offsets in elements; token-major rows need no copies. Query head h uses KV head
    h // (q_heads // kv_heads); with ``causal`` query i sees keys up to kv_len - q_len + i.

    The numbers: P = softmax(scale q kᵀ) recomputed, D = rowsum(dout * out), dS = P (dout
    vᵀ - D); dv = Pᵀ dout, dk = scale dSᵀ q, dq = scale dS k, summed over each KV head's
    query heads, in the compute dtype. ``stats``: ``attention_with_stats``'s for this
    output, or None; the reference recomputes P either way. Callers ask
    ``attention_backward_supported`` first."""
    group = q_heads // kv_heads

    def view(a: Array, x: int, heads: int, length: int) -> np.ndarray:
        sb, sh, sp = rows[3 * x:3 * x + 3]
        return _view(a, (batch, heads, length, head_dim), (sb, sh, sp, 1), rows[24 + x])

    qq, oo, do = (_f(view(a, x, q_heads, q_len)) for a, x in ((q, 0), (out, 3), (dout, 4)))
    kk, vv = (np.repeat(_f(view(a, x, kv_heads, kv_len)), group, axis=1)
              for a, x in ((k, 1), (v, 2)))
    sc = np.asarray(scale, qq.dtype)
    p = _softmax_last(_scores(qq, kk, scale, causal))
    ds = p * (np.matmul(do, vv.transpose(0, 1, 3, 2)) - (do * oo).sum(axis=-1, keepdims=True))

    def per_kv_head(g: np.ndarray) -> np.ndarray:  # each KV head's query heads summed
        return g.reshape(batch, kv_heads, group, kv_len, head_dim).sum(axis=2)

    view(dq, 5, q_heads, q_len)[...] = (np.matmul(ds, kk) * sc).astype(dq.array.dtype)
    view(dk, 6, kv_heads, kv_len)[...] = per_kv_head(
        np.matmul(ds.transpose(0, 1, 3, 2), qq) * sc).astype(dk.array.dtype)
    view(dv, 7, kv_heads, kv_len)[...] = per_kv_head(
        np.matmul(p.transpose(0, 1, 3, 2), do)).astype(dv.array.dtype)


def attention_with_stats(q: Array, k: Array, v: Array, out: Array, stats: Array, batch: int,
                         q_heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int,
                         scale: float, causal: bool, q_rows: tuple[int, int, int],
                         out_rows: tuple[int, int, int], kv_rows: tuple[int, ...]) -> None:
    """``attention`` with q, out, k and v read and written through their (batch, head,
    position) strides (``kv_rows``: k's three, then v's; every array from its first
    element), and each query row's max score m (of scale q kᵀ, masked) and 1 / sum(exp(s -
    m)) into the float32 ``stats``: row r of KV head h in batch b (query head h * group +
    r // q_len at position r % q_len) at (b * kv_heads + h) * group * q_len + r, the sums
    R = batch * q_heads * q_len further (capability ``attention_backward``: its backward
    reads them)."""
    group = q_heads // kv_heads
    qq = _f(_view(q, (batch, q_heads, q_len, head_dim), (*q_rows, 1), 0))
    shape = (batch, kv_heads, kv_len, head_dim)
    kk, vv = (np.repeat(_f(_view(a, shape, (*kv_rows[3 * i:3 * i + 3], 1), 0)), group, axis=1)
              for i, a in enumerate((k, v)))
    s = _scores(qq, kk, scale, causal)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    o = np.matmul(e / total, vv)
    _view(out, (batch, q_heads, q_len, head_dim), (*out_rows, 1), 0)[...] = \
        o.astype(out.array.dtype)
    # (batch, q_heads, q_len) is (batch, kv_heads, group * q_len) row order
    _store(stats, np.concatenate([m.reshape(-1), (1 / total).reshape(-1)]))


def attention_backward_supported(dtype: str, head_dim: int, rows: tuple[int, ...]) -> bool:
    """Whether ``attention_backward`` takes arrays of ``dtype`` with ``head_dim`` and these
    ``rows`` (strides and offsets); a service, launching nothing. The reference takes all."""
    return True


def soft_cap(scores: np.ndarray, cap: float) -> np.ndarray:
    """Gemma 2's soft-capped attention scores: cap · tanh(scores / cap) in the scores' dtype
    (cap 0: the scores as they are)."""
    if cap <= 0:
        return scores
    c = np.asarray(cap, scores.dtype)
    return c * np.tanh(scores / c)


def attention_decode(qkv: Array, cos: Array, sin: Array, position: Array, keys: Array,
                     values: Array, out: Array, q_heads: int, kv_heads: int, head_dim: int,
                     capacity: int, table_rows: int, scale: float, window: int = 0,
                     softcap: float = 0.0) -> None:
    """One decode step of grouped-query attention at the position held in device memory.

    All arrays but ``position`` share one floating dtype; scores, softmax and the weighted
    sum are computed in float32 (float64 for float64). ``qkv`` is one token's fused
    projection, (q_heads + 2 * kv_heads) * head_dim values: the queries, then the keys, then
    the values, head after head. ``cos`` and ``sin`` are rotary tables (table_rows,
    head_dim // 2); ``keys`` and ``values`` a KV cache (kv_heads, capacity, head_dim);
    ``position`` an int32 array whose first element p is the token's position. In one pass:

    1. RoPE (half-split, as ``rope``) of the queries and the key with row p of the tables,
       each rounded to the dtype of ``qkv`` (as the ``rope`` function's output is);
    2. the key and value stored at ``keys[h, p]`` and ``values[h, p]``, for every KV head h;
    3. ``out`` (q_heads * head_dim, dtype of ``qkv``) = softmax(scale * q · keys[h, lo:p+1]ᵀ)
       · values[h, lo:p+1] per query head, h = head // (q_heads // kv_heads), where lo is 0,
       or with a sliding ``window`` > 0, max(0, p - window + 1). With ``softcap`` > 0 (Gemma
       2) the scaled scores s become softcap · tanh(s / softcap) before the softmax.

    Positions outside 0..min(capacity, table_rows)-1 write nothing to the cache and give NaN
    outputs (the kernels cannot raise; the caller checks positions on the host).
    """
    d, h = head_dim, head_dim // 2
    p = int(position.array[0])
    o = out.array.reshape(q_heads, d)
    if not 0 <= p < min(capacity, table_rows):
        o[:] = np.nan
        return
    dt = qkv.array.dtype
    v = _f(qkv.array).reshape(q_heads + 2 * kv_heads, d)
    c, s = _f(cos.array).reshape(-1, h)[p], _f(sin.array).reshape(-1, h)[p]
    x1, x2 = v[:q_heads + kv_heads, :h], v[:q_heads + kv_heads, h:]
    roped = _f(np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=1).astype(dt))
    q, k_new, v_new = roped[:q_heads], roped[q_heads:], v[q_heads + kv_heads:]
    kc = keys.array.reshape(kv_heads, capacity, d)
    vc = values.array.reshape(kv_heads, capacity, d)
    kc[:, p] = k_new.astype(kc.dtype)
    vc[:, p] = v_new.astype(vc.dtype)
    group = q_heads // kv_heads
    lo = max(0, p - window + 1) if window > 0 else 0
    kk = np.repeat(_f(kc[:, lo:p + 1]), group, axis=0)  # (q_heads, p + 1 - lo, d)
    vv = np.repeat(_f(vc[:, lo:p + 1]), group, axis=0)
    scores = soft_cap(np.einsum("hd,htd->ht", q, kk) * np.asarray(scale, q.dtype), softcap)
    e = np.exp(scores - scores.max(axis=1, keepdims=True))
    probs = e / e.sum(axis=1, keepdims=True)
    _store(out, np.einsum("ht,htd->hd", probs, vv).reshape(-1))
