"""needle: a small deep-learning framework over CPUs, NVIDIA GPUs and Apple GPUs."""

from . import amp, autograd, backend_ndarray, data, init, nn, ops, optim
from .amp import autocast
from .autograd import (
    Tensor,
    TensorTuple,
    enable_grad,
    grad,
    is_grad_enabled,
    no_grad,
    set_grad_enabled,
)
from .backend_ndarray import all_devices, cpu, cpu_numpy, cuda, default_device, metal
from .backends.precision import get_float32_matmul_precision, set_float32_matmul_precision
from .checkpointing import checkpoint
from .compiled import CompileFallbackWarning, compile  # noqa: A004 -- as torch.compile
from .errors import (
    ArgumentError,
    ArgumentTypeError,
    AxisError,
    DataFormatError,
    DeviceError,
    DTypeError,
    GenerationError,
    GradientError,
    IndexOutOfRangeError,
    KernelCompileError,
    KernelLaunchError,
    ModelFormatError,
    NeedleError,
    OutOfMemoryError,
    ShapeError,
)
from .factories import (  # PyTorch-named creation functions (docs/compat.md)
    arange,
    cat,
    full,
    full_like,
    manual_seed,
    ones,
    ones_like,
    rand,
    randn,
    tensor,
    zeros,
    zeros_like,
)
from .ops import *  # noqa: F403
from .serialization import load, save

__version__ = "0.1.0"
