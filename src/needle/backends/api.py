"""The backend contract: what every backend implements, and what some also offer.

``ArrayBackend`` lists the functions NDArray calls on every device; ``numpy_ref`` defines
what each one means (its docstrings are the specification) and every other backend is tested
against it. Beyond them a backend may offer optional services, each a named *capability*
declared in the backend's ``capabilities`` set; a capability comes with the functions of its
protocol below. Callers ask ``has(backend, "graphs")`` and never probe attributes, so what a
backend must implement, and what it may add, is written here and nowhere else.

Adding a function to every backend: write it in ``numpy_ref``, add it to ``ArrayBackend``,
implement it in each backend (docs/adding_a_kernel_family.md). Adding an optional service:
name a capability in ``CAPABILITIES``, give it a protocol in ``CAPABILITY_PROTOCOLS``, declare
it where implemented, and name a test for it in ``tests/backends/test_contract.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import numpy as np

Array = Any  # a backend's flat buffer of elements (numpy_ref.Array, _cpu.Array, GpuArray)

# name -> what declaring it promises (the docs and the conformance test read this table)
CAPABILITIES = {
    "graphs": "capture() records device work into a CommandBuffer that replay() runs again",
    "profiling": "profile() sums device time per kernel over a block",
    "memory_stats": "memory_stats(), memory_available() and empty_cache() of a caching "
                    "device-memory pool",
    "async_read": "to_numpy_later() starts a device-to-host read that is waited for later",
    "dlpack": "dlpack_device(), to_dlpack() and from_dlpack(): zero-copy exchange of device "
              "memory with other frameworks",
    "host_memory": "wrap() and host_view(): arrays in host memory that numpy can view",
    "bf16_tensor_cores": "bfloat16/float16 matmul and attention run on matrix units",
    "fused_decode": "attention_decode is one launch (RoPE, KV write, attention and merge)",
    "decode_bands": "attention_decode_bands() names the position bounds where "
                    "attention_decode's kernel choice changes, and attention_decode_within() "
                    "chooses for a bound on the positions read (the same numbers at any "
                    "position: the bound only picks the kernel)",
    "fused_matvec": "rmsnorm_matvec, rmsnorm_matvec_swiglu and matvec_add of one row are one "
                    "kernel each, faster than the ops they fuse (the decode step uses them)",
    "sampling": "sample() chooses tokens from logits on the device (numpy_ref/sampling.py)",
    "precompile": "precompile(dtypes) starts compiling the kernels of those dtypes in parallel "
                  "(returns at once; a kernel's first use waits for its own compile); "
                  "wait_precompiled() waits for them all",
    "paged_attention": "paged_write() and paged_attention(): a KV cache in fixed-size pages "
                       "read through per-sequence block tables (numpy_ref/paged.py)",
    "int8": "quant_matmul() and dequantize() of 8-bit packed weights (docs/quantization.md)",
    "int4": "quant_matmul() and dequantize() of 4-bit packed weights (docs/quantization.md)",
    "fused_quant_matvec": "quant_rmsnorm_matvec() and quant_matvec_add(): the decode step's "
                          "fused projections with packed weights (numpy_ref/quant.py), one "
                          "kernel each for one row where the format allows",
    "token_major_attention": "attention_token_major(): attention reading q from token-major "
                             "rows (a fused QKV projection's) and writing out token-major "
                             "(numpy_ref/nn.py), with no heads-first copies",
    "matmul_swiglu": "matmul_swiglu(): a product with a fused gate/up weight and its SwiGLU "
                     "in one pass (numpy_ref/nn.py), without writing the 2p-wide product",
    "matmul_geglu": "matmul_geglu(): matmul_swiglu with Gemma's GeGLU (numpy_ref/nn.py)",
    "folded_norm_matvec": "folded_rmsnorm_matvec(): one row's RMSNorm and projection in one "
                          "pass with the norm's scale folded into the weight, r * (W x), the "
                          "normed vector never rounded (numpy_ref/decode.py); the decode step "
                          "folds its norms into the weights where a backend declares it",
    "attention_backward": "attention_backward(): the gradients of attention in one call "
                          "(with attention_with_stats(): a forward that keeps each row's "
                          "softmax statistics for it) "
                          "(numpy_ref/nn.py), q, k, v and the gradients read and written "
                          "through row strides, no (q_len, kv_len) matrix left to the caller, "
                          "for what attention_backward_supported() accepts",
    "multi_tensor_adam": "adam_update_many(): Adam steps of many parameters of one dtype "
                         "together (numpy_ref/optim.py), each bitwise its own adam_update; "
                         "on a GPU a few launches for a whole model's step",
}
# Names kept for capabilities that are planned but that no backend declares yet.
RESERVED_CAPABILITIES: tuple[str, ...] = ()


@runtime_checkable
class ArrayBackend(Protocol):
    """The array API (design §3; docs/architecture.md): every backend implements all of it.

    Functions write into a preallocated ``out``, take compact inputs unless the name says
    otherwise (compact, setitem) and read dtypes from their buffers.
    """

    name: str
    capabilities: frozenset[str]

    # memory
    def Array(self, size: int, dtype: str = "float32") -> Array: ...  # noqa: N802
    def from_numpy(self, a: np.ndarray, out: Array) -> None: ...
    def to_numpy(self, a: Array, shape, strides, offset) -> np.ndarray: ...
    def fill(self, out: Array, value) -> None: ...
    def synchronize(self) -> None: ...

    # layout
    def compact(self, a: Array, out: Array, shape, strides, offset) -> None: ...
    def ewise_setitem(self, a: Array, out: Array, shape, strides, offset) -> None: ...
    def scalar_setitem(self, size: int, value, out: Array, shape, strides, offset) -> None: ...

    # elementwise: ewise_X(a, b, out) / scalar_X(a, value, out) for each binary op below,
    # ewise_X(a, out) for each unary op (checked by ``missing_functions``)
    def ewise_cast(self, a: Array, out: Array) -> None: ...
    def where(self, cond: Array, a: Array, b: Array, out: Array) -> None: ...
    def silu_mul(self, a: Array, b: Array, out: Array) -> None: ...
    def swiglu(self, x: Array, out: Array, dim: int) -> None: ...
    def geglu(self, x: Array, out: Array, dim: int) -> None: ...
    def qk_rmsnorm(self, x: Array, q_weight: Array, k_weight: Array, out: Array, rows: int,
                   q_heads: int, kv_heads: int, head_dim: int, eps: float) -> None: ...

    # reductions of a compact (outer, reduce_size, inner) array
    def reduce_sum(self, a: Array, out: Array, outer: int, reduce_size: int,
                   inner: int = 1) -> None: ...
    def reduce_max(self, a: Array, out: Array, outer: int, reduce_size: int,
                   inner: int = 1) -> None: ...
    def reduce_min(self, a: Array, out: Array, outer: int, reduce_size: int,
                   inner: int = 1) -> None: ...
    def reduce_argmax(self, a: Array, out: Array, outer: int, reduce_size: int,
                      inner: int = 1) -> None: ...

    # matmul, indexing
    def matmul(self, a: Array, b: Array, out: Array, m: int, n: int, p: int, *,
               batch: int = 1, stride_a: int | None = None, stride_b: int | None = None,
               transpose_a: bool = False, transpose_b: bool = False) -> None: ...
    def take(self, table: Array, indices: Array, out: Array, rows: int, dim: int) -> None: ...
    def scatter_add(self, indices: Array, values: Array, out: Array, rows: int,
                    dim: int) -> None: ...

    # transformer
    def softmax(self, a: Array, out: Array, dim: int) -> None: ...
    def log_softmax(self, a: Array, out: Array, dim: int) -> None: ...
    def rmsnorm(self, x: Array, w: Array, out: Array, dim: int, eps: float) -> None: ...
    def add_rmsnorm(self, x: Array, delta: Array, w: Array, total: Array, out: Array, dim: int,
                    eps: float) -> None: ...
    def add_rmsnorm_post(self, x: Array, delta: Array, dw: Array, w: Array, total: Array,
                         out: Array, dim: int, eps: float) -> None: ...
    def layernorm(self, x: Array, w: Array, b: Array, out: Array, dim: int,
                  eps: float) -> None: ...
    def rope(self, x: Array, cos: Array, sin: Array, out: Array, batch: int, seq: int,
             heads: int, head_dim: int) -> None: ...
    def attention(self, q: Array, k: Array, v: Array, out: Array, batch: int, q_heads: int,
                  kv_heads: int, q_len: int, kv_len: int, kv_capacity: int, head_dim: int,
                  scale: float, causal: bool, window: int,
                  softcap: float = 0.0) -> None: ...
    def attention_decode(self, qkv: Array, cos: Array, sin: Array, position: Array,
                         keys: Array, values: Array, out: Array, q_heads: int, kv_heads: int,
                         head_dim: int, capacity: int, table_rows: int,
                         scale: float, window: int, softcap: float = 0.0) -> None: ...

    # the decode step's fused projections (numpy_ref/decode.py)
    def rmsnorm_matvec(self, x: Array, w: Array, weight: Array, out: Array, rows: int,
                       dim: int, p: int, eps: float) -> None: ...
    def rmsnorm_matvec_swiglu(self, x: Array, w: Array, weight: Array, out: Array, rows: int,
                              dim: int, p: int, eps: float) -> None: ...
    def matvec_add(self, a: Array, weight: Array, total: Array, rows: int, dim: int,
                   p: int) -> None: ...

    # optimizer updates, in place
    def adam_update(self, param: Array, grad: Array, m: Array, v: Array, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                    decoupled: bool) -> None: ...
    def sgd_update(self, param: Array, grad: Array, momentum_buf: Array | None, lr: float,
                   momentum: float, dampening: float, weight_decay: float, nesterov: bool,
                   first: bool) -> None: ...


BINARY_OPS = ("add", "sub", "mul", "div", "power", "maximum", "minimum",
              "eq", "ne", "lt", "le", "gt", "ge")
UNARY_OPS = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid",
             "relu", "silu", "gelu")


class GraphCapture(Protocol):
    def capture(self) -> AbstractContextManager: ...


class Profiling(Protocol):
    def profile(self) -> AbstractContextManager: ...


class MemoryStats(Protocol):
    def memory_stats(self) -> Any: ...  # hal.MemoryStats: in_use, reserved, peak, ...
    def memory_available(self) -> int: ...
    def empty_cache(self) -> None: ...


class AsyncRead(Protocol):
    def to_numpy_later(self, a: Array, shape, strides,
                       offset) -> Callable[[], np.ndarray]: ...


class DLPackExchange(Protocol):
    def dlpack_device(self) -> tuple[int, int]: ...
    def to_dlpack(self, a: Array, shape, strides, offset, stream=None) -> Any: ...
    def from_dlpack(self, x, ndarray_cls) -> Any: ...


class HostMemory(Protocol):
    def wrap(self, flat: np.ndarray, dtype: str) -> Array: ...
    def host_view(self, a: Array) -> np.ndarray: ...


class Sampling(Protocol):
    def sample(self, logits: Array, params: Array, seeds: Array, positions: Array,
               seen: Array, out: Array, rows: int, vocab: int) -> None: ...


class Precompile(Protocol):
    def precompile(self, dtypes, families=None) -> list[str]: ...
    def wait_precompiled(self) -> None: ...


class DecodeBands(Protocol):
    """attention_decode chosen for a band of positions: a captured decode step cannot read
    its position on the host, so the decoder records one step a band and tells the backend
    the band's bound. ``attention_decode_within`` computes exactly what ``attention_decode``
    does (numpy_ref/nn.py) at every position, also past ``max_positions``: the bound only
    picks the kernel. ``attention_decode_bands`` returns the bounds, ascending, the last the
    capacity, at which that choice changes."""

    def attention_decode_bands(self, dtype: str, q_heads: int, kv_heads: int, head_dim: int,
                               capacity: int) -> tuple[int, ...]: ...
    def attention_decode_within(self, qkv: Array, cos: Array, sin: Array, position: Array,
                                keys: Array, values: Array, out: Array, q_heads: int,
                                kv_heads: int, head_dim: int, capacity: int, table_rows: int,
                                scale: float, window: int, max_positions: int,
                                softcap: float = 0.0) -> None: ...


class PagedAttention(Protocol):
    def paged_write(self, k: Array, v: Array, slots: Array, key_pages: Array,
                    value_pages: Array, tokens: int, row: int, num_slots: int) -> None: ...
    def paged_attention(self, q: Array, key_pages: Array, value_pages: Array,
                        block_tables: Array, seq_of: Array, positions: Array, out: Array,
                        tokens: int, q_heads: int, kv_heads: int, head_dim: int,
                        page_size: int, max_pages: int, num_pages: int,
                        scale: float, window: int, softcap: float = 0.0) -> None: ...


class QuantizedWeights(Protocol):
    """Packed weight-only quantized matrices (numpy_ref/quant.py defines both functions);
    ``int8`` and ``int4`` share it and say which ``bits`` the backend accepts."""

    def quant_matmul(self, x: Array, qweight: Array, scales: Array, offsets: Array | None,
                     out: Array, m: int, n: int, k: int, bits: int, group_size: int) -> None: ...
    def dequantize(self, qweight: Array, scales: Array, offsets: Array | None, out: Array,
                   n: int, k: int, bits: int, group_size: int) -> None: ...


class FusedQuantMatvec(Protocol):
    """rmsnorm_matvec (with swiglu) and matvec_add with a packed weight (numpy_ref/quant.py);
    the array layer composes them from rmsnorm and quant_matmul where a backend lacks it."""

    def quant_rmsnorm_matvec(self, x: Array, w: Array, qweight: Array, scales: Array,
                             offsets: Array | None, out: Array, rows: int, dim: int, p: int,
                             eps: float, bits: int, group_size: int, swiglu: bool) -> None: ...
    def quant_matvec_add(self, a: Array, qweight: Array, scales: Array, offsets: Array | None,
                         total: Array, rows: int, dim: int, p: int, bits: int,
                         group_size: int) -> None: ...


class TokenMajorAttention(Protocol):
    """attention with q and out in token-major rows (numpy_ref/nn.py defines it); the array
    layer copies to and from heads-first layout where a backend lacks it."""

    def attention_token_major(self, q: Array, k: Array, v: Array, out: Array, batch: int,
                              q_heads: int, kv_heads: int, q_len: int, kv_len: int,
                              kv_capacity: int, head_dim: int, scale: float, causal: bool,
                              q_row: int,
                              window: int) -> None: ...


class MatmulSwiglu(Protocol):
    """swiglu(a @ wᵀ) with w a fused gate/up weight (numpy_ref/nn.py defines it); the array
    layer composes matmul and swiglu where a backend lacks it."""

    def matmul_swiglu(self, a: Array, w: Array, out: Array, m: int, n: int, p: int) -> None: ...


class MatmulGeglu(Protocol):
    """geglu(a @ wᵀ) with w a fused gate/up weight (numpy_ref/nn.py defines it); the array
    layer composes matmul and geglu where a backend lacks it."""

    def matmul_geglu(self, a: Array, w: Array, out: Array, m: int, n: int, p: int) -> None: ...


class FoldedNormMatvec(Protocol):
    """rmsnorm_matvec of one row with norm_weight None (numpy_ref/decode.py defines it); the
    array layer composes rmsnorm (rounded) and the product where a backend lacks it."""

    def folded_rmsnorm_matvec(self, x: Array, weight: Array, out: Array, dim: int, p: int,
                              eps: float, swiglu: bool) -> None: ...


class MultiTensorAdam(Protocol):
    """adam_update of each parameter of a list, together (numpy_ref/optim.py defines it);
    the array layer calls adam_update once a parameter where a backend lacks it."""

    def adam_update_many(self, params: list, grads: list, ms: list, vs: list, lr: float,
                         beta1: float, beta2: float, eps: float, weight_decay: float,
                         step: int, decoupled: bool) -> None: ...


class AttentionBackward(Protocol):
    """The gradients of attention (numpy_ref/nn.py defines them); the Tensor layer composes
    them from products and a softmax where a backend lacks it or does not support the
    arrays (a service answers that, so a recorded step never reads a work call's result)."""

    def attention_backward_supported(self, dtype: str, head_dim: int,
                                     rows: tuple[int, ...]) -> bool: ...

    def attention_backward(self, q: Array, k: Array, v: Array, out: Array, dout: Array,
                           dq: Array, dk: Array, dv: Array, batch: int, q_heads: int,
                           kv_heads: int, q_len: int, kv_len: int, head_dim: int,
                           scale: float, causal: bool, rows: tuple[int, ...],
                           stats: Array | None = None) -> None: ...

    def attention_with_stats(self, q: Array, k: Array, v: Array, out: Array, stats: Array,
                             batch: int, q_heads: int, kv_heads: int, q_len: int, kv_len: int,
                             head_dim: int, scale: float, causal: bool,
                             q_rows: tuple[int, int, int], out_rows: tuple[int, int, int],
                             kv_rows: tuple[int, ...]) -> None: ...


class _Marker(Protocol):
    """Capabilities that promise behaviour of required functions, not new functions."""


CAPABILITY_PROTOCOLS: dict[str, type] = {
    "graphs": GraphCapture, "profiling": Profiling, "memory_stats": MemoryStats,
    "async_read": AsyncRead, "dlpack": DLPackExchange, "host_memory": HostMemory,
    "bf16_tensor_cores": _Marker, "fused_decode": _Marker, "decode_bands": DecodeBands,
    "sampling": Sampling,
    "precompile": Precompile, "paged_attention": PagedAttention, "int8": QuantizedWeights,
    "int4": QuantizedWeights, "fused_quant_matvec": FusedQuantMatvec,
    "token_major_attention": TokenMajorAttention, "matmul_swiglu": MatmulSwiglu,
    "matmul_geglu": MatmulGeglu,
    "folded_norm_matvec": FoldedNormMatvec, "multi_tensor_adam": MultiTensorAdam,
    "attention_backward": AttentionBackward,
}


def has(backend, capability: str) -> bool:
    """Whether ``backend`` declares ``capability`` (a name from ``CAPABILITIES``)."""
    if capability not in CAPABILITIES and capability not in RESERVED_CAPABILITIES:
        raise ValueError(f"unknown backend capability {capability!r}; known: "
                         f"{', '.join(CAPABILITIES)}")
    return capability in backend.capabilities


def _protocol_functions(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items()
            if callable(value) and not name.startswith("_")]


def required_functions() -> list[str]:
    """Every function name the array API requires of a backend."""
    names = _protocol_functions(ArrayBackend)
    names += [f"{kind}_{op}" for op in BINARY_OPS for kind in ("ewise", "scalar")]
    names += [f"ewise_{op}" for op in UNARY_OPS]
    return names


def capability_functions() -> list[str]:
    """Every function name a capability's protocol adds to the array API."""
    names: list[str] = []
    for protocol in CAPABILITY_PROTOCOLS.values():
        names += [n for n in _protocol_functions(protocol) if n not in names]
    return names


def missing_functions(backend) -> list[str]:
    """What ``backend`` lacks of the array API and of its declared capabilities' protocols
    (empty when it implements the contract); the conformance test asserts it is empty."""
    names = required_functions()
    for capability in getattr(backend, "capabilities", ()):
        protocol = CAPABILITY_PROTOCOLS.get(capability)
        names += _protocol_functions(protocol) if protocol is not None else []
    missing = [n for n in names if not callable(getattr(backend, n, None))]
    missing += [a for a in ("name", "capabilities") if getattr(backend, a, None) is None]
    return missing
