"""needle.distributed: many processes, one job.

- ``init_process_group()`` joins the job this process was launched into (``needle run``,
  torchrun, mpiexec); ``destroy_process_group()`` leaves it.
- Collectives on NDArrays: ``all_reduce``, ``all_gather``, ``reduce_scatter``,
  ``broadcast``, ``barrier`` — NCCL on cuda devices (queued on the device's stream,
  capturable), MPI (mpi4py) on CPU arrays.
- Data parallel training: ``DistributedDataParallel``, ``DistributedSampler``,
  ``save_checkpoint``/``load_checkpoint`` (rank 0 writes, any world size reads).
- Tensor-parallel inference of Llama-family models: ``load_tensor_parallel``.

See docs/distributed.md.
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .collectives import (
    REDUCE_OPS,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    reduce_scatter,
    symmetric_empty,
    synchronize,
)
from .data_parallel import DistributedDataParallel
from .group import (
    ProcessGroup,
    destroy_process_group,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    is_initialized,
)
from .sampler import DistributedSampler
from .tensor_parallel import load_tensor_parallel
