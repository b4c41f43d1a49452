"""needle: a small deep-learning framework over CPUs, NVIDIA GPUs and Apple GPUs."""

from . import backend_ndarray
from .backend_ndarray import all_devices, cpu, cpu_numpy, cuda, default_device, metal
from .errors import (AxisError, DeviceError, DTypeError, IndexOutOfRangeError,
                     KernelCompileError, KernelLaunchError, ModelFormatError, NeedleError,
                     OutOfMemoryError, ShapeError)

__version__ = "0.1.0"
