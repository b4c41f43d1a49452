"""A projection with a LoRA adapter as one graph node: ``x Wᵀ (+ bias) + s (x Aᵀ) Bᵀ``.

Composed from ops, the graph of ``x Wᵀ + s (x Aᵀ) Bᵀ`` keeps the base product, the update,
the scaled update and their sum until the backward pass: four arrays of the output's size
for every adapted projection, where a gradient needs only x and the small x Aᵀ (what PEFT's
forward leaves PyTorch holding). For a 1.1B LoRA step at 4 x 512 tokens the three extra
ones come to ~4.8 GB (bf16), about what it held beyond PyTorch + PEFT (11.5 GiB against
7.0). As one node the output is the only array of that size kept, and the backward pass
recomputes x Aᵀ (rank r wide: cheap).
"""

from __future__ import annotations

from .. import ops
from ..amp import autocast_dtype, low_precision_inputs
from ..autograd import Tensor, TensorOp


class _LoraProjection(TensorOp):
    """Inputs x (..., in), weight W (out, in), A (r, in), B (out, r) and optionally bias
    (out,), one dtype; the products in the order the composed form takes them, so that the
    numbers match it."""

    def __init__(self, scale: float):
        self.scale = scale

    def compute(self, x, w, a, b, *bias):
        y = x @ w.permute((1, 0))
        if bias:
            y = y + bias[0].broadcast_to(y.shape)
        return y + ((x @ a.permute((1, 0))) @ b.permute((1, 0))) * self.scale

    def gradient(self, out_grad: Tensor, node: Tensor):
        x, w, a, b = node.inputs[:4]
        n_in, n_out = x.shape[-1], w.shape[0]
        x2 = ops.reshape(x, (-1, n_in))
        g2 = ops.reshape(out_grad, (-1, n_out))
        gs = g2 * self.scale  # the scaled update's gradient
        gxa = gs @ b  # of x Aᵀ: (rows, r)
        grads = [None, None, None, None]
        if x.requires_grad:
            grads[0] = ops.reshape(g2 @ w + gxa @ a, x.shape)
        if w.requires_grad:
            grads[1] = ops.transpose(g2) @ x2
        if a.requires_grad:
            grads[2] = ops.transpose(gxa) @ x2
        if b.requires_grad:
            grads[3] = ops.transpose(gs) @ (x2 @ ops.transpose(a))  # x Aᵀ again
        if len(node.inputs) == 5:
            grads.append(ops.summation(g2, (0,)) if node.inputs[4].requires_grad else None)
        return tuple(grads)


def lora_projection(x: Tensor, weight: Tensor, bias: Tensor | None, lora) -> Tensor | None:
    """``x Wᵀ (+ bias) + lora(x)`` as one node, or None where it does not apply (dropout
    on the adapter's input, or operands of different dtypes outside autocast: frozen bf16
    weights with float32 adapters), and the caller composes it."""
    if (lora.dropout is not None and lora.training) or x.ndim < 2:
        return None
    low = autocast_dtype()  # decided before casting: a declined call casts nothing
    dtypes = {low if low and t.dtype == "float32" else t.dtype
              for t in (x, weight, lora.lora_A, lora.lora_B)}
    if len(dtypes | ({bias.dtype} if bias is not None else set())) != 1:
        return None
    inputs = low_precision_inputs(x, weight, lora.lora_A, lora.lora_B)  # autocast
    return _LoraProjection(lora.scale)(*inputs, *([] if bias is None else [bias]))
