"""``DistributedDataParallel``: one model replica per rank, gradients averaged over ranks.

Each rank runs the forward and backward pass on its own share of the batch; then the
gradients are averaged over the ranks in buckets (each bucket one flat array, one
all-reduce), so every replica takes the same optimizer step and the replicas stay equal.
With equal shares this is exactly the step of one process on the whole batch.

The all-reduces run after ``backward`` returns: needle's autograd hands gradients to the
leaves at the end of the pass, so there is no point to start them earlier. On the nccl
backend they are queued on the device's stream behind the backward kernels and the host
goes on (to the optimizer step) without waiting.
"""

from __future__ import annotations

from .. import checks
from ..autograd import Tensor
from ..backend_ndarray import NDArray, concatenate, zeros
from ..errors import ArgumentTypeError
from ..nn import Module
from .collectives import all_reduce, broadcast
from .group import group

DEFAULT_BUCKET_MB = 25.0


class DistributedDataParallel(Module):
    """Wrap ``module`` for data-parallel training in the current process group.

    At construction rank 0's parameters and buffers are copied to every rank. After each
    ``loss.backward()`` call ``sync_gradients()`` (or call ``ddp.backward(loss)``, which
    does both) before the optimizer step. ``state_dict``/``load_state_dict`` are the
    wrapped module's, without a prefix, so checkpoints load with or without the wrapper.
    """

    def __init__(self, module: Module, bucket_mb: float = DEFAULT_BUCKET_MB):
        super().__init__()
        if not isinstance(module, Module):
            raise ArgumentTypeError(f"DistributedDataParallel wraps an nn.Module, got "
                                    f"{type(module).__name__}")
        bucket_mb = checks.number(bucket_mb, "bucket_mb", "DistributedDataParallel", 0.0,
                                  low_open=True)
        self.module = module
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.world_size = group().world_size
        for array in module.state_dict().values():
            broadcast(array, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self) -> dict[str, NDArray]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        self.module.load_state_dict(state, strict)

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()``, then ``sync_gradients()``."""
        loss.backward()
        self.sync_gradients()

    def sync_gradients(self) -> None:
        """Average every parameter's gradient over the ranks (a parameter without one on
        this rank counts as a zero gradient, so that all ranks reduce the same buckets)."""
        if self.world_size == 1:
            return
        for bucket in self._buckets():
            self._reduce_bucket(bucket)

    def _buckets(self) -> list[list]:
        """The trainable parameters, in order, grouped by gradient dtype into runs of at
        most ``bucket_bytes`` (a larger parameter gets a bucket of its own)."""
        buckets, current, size, dtype = [], [], 0, None
        for p in self.module.parameters():
            if not p.requires_grad:
                continue
            nbytes = p.realize_cached_data().nbytes
            if current and (p.dtype != dtype or size + nbytes > self.bucket_bytes):
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size, dtype = size + nbytes, p.dtype
        return buckets + ([current] if current else [])

    @staticmethod
    def _reduce_bucket(params: list) -> None:
        grads = [(p.grad.realize_cached_data() if p.grad is not None
                  else zeros(p.shape, p.dtype, p.device)) for p in params]
        flat = concatenate([g.astype(params[0].dtype).compact().reshape((g.size,))
                            for g in grads])
        all_reduce(flat, "avg")
        start = 0
        for p in params:
            n = p.realize_cached_data().size
            p.grad = Tensor(flat[start:start + n].reshape(p.shape), requires_grad=False)
            start += n
