"""Neural-network ops with fused forward kernels: convolution, embedding lookup, norms,
rotary embedding, SwiGLU gate and attention.

Forward passes call one NDArray function each (one kernel on a GPU). Backward passes are
written with other ops, recomputing what they need, so they stay differentiable.
"""

from __future__ import annotations

import math

import numpy as np

from .. import backend_ndarray as nd
from ..amp import low_precision_inputs
from ..autograd import Tensor, TensorOp
from ..errors import ShapeError
from ..grad_mode import is_grad_enabled
from .ops_logarithmic import softmax
from .ops_mathematic import silu, silu_derivative
from .ops_shape import (
    broadcast_to,
    cast,
    dilate,
    flip,
    getitem,
    permute,
    reshape,
    summation,
    transpose,
)


def _pair(v, what: str) -> tuple[int, int]:
    try:
        pair = (v, v) if isinstance(v, int) else tuple(v)
    except TypeError:
        pair = ()
    if len(pair) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair):
        raise ShapeError(f"conv {what} must be an int or a pair of ints, got {v!r}")
    return pair


class Conv(TensorOp):
    """2-d convolution (cross-correlation) of NHWC input with (KH, KW, C_in, C_out) weights.

    The forward pass is im2col as a strided view of the padded input, then one matmul.
    """

    def __init__(self, stride=1, padding=0):
        self.stride, self.padding = _pair(stride, "stride"), _pair(padding, "padding")
        if min(self.stride) < 1 or min(self.padding) < 0:
            raise ShapeError(f"conv needs stride >= 1 and padding >= 0, got stride {stride}, "
                             f"padding {padding}")

    def compute(self, x, w):
        if x.ndim != 4 or w.ndim != 4 or x.shape[3] != w.shape[2]:
            raise ShapeError(f"conv needs NHWC input and (KH, KW, C_in, C_out) weights with "
                             f"matching C_in, got {x.shape} and {w.shape}")
        (sh, sw), (ph, pw) = self.stride, self.padding
        if ph or pw:
            x = x.pad(((0, 0), (ph, ph), (pw, pw), (0, 0)))
        x = x.compact()
        n, h, wd, c = x.shape
        kh, kw, _, c_out = w.shape
        if kh > h or kw > wd:
            raise ShapeError(f"conv kernel {kh}x{kw} is larger than the padded input {h}x{wd}")
        ho, wo = (h - kh) // sh + 1, (wd - kw) // sw + 1
        s_n, s_h, s_w, s_c = x.strides
        cols = x.as_strided((n, ho, wo, kh, kw, c), (s_n, s_h * sh, s_w * sw, s_h, s_w, s_c))
        out = cols.compact().reshape((n * ho * wo, kh * kw * c)) @ w.compact().reshape(
            (kh * kw * c, c_out))
        return out.reshape((n, ho, wo, c_out))

    def gradient(self, out_grad, node):
        x, w = node.inputs
        _, h, wd, _ = x.shape
        kh, kw = w.shape[:2]
        (sh, sw), (ph, pw) = self.stride, self.padding
        g = out_grad
        for axis, s in ((1, sh), (2, sw)):
            if s > 1:
                g = dilate(g, (axis,), s - 1)
        # rows and columns of the padded input that the kernel actually reached
        span_h, span_w = h + 2 * ph - kh + 1, wd + 2 * pw - kw + 1
        if g.shape[1:3] != (span_h, span_w):
            g = getitem(g, (slice(None), slice(0, span_h), slice(0, span_w)))
        # input gradient: full correlation of g with the flipped kernel, minus the padding
        qh, qw = kh - 1 - ph, kw - 1 - pw
        w_flipped = transpose(flip(w, (0, 1)), (2, 3))
        grad_x = conv(g, w_flipped, 1, (max(qh, 0), max(qw, 0)))
        if qh < 0 or qw < 0:
            top, left = max(-qh, 0), max(-qw, 0)
            grad_x = getitem(grad_x, (slice(None), slice(top, top + h), slice(left, left + wd)))
        # weight gradient: correlate the input (channels as batch) with g (batch as channels)
        grad_w = conv(permute(x, (3, 1, 2, 0)), permute(g, (1, 2, 0, 3)), 1, (ph, pw))
        return grad_x, permute(grad_w, (1, 2, 0, 3))


def conv(x, w, stride=1, padding=0):
    x, w = low_precision_inputs(x, w)  # autocast (amp.py)
    return Conv(stride, padding)(x, w)


class Embedding(TensorOp):
    """Rows of a (rows, dim) table at integer ``ids`` of any shape."""

    def compute(self, weight, ids):
        return weight.take(ids)

    def gradient(self, out_grad, node):
        weight, ids = node.inputs
        return EmbeddingBackward(weight.shape[0])(out_grad, ids), None


def embedding(weight, ids):
    if not isinstance(ids, Tensor):
        ids = Tensor(ids, device=weight.device, requires_grad=False)
    return Embedding()(weight, ids)


class EmbeddingBackward(TensorOp):
    """Sum ``values`` (ids.shape + (dim,)) into the rows of a zero table: the gradient of
    the lookup (ids repeat, so rows accumulate)."""

    def __init__(self, rows: int):
        self.rows = rows

    def compute(self, values, ids):
        return nd.scatter_add(ids, values.reshape((-1, values.shape[-1])), self.rows)

    def gradient(self, out_grad, node):
        return Embedding()(out_grad, node.inputs[1]), None


class RMSNorm(TensorOp):
    """x / sqrt(mean(x²) + eps) · w over the last axis."""

    def __init__(self, eps: float):
        self.eps = eps

    def compute(self, x, w):
        return x.rmsnorm(w, self.eps)

    def gradient(self, out_grad, node):
        x, w, out_grad = _widen(*node.inputs, out_grad)
        rstd = broadcast_to(_mean_last(x * x) + self.eps, x.shape) ** -0.5
        x_hat = x * rstd
        g_hat = out_grad * broadcast_to(w, x.shape)
        grad_x = rstd * (g_hat - x_hat * broadcast_to(_mean_last(g_hat * x_hat), x.shape))
        return grad_x, _sum_rows(out_grad * x_hat)


def rmsnorm(x, w, eps: float = 1e-6):
    return RMSNorm(eps)(x, w)


class LayerNorm(TensorOp):
    """(x - mean) / sqrt(var + eps) · w + b over the last axis (biased variance)."""

    def __init__(self, eps: float):
        self.eps = eps

    def compute(self, x, w, b):
        return x.layernorm(w, b, self.eps)

    def gradient(self, out_grad, node):
        x, w, _, out_grad = _widen(*node.inputs, out_grad)
        centred = x - broadcast_to(_mean_last(x), x.shape)
        rstd = broadcast_to(_mean_last(centred * centred) + self.eps, x.shape) ** -0.5
        x_hat = centred * rstd
        g_hat = out_grad * broadcast_to(w, x.shape)
        grad_x = rstd * (g_hat - broadcast_to(_mean_last(g_hat), x.shape)
                         - x_hat * broadcast_to(_mean_last(g_hat * x_hat), x.shape))
        return grad_x, _sum_rows(out_grad * x_hat), _sum_rows(out_grad)


def layernorm(x, w, b, eps: float = 1e-5):
    return LayerNorm(eps)(x, w, b)


def _widen(*tensors: Tensor) -> list[Tensor]:
    """float16/bfloat16 tensors as float32: backward passes that recompute statistics
    (norms, softmax of scores) do so in float32, as the forward kernels do. The autograd
    engine casts the gradients back to the inputs' dtypes."""
    return [cast(t, "float32") if t.dtype in ("float16", "bfloat16") else t for t in tensors]


def _mean_last(x: Tensor) -> Tensor:
    return summation(x, -1, keepdims=True) / x.shape[-1]


def _sum_rows(x: Tensor) -> Tensor:
    """Sum over every axis but the last (a per-feature parameter's gradient)."""
    return summation(x, tuple(range(x.ndim - 1))) if x.ndim > 1 else x


class Rope(TensorOp):
    """Rotary position embedding (half-split) of x (batch, seq, heads, head_dim) with cos
    and sin (seq, head_dim // 2). A rotation's transpose rotates back, so the gradient is
    the rope with -sin; cos and sin get none."""

    def compute(self, x, cos, sin):
        return x.rope(cos, sin)

    def gradient(self, out_grad, node):
        _, cos, sin = node.inputs
        return rope(out_grad, cos, -sin), None, None


def rope(x, cos, sin):
    return Rope()(x, cos, sin)


class SiluMul(TensorOp):
    """silu(a) · b, the SwiGLU gate, in one kernel."""

    def compute(self, a, b):
        return a.silu_mul(b)

    def gradient(self, out_grad, node):
        a, b = node.inputs
        return out_grad * b * silu_derivative(a), out_grad * silu(a)


def silu_mul(a, b):
    return SiluMul()(a, b)


class ScaledDotProductAttention(TensorOp):
    """softmax(q kᵀ · scale [+ causal mask]) v for q (batch, q_heads, q_len, head_dim) and
    k, v (batch, kv_heads, kv_len, head_dim); each group of q_heads / kv_heads query heads
    shares one KV head. With ``causal``, query i sits at position kv_len - q_len + i.

    The forward pass is the fused attention kernel. The backward pass is one fused call where
    the backend has ``attention_backward`` for these arrays (the forward then keeps each
    row's softmax statistics for it) and no graph of the gradient is being built; otherwise
    it recomputes the attention probabilities with matmul and softmax.
    """

    def __init__(self, causal: bool = False, scale: float | None = None,
                 keep_stats: bool = False):
        self.causal, self.scale = causal, scale
        # a gradient may follow: the forward keeps each row's softmax statistics where the
        # backend can, and the fused backward reads them instead of recomputing them
        self.keep_stats, self.stats = keep_stats, None

    def compute(self, q, k, v):
        if self.keep_stats:
            out, self.stats = nd.attention_with_stats(q, k, v, scale=self.scale,
                                                      causal=self.causal)
            return out
        return nd.attention(q, k, v, scale=self.scale, causal=self.causal)

    def gradient(self, out_grad, node):
        fused = self._fused_gradient(out_grad, node)
        if fused is not None:
            return fused
        # compact once: q and out_grad each feed two products, k and v one each, and a
        # product copies an operand that is a view of token-major rows (a model's
        # projections) every time it meets one (7 copies a layer, now 4)
        q, k, v, out_grad = (t.contiguous() for t in _widen(*node.inputs, out_grad))
        _, hq, sq, d = q.shape
        _, hkv, skv, _ = k.shape
        group = hq // hkv
        scale = 1 / math.sqrt(d) if self.scale is None else self.scale
        k_rep, v_rep = _repeat_kv(k, group), _repeat_kv(v, group)
        scores = (q @ transpose(k_rep)) * scale
        if self.causal:
            visible = np.arange(skv)[None, :] <= np.arange(sq)[:, None] + (skv - sq)
            mask = np.where(visible, 0.0, -np.inf)
            scores = scores + broadcast_to(
                Tensor(mask, device=q.device, dtype=q.dtype, requires_grad=False), scores.shape)
        probs = softmax(scores)
        grad_probs = out_grad @ transpose(v_rep)
        # sum_j P_ij dP_ij = dO_i . (sum_j P_ij V_j) = dO_i . O_i: a pass over (s, d) rows of
        # the output instead of two over (s, s) matrices
        out = _widen(node)[0]
        row_dot = summation(out_grad * out, -1, keepdims=True)
        grad_scores = probs * (grad_probs - broadcast_to(row_dot, probs.shape)) * scale
        grad_q = grad_scores @ k_rep
        grad_k = _sum_groups(transpose(grad_scores) @ q, hkv, group)
        grad_v = _sum_groups(transpose(probs) @ out_grad, hkv, group)
        return grad_q, grad_k, grad_v

    def _fused_gradient(self, out_grad, node):
        """The three gradients from the backend's fused attention backward (nd's
        attention_backward: no (s, s) matrices, no heads-first copies), or None where the
        backend has none for these arrays. Not while building a differentiable graph
        (``create_graph``): its results are constants."""
        if is_grad_enabled():
            return None
        tensors = (*node.inputs, node, out_grad)
        grads = None
        if len({t.dtype for t in tensors}) == 1 and tensors[0].dtype in ("float16", "bfloat16"):
            # half types as they are where the backend has a kernel for them (CUDA's tensor
            # cores); elsewhere widened, as the composed gradient computes
            grads = self._backend_gradient(tensors)
        if grads is None:
            grads = self._backend_gradient(_widen(*tensors))
        if grads is None:
            return None
        return tuple(Tensor.make_const(g) for g in grads)

    def _backend_gradient(self, tensors):
        return nd.attention_backward(*(t.realize_cached_data() for t in tensors),
                                     scale=self.scale, causal=self.causal, stats=self.stats)


def _repeat_kv(t: Tensor, group: int) -> Tensor:
    """(b, kv_heads, s, d) -> (b, kv_heads * group, s, d), each head repeated group times."""
    if group == 1:
        return t
    b, h, s, d = t.shape
    return reshape(broadcast_to(reshape(t, (b, h, 1, s, d)), (b, h, group, s, d)),
                   (b, h * group, s, d))


def _sum_groups(t: Tensor, kv_heads: int, group: int) -> Tensor:
    if group == 1:
        return t
    b, _, s, d = t.shape
    return summation(reshape(t, (b, kv_heads, group, s, d)), 2)


def scaled_dot_product_attention(q, k, v, causal: bool = False, scale: float | None = None):
    q, k, v = low_precision_inputs(q, k, v)  # autocast (amp.py)
    keep = is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return ScaledDotProductAttention(causal, scale, keep)(q, k, v)

