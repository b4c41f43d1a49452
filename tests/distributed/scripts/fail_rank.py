"""Rank 1 fails with status 3 (after 2 s, so that the others have printed their variables
even on a busy machine); the others would run for a minute unless stopped.
With "hang" as argument, rank 1 instead sleeps while rank 0 waits for it in an all_reduce
(the group's timeout must end that wait)."""

import os
import sys
import time

rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
print(f"rank {rank} of {os.environ.get('WORLD_SIZE', os.environ.get('OMPI_COMM_WORLD_SIZE'))} "
      f"local {os.environ.get('LOCAL_RANK', os.environ.get('OMPI_COMM_WORLD_LOCAL_RANK'))}",
      flush=True)
if sys.argv[1:] == ["hang"]:
    from needle import backend_ndarray as nd
    from needle import distributed as dist

    dist.init_process_group()
    if rank == 1:
        time.sleep(60)
    dist.all_reduce(nd.array([1.0]))
elif rank == 1:
    time.sleep(2)
    sys.exit(3)
time.sleep(60)
