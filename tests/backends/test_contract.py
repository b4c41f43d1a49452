"""The backend contract (``needle.backends.api``): every enabled backend implements the array
API and the protocols of the capabilities it declares; every capability is tested somewhere;
DLPack imports take their device from the producer."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backends import api
from needle.errors import DeviceError, DTypeError

from ..conftest import devices_with

TESTS = Path(__file__).resolve().parent.parent

# capability -> tests (path relative to tests/ :: function) that fail if it breaks
CAPABILITY_TESTS = {
    "graphs": ["backends/test_cuda.py::test_graph_capture_replays_with_new_inputs",
               "backends/test_metal.py::test_recorded_command_buffer_replays_with_new_inputs",
               "models/test_llama_vs_hf.py::test_cached_decode_matches_full_forward"],
    "profiling": ["backends/test_cuda.py::test_profiler_sums_kernel_time",
                  "backends/test_metal.py::test_profiler_times_each_kernel"],
    "memory_stats": ["backends/test_cuda.py::test_memory_stats_and_out_of_memory",
                     "backends/test_contract.py::test_memory_stats_capability"],
    "async_read": ["models/test_llama_vs_hf.py::test_numpy_later_reads_the_value_at_the_call"],
    "dlpack": ["backends/test_cuda.py::test_dlpack_zero_copy_with_torch_both_ways"],
    "host_memory": ["backend_ndarray/test_dlpack.py::test_import_from_numpy_is_zero_copy",
                    "backends/test_cpu_backend.py::test_wrap_and_host_view_alias_the_same_memory"],
    "bf16_tensor_cores": ["backends/test_cuda.py::test_matmul_half_tensor_cores_and_fallback",
                          "backends/test_cuda.py::test_tensor_core_attention"],
    "fused_decode": ["backends/test_cuda.py::test_fused_decode_is_one_launch"],
    "decode_bands": ["backends/test_cuda.py::test_decode_bands_pick_the_cluster_kernel",
                     "models/test_decode_bands.py::test_a_step_a_band_decodes_like_transformers"],
    "fused_matvec": ["models/test_llama_vs_hf.py::test_five_operation_decode_matches_composed",
                     "backend_ndarray/test_fused_matvec.py::test_rmsnorm_matvec"],
    "paged_attention": ["backend_ndarray/test_paged.py::test_paged_attention_matches_reference",
                        "backend_ndarray/test_paged.py::test_paged_write_stores_rows_and_skips_padding"],
    "precompile": ["backends/test_cuda_compile.py::test_precompile_ahead_fills_the_disk_cache",
                   "backends/test_cuda.py::test_precompile_then_use"],
    "sampling": ["backend_ndarray/test_sampling.py::test_devices_match_the_reference",
                 "models/test_generate.py::test_sampled_tokens_are_the_same_on_every_device"],
    "int8": ["backend_ndarray/test_quant.py::test_quant_matmul_matches_the_reference",
             "backend_ndarray/test_quant.py::test_dequantize_matches_the_reference"],
    "int4": ["backend_ndarray/test_quant.py::test_quant_matmul_matches_the_reference",
             "models/test_quantize.py::test_quantized_checkpoint_loads_and_generates"],
    "fused_quant_matvec": [
        "backend_ndarray/test_quant_decode.py::test_rmsnorm_matvec_with_packed_weights",
        "models/test_quantize.py::test_quantized_decode_as_five_operations_matches_composed"],
    "attention_backward": [
        "backends/test_attention_backward.py::test_heads_first_matches_float64",
        "backends/test_attention_backward.py::test_tensor_gradient_takes_the_fused_backward"],
    "token_major_attention": [
        "backend_ndarray/test_transformer_ops.py::test_attention_of_token_major_query_rows",
        "models/test_llama_vs_hf.py::test_cached_decode_matches_full_forward"],
    "matmul_swiglu": [
        "backend_ndarray/test_transformer_ops.py::test_matmul_swiglu_is_the_product_then_swiglu",
        "backends/test_cuda_tma.py::test_glu_gemm_writes_the_activation_in_one_pass"],
    "matmul_geglu": [
        "backend_ndarray/test_transformer_ops.py::test_matmul_geglu_is_the_product_then_geglu",
        "backends/test_cuda_gemv.py::test_gemv_geglu_is_the_product_then_geglu"],
    "folded_norm_matvec": [
        "backend_ndarray/test_fused_matvec.py::test_a_norm_folded_into_the_weight",
        "models/test_llama_vs_hf.py::test_folded_norms_match_the_checkpoint_weights"],
    "multi_tensor_adam": [
        "backend_ndarray/test_adam_many.py::test_many_is_each_parameter_alone_bitwise",
        "backend_ndarray/test_adam_many.py::test_cuda_launches_sixteen_parameters_at_a_time"],
}


def test_every_enabled_backend_implements_the_contract(device):
    backend = device.backend
    assert api.missing_functions(backend) == []
    assert isinstance(backend, api.ArrayBackend)
    assert backend.capabilities <= set(api.CAPABILITIES), backend.capabilities


def _parameters(fn) -> list[str] | None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # extension functions may carry no signature
        return None
    kinds = {p.kind for p in params.values()}
    if kinds and kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        return None  # (*args, **kwargs): what some nanobind versions report for a native
        # function (the H100 machine's build of the cpu backend): it names no parameters
    return [p for p in params if p != "self"]


def test_signatures_match_the_protocol(device):
    """Where a backend's functions carry Python signatures, their parameter names are the
    protocol's (numpy_ref's), in order: callers pass several by keyword."""
    backend = device.backend
    elementwise = {f"ewise_{op}": ["a", "b", "out"] for op in api.BINARY_OPS}
    elementwise |= {f"scalar_{op}": ["a", "value", "out"] for op in api.BINARY_OPS}
    elementwise |= {f"ewise_{op}": ["a", "out"] for op in api.UNARY_OPS}
    checked = 0
    for name in api.required_functions():
        proto = getattr(api.ArrayBackend, name, None)
        want = elementwise.get(name) or (_parameters(proto) if proto is not None else None)
        got = _parameters(getattr(backend, name))
        if want is None or got is None or name == "Array":
            continue
        assert got == want, (device.name, name)
        checked += 1
    if device.kind in ("cpu_numpy", "cuda", "metal"):
        unchecked = [n for n in api.required_functions()
                     if _parameters(getattr(backend, n)) is None]
        assert checked == len(api.required_functions()) - 1, (device.name, unchecked)


def test_every_capability_is_named_by_a_test_that_exists():
    assert set(CAPABILITY_TESTS) == set(api.CAPABILITIES)
    for capability, tests in CAPABILITY_TESTS.items():
        assert tests, capability
        for test in tests:
            path, _, name = test.partition("::")
            tree = ast.parse((TESTS / path).read_text())
            defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in defined, f"{capability}: {test} does not exist"


def test_has_knows_every_name():
    backend = nd.cpu_numpy().backend
    assert api.has(backend, "host_memory") and not api.has(backend, "graphs")
    assert api.has(backend, "int4") and api.has(backend, "paged_attention")
    with pytest.raises(ValueError, match="unknown backend capability 'graph'"):
        api.has(backend, "graph")


@pytest.mark.parametrize("device", devices_with("memory_stats"), indirect=True,
                         ids=lambda d: d.name)
def test_memory_stats_capability(device):
    backend = device.backend
    x = nd.array(np.ones(1 << 16, np.float32), device=device)
    stats = backend.memory_stats()
    assert stats.in_use >= x.nbytes and stats.peak >= stats.in_use
    assert backend.memory_available() > 0
    backend.empty_cache()


# --- DLPack: the device comes from the producer ------------------------------------------
def test_from_dlpack_takes_the_host_device_from_the_producer():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = nd.from_dlpack(a)
    assert x.device == nd.cpu_numpy()
    np.testing.assert_array_equal(x.numpy(), a)
    import torch
    t = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    y = nd.from_dlpack(t)
    assert y.device == nd.cpu_numpy() and y.dtype == "int32"
    np.testing.assert_array_equal(y.numpy(), t.numpy())


class _Foreign:
    """A DLPack producer on a device needle has no backend for (ROCm)."""

    def __dlpack_device__(self):
        return (10, 0)

    def __dlpack__(self, stream=None):
        raise AssertionError("never read: the device is refused first")


def test_from_dlpack_refuses_devices_needle_lacks():
    with pytest.raises(DeviceError, match="ROCm device .* no backend"):
        nd.from_dlpack(_Foreign())
    with pytest.raises(DTypeError, match="exports DLPack"):
        nd.from_dlpack([1, 2, 3])


def test_from_dlpack_of_a_cuda_producer_names_the_cuda_device():
    class OnCuda1(_Foreign):
        def __dlpack_device__(self):
            return (2, 1)

    if nd.cuda(1).enabled():
        pytest.skip("a second CUDA device is present")
    with pytest.raises(DeviceError, match="cuda"):
        nd.from_dlpack(OnCuda1())
