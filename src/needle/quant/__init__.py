"""Weight-only quantization: needle's packed int8/int4 formats (docs/quantization.md), the
quantizer of checkpoints (``needle quantize``) and the repacking of GGUF block formats."""

from .format import QuantSpec, dequantize, pack, quantize, unpack

__all__ = ["QuantSpec", "dequantize", "pack", "quantize", "unpack"]
