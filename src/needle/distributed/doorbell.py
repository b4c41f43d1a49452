"""A wait on the host, with no deadline, that rank 0 ends for the other ranks: ``Doorbell``.

A collective waits at most the group's timeout, and on a GPU a rank waiting in one spins a
kernel; a tensor-parallel server's other ranks may wait for hours for the next request.
They wait here instead: on the job's store (nccl), or for an MPI message from rank 0 (mpi).
Each ring carries a short word (what to do next). A rank 0 that dies ends the wait with a
``DistributedError``: its store goes with it, or mpiexec ends the job.
"""

from __future__ import annotations

import time

from .group import group

POLL_S = 30.0  # a store wait is one call of at most this long, repeated
MPI_TAG = 7341
LONGEST_SLEEP_S = 5e-3  # between tests of an MPI receive


class Doorbell:
    """``ring(word)`` on rank 0 ends the other ranks' ``wait()``, which returns ``word``;
    rings are received in order, one ``wait`` each."""

    def __init__(self, name: str):
        g = group()
        self.name, self.rank, self.world_size = name, g.rank, g.world_size
        self._store = g.store
        self._comm = None if g.store is not None else g.backend.comm
        self._rung = self._heard = self._kept = 0

    def taken(self) -> None:
        """Rank 0, once it knows that every rank has taken the rings so far (they have
        joined a collective since): the store forgets them (a long-running server rings
        once per busy spell)."""
        if self._store is not None:
            for n in range(self._kept, self._rung):
                self._store.delete(f"{self.name}/{n}")
        self._kept = self._rung

    def ring(self, word: bytes) -> None:
        """Rank 0: end the others' current (or next) wait with ``word``."""
        if self._store is not None:
            self._store.set(f"{self.name}/{self._rung}", word)
        else:
            sent = [self._comm.isend(word, dest=r, tag=MPI_TAG)
                    for r in range(1, self.world_size)]
            for request in sent:
                request.wait()
        self._rung += 1

    def wait(self) -> bytes:
        """The other ranks: block until rank 0's next ring; its word."""
        if self._store is not None:
            key = f"{self.name}/{self._heard}"
            while (word := self._store.poll(key, POLL_S)) is None:
                pass
        else:
            request = self._comm.irecv(source=0, tag=MPI_TAG)
            sleep = 1e-5
            while True:
                done, word = request.test()
                if done:
                    break
                time.sleep(sleep)
                sleep = min(2 * sleep, LONGEST_SLEEP_S)
        self._heard += 1
        return word
