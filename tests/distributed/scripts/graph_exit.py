"""Run by test_nccl.py under `needle run -n 2 --backend nccl` (a machine of 2 GPUs): an
all-reduce recorded in a CUDA graph and replayed twice, then the group left while the graph
is still referenced. NCCL's destroy waits for every graph that holds its communicator, so
the ranks exit only if leaving closes it; a replay afterwards must say why it cannot run.
Prints "ok <rank>"."""

import numpy as np

from needle import backend_ndarray as nd
from needle import distributed as dist
from needle.errors import DeviceError

g = dist.init_process_group()
x = nd.array(np.full((1024,), g.rank + 1.0, np.float32), device=g.device)
with g.device.backend.capture() as graph:
    dist.all_reduce(x, "sum")
graph.replay()  # 1 + 2 = 3 on both ranks
graph.replay()  # 3 + 3 = 6
np.testing.assert_array_equal(x.numpy(), np.full(1024, 6.0, np.float32))
dist.destroy_process_group()
try:
    graph.replay()
except DeviceError as e:
    assert "destroy_process_group" in str(e), e
else:
    raise AssertionError("a graph of a destroyed group's collectives replayed")
print(f"ok {g.rank}", flush=True)
