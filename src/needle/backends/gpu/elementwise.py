"""Elementwise kernels (kernel file ``elementwise``; ``swiglu`` lives in ``nn``): binary,
scalar and unary maps, casts, where, and the SwiGLU gate products."""

from __future__ import annotations

from ...backend_ndarray.dtypes import ITEMSIZE
from .array import ALL, FLOATS, N_PARAMS, NUMBERS, ROW, S_PARAMS, SUFFIX, GpuArray, scalar
from .base import GpuBase


def _unary_op(op: str, dtypes):
    names = {dt: f"ewise_{op}_{SUFFIX[dt]}" for dt in dtypes}

    def ewise(self, a: GpuArray, out: GpuArray) -> None:
        self._map(names[self._need(a.dtype, names, op)], out.size, a.dtype, out.dtype,
                  (a.buffer, out.buffer), N_PARAMS.pack(out.size))

    ewise.__name__ = ewise.__qualname__ = f"ewise_{op}"
    return ewise


def _binary_op(op: str, dtypes):
    names = {dt: f"ewise_{op}_{SUFFIX[dt]}" for dt in dtypes}
    snames = {dt: f"scalar_{op}_{SUFFIX[dt]}" for dt in dtypes}

    def ewise(self, a: GpuArray, b: GpuArray, out: GpuArray) -> None:
        name = names.get(a.dtype) or names[self._need(a.dtype, names, op)]  # get: hot path
        self._map(name, out.size, a.dtype, out.dtype, (a.buffer, b.buffer, out.buffer),
                  N_PARAMS.pack(out.size))

    def scalar_op(self, a: GpuArray, value, out: GpuArray) -> None:
        dt = self._need(a.dtype, snames, op)
        self._map(snames[dt], out.size, a.dtype, out.dtype, (a.buffer, out.buffer),
                  S_PARAMS[dt].pack(out.size, scalar(dt, value)))

    ewise.__name__ = ewise.__qualname__ = f"ewise_{op}"
    scalar_op.__name__ = scalar_op.__qualname__ = f"scalar_{op}"
    return ewise, scalar_op


class ElementwiseOps(GpuBase):
    ewise_add, scalar_add = _binary_op("add", NUMBERS)
    ewise_sub, scalar_sub = _binary_op("sub", NUMBERS)
    ewise_mul, scalar_mul = _binary_op("mul", NUMBERS)
    ewise_div, scalar_div = _binary_op("div", NUMBERS)
    ewise_power, scalar_power = _binary_op("power", NUMBERS)
    ewise_maximum, scalar_maximum = _binary_op("maximum", NUMBERS)
    ewise_minimum, scalar_minimum = _binary_op("minimum", NUMBERS)
    ewise_eq, scalar_eq = _binary_op("eq", ALL)
    ewise_ne, scalar_ne = _binary_op("ne", ALL)
    ewise_lt, scalar_lt = _binary_op("lt", ALL)
    ewise_le, scalar_le = _binary_op("le", ALL)
    ewise_gt, scalar_gt = _binary_op("gt", ALL)
    ewise_ge, scalar_ge = _binary_op("ge", ALL)

    ewise_neg = _unary_op("neg", NUMBERS)
    ewise_abs = _unary_op("abs", NUMBERS)
    ewise_relu = _unary_op("relu", NUMBERS)
    ewise_exp = _unary_op("exp", FLOATS)
    ewise_log = _unary_op("log", FLOATS)
    ewise_sqrt = _unary_op("sqrt", FLOATS)
    ewise_rsqrt = _unary_op("rsqrt", FLOATS)
    ewise_sin = _unary_op("sin", FLOATS)
    ewise_cos = _unary_op("cos", FLOATS)
    ewise_tanh = _unary_op("tanh", FLOATS)
    ewise_sigmoid = _unary_op("sigmoid", FLOATS)
    ewise_silu = _unary_op("silu", FLOATS)
    ewise_gelu = _unary_op("gelu", FLOATS)

    def ewise_cast(self, a: GpuArray, out: GpuArray) -> None:
        """Convert ``a`` to ``out.dtype`` (floats to ints truncate toward zero)."""
        if a.dtype == out.dtype:
            self.queue.copy(a.buffer, 0, out.buffer, 0, a.size * ITEMSIZE[a.dtype])
            return
        self._map(f"cast_{SUFFIX[a.dtype]}_{SUFFIX[out.dtype]}", out.size, a.dtype, out.dtype,
                  (a.buffer, out.buffer), N_PARAMS.pack(out.size))

    def where(self, cond: GpuArray, a: GpuArray, b: GpuArray, out: GpuArray) -> None:
        if out.size:
            self._launch_1d(f"where_{SUFFIX[out.dtype]}", out.size,
                            (cond.buffer, a.buffer, b.buffer, out.buffer),
                            N_PARAMS.pack(out.size), "elementwise")

    def silu_mul(self, a: GpuArray, b: GpuArray, out: GpuArray) -> None:
        """out = silu(a) * b (SwiGLU's gate)."""
        self._need(a.dtype, FLOATS, "silu_mul")
        self._map(f"silu_mul_{SUFFIX[a.dtype]}", out.size, a.dtype, out.dtype,
                  (a.buffer, b.buffer, out.buffer), N_PARAMS.pack(out.size))

    def swiglu(self, x: GpuArray, out: GpuArray, dim: int) -> None:
        """out = silu(x[:, :dim]) * x[:, dim:] per row of x (rows, 2 * dim)."""
        self._gated("swiglu", x, out, dim)

    def geglu(self, x: GpuArray, out: GpuArray, dim: int) -> None:
        """out = gelu_tanh(x[:, :dim]) * x[:, dim:] per row of x (rows, 2 * dim)."""
        self._gated("geglu", x, out, dim)

    def _gated(self, op: str, x: GpuArray, out: GpuArray, dim: int) -> None:
        """A gated-MLP kernel (``nn``'s swiglu, geglu): 1-d over the outputs."""
        self._need(x.dtype, FLOATS, op)
        if out.size:
            self._launch_1d(f"{op}_{SUFFIX[x.dtype]}", out.size, (x.buffer, out.buffer),
                            ROW.pack(out.size, dim), "nn")
