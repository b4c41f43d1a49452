"""Checkpoints of data-parallel jobs: rank 0 writes, every rank reads.

Every replica holds the same parameters and optimizer state, so one copy is the whole
state: ``save_checkpoint`` lets rank 0 write it (needle's atomic safetensors ``save``) and
holds the other ranks at a barrier until the file is complete. The file is an ordinary
checkpoint, loadable by a job of any world size or by a single process.
"""

from __future__ import annotations

from ..serialization import load, save
from .collectives import barrier
from .group import get_rank, is_initialized


def save_checkpoint(state, path) -> None:
    """Write ``state`` (as ``needle.save`` takes it) from rank 0 only; every rank returns
    once the file is written. Without a process group, simply saves."""
    if get_rank() == 0:
        save(state, path)
    if is_initialized():
        barrier()


def load_checkpoint(path, device=None) -> dict:
    """Read a checkpoint on this rank (any world size; no communication)."""
    return load(path, device=device)
