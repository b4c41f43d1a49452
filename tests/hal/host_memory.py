"""A HAL allocator over host memory, for testing the HAL's generic parts without a GPU.

Blocks are real ``ctypes`` allocations; a byte budget stands in for device memory, so the
out-of-memory path runs for real when the budget is spent.
"""

from __future__ import annotations

import ctypes

from needle.hal import Allocator


class HostAllocator(Allocator):
    def __init__(self, budget: int):
        super().__init__("host")
        self.budget = budget
        self.used = 0
        self.blocks: dict[int, ctypes.Array] = {}
        self.raw_allocs = self.raw_frees = 0

    def _allocate_raw(self, nbytes: int):
        if self.used + nbytes > self.budget:
            return None
        block = ctypes.create_string_buffer(nbytes)
        address = ctypes.addressof(block)
        self.blocks[address] = block
        self.used += nbytes
        self.raw_allocs += 1
        return address

    def _free_raw(self, handle) -> None:
        self.used -= len(self.blocks.pop(handle))
        self.raw_frees += 1

    def available(self) -> int:
        return self.budget - self.used
