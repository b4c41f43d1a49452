"""Run by test_collectives.py with NEEDLE_DIST_CHECK=1: rank 1 all-reduces a different
shape than rank 0; both must raise, naming the other, and carry on (prints "caught <rank>")."""

import numpy as np

from needle import backend_ndarray as nd
from needle import distributed as dist
from needle.errors import DistributedError

g = dist.init_process_group()
assert g.check
x = nd.array(np.ones(3 + g.rank, np.float32))
try:
    dist.all_reduce(x)
except DistributedError as e:
    assert f"rank(s) {1 - g.rank} call a different" in str(e), e
    print(f"caught {g.rank}", flush=True)
np.testing.assert_array_equal(x.numpy(), np.ones(3 + g.rank))  # untouched
same = nd.array(np.ones(4, np.float32))
np.testing.assert_array_equal(dist.all_reduce(same).numpy(), np.full(4, 2.0))
dist.destroy_process_group()
