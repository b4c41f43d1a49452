"""2-d convolution layer."""

from __future__ import annotations

import math

from .. import checks, init, ops
from ..errors import ArgumentError, ShapeError
from .nn_basic import Module, Parameter


class Conv(Module):
    """2-d convolution of NCHW input with square kernels, "same" padding by default.

    The layer takes and returns NCHW, as needle's does, and converts to the NHWC layout of
    ``ops.conv`` inside (the permutations are views, not copies). The weight is stored
    (kernel, kernel, in_channels, out_channels).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 padding: int | None = None, bias: bool = True, device=None, dtype="float32"):
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels),
                            ("kernel_size", kernel_size), ("stride", stride)):
            checks.positive(value, name, "nn.Conv")
        if padding is not None:
            checks.integer(padding, "padding", "nn.Conv", 0)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride = kernel_size, stride
        self.padding = kernel_size // 2 if padding is None else padding
        k2 = kernel_size * kernel_size
        self.weight = Parameter(init.kaiming_uniform(
            in_channels * k2, out_channels * k2,
            shape=(kernel_size, kernel_size, in_channels, out_channels), device=device,
            dtype=dtype))
        bound = 1 / math.sqrt(in_channels * k2)
        self.bias = Parameter(init.rand(out_channels, low=-bound, high=bound, device=device,
                                        dtype=dtype)) if bias else None

    def forward(self, x):
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ShapeError(f"Conv({self.in_channels}, {self.out_channels}) needs NCHW input "
                             f"with {self.in_channels} channels, got shape {x.shape}")
        nhwc = ops.permute(x, (0, 2, 3, 1))
        out = ops.conv(nhwc, self.weight, self.stride, self.padding)
        if self.bias is not None:
            out = out + self.bias
        return ops.permute(out, (0, 3, 1, 2))

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}")


def _square(value, name: str) -> int:
    """An int, or a pair of equal ints (needle's convolution has square kernels)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2 or value[0] != value[1]:
            raise ArgumentError(f"nn.Conv2d: {name}={value!r}: needle's convolution takes one "
                                "size for both axes (an int or a pair of equal ints)")
        value = value[0]
    return value


class Conv2d(Conv):
    """PyTorch's ``nn.Conv2d`` signature over needle's Conv: NCHW in and out, ``padding=0``
    by default (needle's Conv pads "same"), ``padding="same"`` or ``"valid"`` accepted.

    The weight keeps needle's layout (kernel, kernel, in_channels, out_channels); a PyTorch
    weight (out, in, kh, kw) loads as ``torch_weight.permute(2, 3, 1, 0)``.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1,
                 padding=0, bias: bool = True, device=None, dtype="float32"):
        kernel_size = _square(kernel_size, "kernel_size")
        stride = _square(stride, "stride")
        if padding == "valid":
            padding = 0
        elif padding == "same":
            if stride != 1 or not isinstance(kernel_size, int) or kernel_size % 2 == 0:
                raise ArgumentError("nn.Conv2d: padding='same' needs stride 1 and an odd "
                                    f"kernel_size, got stride={stride}, "
                                    f"kernel_size={kernel_size}")
            padding = kernel_size // 2
        else:
            padding = _square(padding, "padding")
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, bias,
                         device, dtype)
