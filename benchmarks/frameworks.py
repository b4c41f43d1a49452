"""The frameworks a benchmark runs on: needle on its device, and the peers present.

A framework knows what the runner needs to time it fairly: how to put the same numpy data on
its device, how to wait for its queued work (so that a time covers the work, not just the
enqueue), how to bring a result back for the correctness check, and how to describe itself
(version, threads, GPU) for the record. Peers are compared on
the device needle runs on: numpy for the CPU devices, PyTorch on the same device (CPU, CUDA or
MPS) when it is installed.
"""

from __future__ import annotations

import numpy as np

from needle.backend_ndarray import Device, NDArray
from needle.backend_ndarray.dtypes import to_numpy_dtype

CPU_KINDS = ("cpu", "cpu_numpy")


class Framework:
    """Base: a named place where arrays live and ops run."""

    name = ""

    def put(self, x: np.ndarray, dtype: str = "float32"):
        """``x`` as this framework's array of ``dtype`` on its device (a copy of the data)."""
        raise NotImplementedError

    def sync(self) -> None:
        """Wait until queued work has finished; eager frameworks have nothing to wait for."""

    def to_numpy(self, result) -> np.ndarray:
        return np.asarray(result)

    def release(self) -> None:
        """Hand cached memory back between cases, so one case's pool cannot starve the next."""

    def describe(self) -> dict:
        raise NotImplementedError


class Needle(Framework):
    name = "needle"

    def __init__(self, device: Device):
        self.device = device

    def put(self, x: np.ndarray, dtype: str = "float32") -> NDArray:
        return NDArray(x, device=self.device, dtype=dtype)

    def sync(self) -> None:
        self.device.synchronize()

    def to_numpy(self, result) -> np.ndarray:
        return np.asarray(result.numpy())  # an NDArray or a Tensor

    def describe(self) -> dict:
        import needle

        info = {"version": needle.__version__, "device": self.device.name}
        backend = self.device.backend
        if callable(getattr(backend, "num_threads", None)):  # the native CPU backend's OpenMP
            info["threads"] = backend.num_threads()
        return info


class Numpy(Framework):
    name = "numpy"

    def put(self, x: np.ndarray, dtype: str = "float32") -> np.ndarray:
        return np.array(x, dtype=to_numpy_dtype(dtype))

    def describe(self) -> dict:
        blas = {}
        try:
            blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        except Exception:  # older numpy: no dict mode; the version alone still identifies it
            blas = {}
        return {"version": np.__version__, "blas": blas.get("name"),
                "blas_config": blas.get("openblas configuration")}


class Torch(Framework):
    name = "torch"

    def __init__(self, torch, device: str):
        self.torch = torch
        self.device = torch.device(device)

    def put(self, x: np.ndarray, dtype: str = "float32"):
        # numpy has no bfloat16 torch understands: go through float32, round on the way in
        host = np.array(x, dtype=np.float32 if dtype == "bfloat16" else to_numpy_dtype(dtype))
        return self.torch.from_numpy(host).to(device=self.device, dtype=getattr(self.torch, dtype))

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            self.torch.mps.synchronize()

    def release(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    def to_numpy(self, result) -> np.ndarray:
        t = result.detach()
        return (t.float() if t.is_floating_point() else t).cpu().numpy()

    def describe(self) -> dict:
        info = {"version": self.torch.__version__, "device": str(self.device),
                "threads": self.torch.get_num_threads()}
        if self.device.type == "cuda":
            info["gpu"] = self.torch.cuda.get_device_name(self.device)
            info["allow_tf32"] = self.torch.backends.cuda.matmul.allow_tf32
        return info


def _torch_for(device: Device) -> tuple[Framework | None, str | None]:
    """PyTorch on ``device``'s hardware, or None and the reason it cannot be a peer."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if device.kind in CPU_KINDS:
        return Torch(torch, "cpu"), None
    if device.kind == "cuda":
        if not torch.cuda.is_available():
            return None, f"torch {torch.__version__} has no CUDA here"
        # Compare like with like: fp32 matmul in true fp32 (needle uses TF32 only when asked).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return Torch(torch, f"cuda:{device.index}"), None
    if device.kind == "metal":
        if not torch.backends.mps.is_available():
            return None, f"torch {torch.__version__} has no MPS here"
        return Torch(torch, "mps"), None
    return None, f"no torch peer for {device.kind}"


def frameworks_for(device: Device) -> tuple[dict[str, Framework], dict[str, str]]:
    """needle plus the peers present on ``device``, and why any expected peer is missing."""
    found: dict[str, Framework] = {"needle": Needle(device)}
    missing: dict[str, str] = {}
    if device.kind in CPU_KINDS:
        found["numpy"] = Numpy()
    torch_fw, why = _torch_for(device)
    if torch_fw is not None:
        found["torch"] = torch_fw
    else:
        missing["torch"] = why or ""
    return found, missing
