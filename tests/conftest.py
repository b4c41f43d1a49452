"""Shared test support: the ``device`` fixture, dtype tolerances and reference comparisons.

Every device needle knows of becomes one parameter of ``device`` (ids are device names), so a
run lists cpu_numpy, cpu, cuda:i and metal even where some are disabled: a disabled device is
skipped with the reason it gives, which is how CI shows why a backend did not run.

``NEEDLE_METAL_EMULATOR=1`` installs the Metal emulation harness (``tests/metal_emulator``)
before anything asks ``metal()`` whether it is enabled, so the suite runs on ``metal()``
without Apple hardware (design §6).
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest


def _install_metal_emulator() -> None:
    """Make ``metal()`` run through the MSL emulator when ``NEEDLE_METAL_EMULATOR=1``.

    Imported lazily: without the variable the harness is never touched, so a missing or
    broken harness cannot affect runs that do not ask for it.
    """
    if os.environ.get("NEEDLE_METAL_EMULATOR") != "1":
        return
    try:
        emulator = importlib.import_module("tests.metal_emulator")
    except ModuleNotFoundError as e:
        raise RuntimeError(
            "NEEDLE_METAL_EMULATOR=1 but the Metal emulation harness tests/metal_emulator "
            f"could not be imported ({e}); unset the variable or add the harness") from e
    emulator.install()


def _share_cores_between_workers() -> None:
    """pytest-xdist starts one process per worker, each with its own OpenMP team: give each
    worker its share of the cores instead of a full team each (set before cpu() loads)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if workers.isdigit() and int(workers) > 1 and "OMP_NUM_THREADS" not in os.environ:
        from needle.backends.cpu.threads import available_cpus

        os.environ["OMP_NUM_THREADS"] = str(max(1, available_cpus() // int(workers)))


_install_metal_emulator()  # before the first enabled() call caches metal()'s state
_share_cores_between_workers()

import needle.backend_ndarray as nd  # noqa: E402
from needle.errors import DTypeError  # noqa: E402

ALL_DEVICES = nd.all_devices()

# dtypes a device's hardware lacks; creating such an array must raise DTypeError (design §3).
UNSUPPORTED_DTYPES = {"metal": frozenset({"float64"})}


def enabled_devices() -> list[nd.Device]:
    """The devices that can run here (cpu_numpy always among them)."""
    return [d for d in ALL_DEVICES if d.enabled()]


def supports(device: nd.Device, dtype: str) -> bool:
    return dtype not in UNSUPPORTED_DTYPES.get(device.kind, ())


def check_unsupported_dtype(device: nd.Device, dtype: str) -> bool:
    """True (after asserting the DTypeError) when ``device`` cannot hold ``dtype``.

    Tests parametrized over dtypes start with ``if check_unsupported_dtype(...): return`` so
    that e.g. (metal, float64) checks the error instead of silently skipping.
    """
    if supports(device, dtype):
        return False
    with pytest.raises(DTypeError, match=dtype):
        nd.array(np.zeros(3), device=device, dtype=dtype)
    return True


@pytest.fixture(scope="session", params=ALL_DEVICES, ids=[d.name for d in ALL_DEVICES])
def device(request) -> nd.Device:
    """Every device, enabled or skipped with its reason (session-scoped: devices are singletons
    and hypothesis tests may use it)."""
    dev = request.param
    if not dev.enabled():
        pytest.skip(f"{dev.name} disabled: {dev.reason}")
    return dev


def devices_with(capability: str) -> list[nd.Device]:
    """The devices whose backend declares ``capability``, and the disabled ones (which the
    ``device`` fixture skips for their absent hardware), for parametrizing ``device``."""
    from needle.backends.api import has

    return [d for d in ALL_DEVICES if not d.enabled() or has(d.backend, capability)]


@pytest.fixture(scope="session", name="enabled_devices")
def enabled_devices_fixture() -> list[nd.Device]:
    return enabled_devices()


@pytest.fixture(scope="session")
def reference() -> nd.Device:
    """The reference device every backend is compared with."""
    return nd.cpu_numpy()


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator: tests make their own data, the same data on every run."""
    return np.random.default_rng(20240917)


# --- tolerances (design §7) -----------------------------------------------------------------

EXACT_DTYPES = frozenset({"uint8", "int8", "int32", "int64", "bool"})
_RTOL = {
    # kind: elementwise, reduction (sums, norms, softmax) or matmul (long dot products)
    "float64": {"elementwise": 1e-12, "reduction": 1e-11, "matmul": 1e-11},
    "float32": {"elementwise": 1e-5, "reduction": 1e-4, "matmul": 1e-4},
    "float16": {"elementwise": 1e-3, "reduction": 1e-3, "matmul": 1e-3},
    "bfloat16": {"elementwise": 1e-2, "reduction": 1e-2, "matmul": 1e-2},
}


def tolerance(dtype: str, kind: str = "elementwise") -> float:
    """Relative tolerance for results of ``dtype``; 0 for exact dtypes."""
    if dtype in EXACT_DTYPES:
        return 0.0
    return _RTOL[dtype][kind]


def to_numpy(x) -> np.ndarray:
    return x.numpy() if isinstance(x, nd.NDArray) else np.asarray(x)


def _comparable(x: np.ndarray) -> np.ndarray:
    """numpy's testing helpers do not see NaN in ml_dtypes' bfloat16; widen it (exactly)."""
    return x.astype(np.float32) if x.dtype == nd.dtypes.to_numpy_dtype("bfloat16") else x


def assert_equal(actual, expected) -> None:
    """Exact equality of values (NaN equal to NaN), after converting NDArrays to numpy."""
    np.testing.assert_array_equal(_comparable(to_numpy(actual)), _comparable(to_numpy(expected)))


def assert_close(actual, expected, dtype: str | None = None, kind: str = "elementwise",
                 scale: float | None = None, rtol: float | None = None) -> None:
    """Assert ``actual`` matches ``expected`` within the tolerance of ``dtype``.

    Shapes must match, NaN positions and infinities must match exactly; finite values may
    differ by ``rtol * max(|expected|, scale)`` where ``scale`` (default 1) is the magnitude
    below which relative error is meaningless (cancellation in sums and dot products).
    Integers and bools must be equal.
    """
    a, e = to_numpy(actual), to_numpy(expected)
    dtype = dtype or (actual.dtype if isinstance(actual, nd.NDArray) else None)
    assert a.shape == e.shape, f"shape {a.shape} != expected {e.shape}"
    rtol = tolerance(dtype, kind) if rtol is None else rtol
    if rtol == 0.0:
        assert_equal(a, e)
        return
    a64, e64 = a.astype(np.float64), e.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(a64), np.isnan(e64), err_msg="NaN positions differ")
    inf = np.isinf(e64) | np.isinf(a64)
    np.testing.assert_array_equal(a64[inf], e64[inf], err_msg="infinities differ")
    fin = ~(np.isnan(e64) | inf)
    if not fin.any():
        return
    bound = rtol * np.maximum(np.abs(e64[fin]), 1.0 if scale is None else scale)
    err = np.abs(a64[fin] - e64[fin])
    worst = int(np.argmax(err - bound))
    assert (err <= bound).all(), (
        f"{int((err > bound).sum())} of {err.size} elements differ beyond rtol {rtol} ({dtype}, "
        f"{kind}); worst: got {a64[fin][worst]!r}, expected {e64[fin][worst]!r}")
