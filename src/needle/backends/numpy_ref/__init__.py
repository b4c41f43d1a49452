"""The reference backend: the array API (design §3) in numpy.

This module defines what every array-API function means; every other backend is tested
against it. Conventions shared by all backends:

* A buffer is a flat, typed allocation: ``Array(size, dtype)`` with ``.size`` (elements)
  and ``.dtype`` (needle's dtype name). Shapes live in NDArray, never in buffers.
* Functions write into a preallocated ``out`` and take compact inputs unless the name says
  otherwise (``compact``, ``ewise_setitem``, ``scalar_setitem`` take shape/strides/offset).
* Binary ``ewise_*``/``scalar_*`` functions get inputs of one dtype (NDArray promotes first);
  comparisons write bool. ``ewise_cast`` converts to ``out.dtype``.
* Arithmetic ``ewise_*``/``scalar_*`` functions may get ``out`` as the same buffer as an
  input (NDArray's in-place ``+=``, ``-=``, ``*=``, ``/=``): element i is read before it is
  written, so kernels must not assume ``out`` and the inputs are distinct.
* float16 and bfloat16 compute in float32 and round once when written.
"""

from __future__ import annotations

import sys

from ...errors import DeviceError
from .core import Array
from .decode import folded_rmsnorm_matvec, matvec_add, rmsnorm_matvec, rmsnorm_matvec_swiglu
from .elementwise import (
    ewise_abs,
    ewise_add,
    ewise_cast,
    ewise_cos,
    ewise_div,
    ewise_eq,
    ewise_exp,
    ewise_ge,
    ewise_gelu,
    ewise_gt,
    ewise_le,
    ewise_log,
    ewise_lt,
    ewise_maximum,
    ewise_minimum,
    ewise_mul,
    ewise_ne,
    ewise_neg,
    ewise_power,
    ewise_relu,
    ewise_rsqrt,
    ewise_sigmoid,
    ewise_silu,
    ewise_sin,
    ewise_sqrt,
    ewise_sub,
    ewise_tanh,
    scalar_add,
    scalar_div,
    scalar_eq,
    scalar_ge,
    scalar_gt,
    scalar_le,
    scalar_lt,
    scalar_maximum,
    scalar_minimum,
    scalar_mul,
    scalar_ne,
    scalar_power,
    scalar_sub,
    where,
)
from .memory import (
    compact,
    ewise_setitem,
    fill,
    from_numpy,
    host_view,
    scalar_setitem,
    scatter_add,
    synchronize,
    take,
    to_numpy,
    wrap,
)
from .nn import (
    add_rmsnorm,
    add_rmsnorm_post,
    attention,
    attention_backward,
    attention_backward_supported,
    attention_decode,
    attention_token_major,
    attention_with_stats,
    geglu,
    layernorm,
    log_softmax,
    matmul_geglu,
    matmul_swiglu,
    qk_rmsnorm,
    rmsnorm,
    rope,
    silu_mul,
    softmax,
    swiglu,
)
from .optim import adam_update, adam_update_many, sgd_update
from .paged import paged_attention, paged_write
from .quant import dequantize, quant_matmul, quant_matvec_add, quant_rmsnorm_matvec
from .reduce import matmul, reduce_argmax, reduce_max, reduce_min, reduce_sum
from .sampling import sample

name = "cpu_numpy"
# what each capability promises: backends/api.py
capabilities = frozenset({"host_memory", "sampling", "paged_attention", "int8", "int4",
                          "fused_quant_matvec", "token_major_attention", "matmul_swiglu",
                          "matmul_geglu",
                          "folded_norm_matvec", "multi_tensor_adam", "attention_backward"})


def load(index: int = 0):
    """The backend: this package itself (one device, index 0)."""
    if index != 0:
        raise DeviceError(f"the cpu_numpy device has only index 0, got {index}")
    return sys.modules[__name__]
