"""The paged KV cache: one pool of fixed-size pages for every sequence (the vLLM design).

``PagePool`` is the bookkeeping (which page ids are free, how many are promised to admitted
sequences); ``PagedKVCache`` holds the device arrays, per layer a key pool and a value pool
shaped (num_pages, page_size, kv_heads, head_dim); ``BlockTable`` is one sequence's list of
page ids. A sequence is admitted only when the pool can promise it every page it may need
(prompt + max_tokens), so a running sequence never waits for memory and nothing is ever
preempted; its pages are taken as its positions reach them and all returned when it
finishes or is cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import backend_ndarray as nd
from ..backend_ndarray.dtypes import ITEMSIZE
from ..errors import NeedleError, OutOfMemoryError


class PagePoolError(NeedleError):
    """Page bookkeeping was misused (a double free, taking pages that were not reserved)."""


@dataclass(frozen=True)
class PoolStats:
    """Pages of the pool: in use (holding keys), reserved (promised to admitted sequences,
    in use or not) and free to promise."""

    total: int
    used: int
    reserved: int
    page_size: int

    @property
    def free(self) -> int:
        return self.total - self.reserved


class PagePool:
    """Free page ids and the count promised to admitted sequences. Not thread-safe: the
    engine's step loop is its only user."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise OutOfMemoryError(f"a KV pool needs at least one page of at least one "
                                   f"position, got {num_pages} pages of {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._reserved = 0

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    def can_reserve(self, pages: int) -> bool:
        return self._reserved + pages <= self.num_pages

    def reserve(self, pages: int) -> None:
        if not self.can_reserve(pages):
            raise PagePoolError(f"cannot reserve {pages} pages: {self.num_pages - self._reserved}"
                                " are free")
        self._reserved += pages

    def unreserve(self, pages: int) -> None:
        if pages > self._reserved:
            raise PagePoolError(f"cannot release {pages} reserved pages; only "
                                f"{self._reserved} are reserved")
        self._reserved -= pages

    def take(self) -> int:
        """One page id, from what a sequence reserved."""
        if not self._free:
            raise PagePoolError("no free page: take() beyond the reservations")
        return self._free.pop()

    def give_back(self, pages: list[int]) -> None:
        for page in pages:
            if not 0 <= page < self.num_pages or page in self._free:
                raise PagePoolError(f"page {page} was not taken from this pool")
            self._free.append(page)

    def stats(self) -> PoolStats:
        return PoolStats(self.num_pages, self.num_pages - len(self._free), self._reserved,
                         self.page_size)


class BlockTable:
    """One sequence's pages, in position order, and the pages it may still take."""

    def __init__(self, pool: PagePool, reserved_pages: int):
        self.pool, self.pages, self.reserved = pool, [], reserved_pages
        pool.reserve(reserved_pages)

    def ensure(self, positions: int) -> None:
        """Take pages until positions 0..positions-1 have slots."""
        while len(self.pages) * self.pool.page_size < positions:
            if len(self.pages) >= self.reserved:
                raise PagePoolError(f"the sequence reserved {self.reserved} pages and needs "
                                    "more")
            self.pages.append(self.pool.take())

    def slot(self, position: int) -> int:
        size = self.pool.page_size
        return self.pages[position // size] * size + position % size

    def release(self) -> None:
        """Every page back to the pool, and the reservation with them (idempotent)."""
        self.pool.give_back(self.pages)
        self.pool.unreserve(self.reserved)
        self.pages, self.reserved = [], 0


class PagedKVCache:
    """Per layer, a key pool and a value pool (num_pages, page_size, kv_heads, head_dim) on
    the model's device, in the model's dtype."""

    def __init__(self, cfg, num_pages: int, page_size: int, device, dtype: str):
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.keys = [nd.empty(shape, dtype, device) for _ in range(cfg.num_layers)]
        self.values = [nd.empty(shape, dtype, device) for _ in range(cfg.num_layers)]
        self.pool = PagePool(num_pages, page_size)

    @staticmethod
    def page_bytes(cfg, page_size: int, dtype: str) -> int:
        """Bytes of one page across every layer, keys and values."""
        return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * ITEMSIZE[dtype]

    @classmethod
    def from_budget(cls, cfg, budget_bytes: int, page_size: int, device, dtype: str):
        """As many pages as fit in ``budget_bytes``."""
        pages = int(budget_bytes) // cls.page_bytes(cfg, page_size, dtype)
        if pages < 1:
            raise OutOfMemoryError(
                f"a KV budget of {budget_bytes} bytes holds no page of {page_size} positions "
                f"({cls.page_bytes(cfg, page_size, dtype)} bytes); give a larger --kv-memory")
        return cls(cfg, pages, page_size, device, dtype)
