"""The array layer: NDArray over the device backends
(``from needle import backend_ndarray as nd``)."""

from .decode import (
    attention_decode,
    attention_decode_bands,
    matvec_add,
    qk_rmsnorm,
    rmsnorm_matvec,
)
from .device import (
                     Device,
                     all_devices,
                     as_device,
                     cpu,
                     cpu_numpy,
                     cuda,
                     default_device,
                     device_from_name,
                     metal,
)
from .dtypes import ALL_DTYPES, promote
from .functions import (
                     add_rmsnorm,
                     attention,
                     attention_backward,
                     attention_with_stats,
                     broadcast_to,
                     concatenate,
                     exp,
                     flip,
                     from_dlpack,
                     log,
                     matmul_geglu,
                     matmul_swiglu,
                     max,
                     maximum,
                     minimum,
                     reshape,
                     scatter_add,
                     sqrt,
                     stack,
                     sum,
                     tanh,
                     transpose,
                     where,
)
from .ndarray import (
                     NDArray,
                     array,
                     broadcast_shapes,
                     empty,
                     full,
                     ones,
                     zeros,
)
from .paged import paged_attention, paged_write
from .quant import QuantizedMatrix, quant_matmul
from .sampling import sample
from .updates import adam_update, adam_update_many, sgd_update, state_dtype

__all__ = [
    "ALL_DTYPES", "Device", "NDArray", "QuantizedMatrix", "quant_matmul",
    "adam_update", "adam_update_many", "add_rmsnorm", "matvec_add", "rmsnorm_matvec",
    "all_devices", "array",
    "as_device", "attention", "attention_backward", "attention_with_stats", "attention_decode",
    "attention_decode_bands",
    "broadcast_shapes", "broadcast_to", "concatenate", "cpu", "cpu_numpy", "cuda",
    "default_device", "device_from_name", "empty", "exp", "flip", "from_dlpack", "full", "log",
    "matmul_geglu", "matmul_swiglu", "max", "maximum", "metal", "minimum", "ones",
    "paged_attention", "paged_write", "promote", "qk_rmsnorm", "reshape", "sample",
    "scatter_add",
    "sgd_update", "sqrt", "stack", "state_dtype", "sum", "tanh", "transpose", "where", "zeros",
]
