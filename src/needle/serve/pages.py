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

import hashlib
from dataclasses import dataclass

import numpy as np

from .. import backend_ndarray as nd
from ..backend_ndarray.dtypes import ITEMSIZE
from ..errors import NeedleError, OutOfMemoryError


class PagePoolError(NeedleError):
    """Page bookkeeping was misused (a double free, taking pages that were not reserved)."""


@dataclass(frozen=True)
class PoolStats:
    """Pages of the pool: in use (holding keys; a shared page counts once), reserved (in
    use, or promised to admitted sequences) and free to promise."""

    total: int
    used: int
    reserved: int
    page_size: int

    @property
    def free(self) -> int:
        return self.total - self.reserved


class PagePool:
    """Free page ids, a reference count per page in use (a full page of prompt may be
    shared by sequences whose prompts begin alike), and the pages promised to admitted
    sequences but not yet taken. Invariant: free pages >= promised pages, so every
    ``take`` of a promised page succeeds. Not thread-safe: the engine's step loop is its
    only user."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise OutOfMemoryError(f"a KV pool needs at least one page of at least one "
                                   f"position, got {num_pages} pages of {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages
        self._promised = 0
        # prefix sharing: hash of the tokens of positions 0..end of a full prompt page ->
        # that page, while some sequence holds it
        self._prefix: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    def can_reserve(self, pages: int) -> bool:
        return self._promised + pages <= len(self._free)

    def reserve(self, pages: int) -> None:
        if not self.can_reserve(pages):
            raise PagePoolError(f"cannot reserve {pages} pages: "
                                f"{len(self._free) - self._promised} are free")
        self._promised += pages

    def unreserve(self, pages: int) -> None:
        if pages > self._promised:
            raise PagePoolError(f"cannot release {pages} reserved pages; only "
                                f"{self._promised} are reserved")
        self._promised -= pages

    def take(self) -> int:
        """One page id, from what a sequence reserved."""
        if not self._free or not self._promised:
            raise PagePoolError("no reserved page to take: take() beyond the reservations")
        self._promised -= 1
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def share(self, page: int) -> None:
        """One more sequence holds ``page`` (a shared prompt page)."""
        if self._refs[page] < 1:
            raise PagePoolError(f"page {page} is not in use; it cannot be shared")
        self._refs[page] += 1

    def give_back(self, pages: list[int]) -> None:
        for page in pages:
            if not 0 <= page < self.num_pages or self._refs[page] < 1:
                raise PagePoolError(f"page {page} was not taken from this pool")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                key = self._key_of.pop(page, None)
                if key is not None:
                    del self._prefix[key]
                self._free.append(page)

    # --- prefix sharing ----------------------------------------------------------------
    def remember(self, key: bytes, page: int) -> None:
        """``page`` now holds the keys and values of the prompt prefix ``key`` names."""
        if key not in self._prefix and page not in self._key_of:
            self._prefix[key], self._key_of[page] = page, key

    def lookup(self, key: bytes) -> int | None:
        return self._prefix.get(key)

    def stats(self) -> PoolStats:
        used = self.num_pages - len(self._free)
        return PoolStats(self.num_pages, used, used + self._promised, self.page_size)


class BlockTable:
    """One sequence's pages, in position order, and how many more it may take."""

    def __init__(self, pool: PagePool, reserved_pages: int, shared: list[int] = ()):
        """``shared``: pages of a prompt prefix other sequences already hold (they count
        against ``reserved_pages`` without being taken)."""
        self.pool, self.pages = pool, []
        self.left = reserved_pages - len(shared)
        pool.reserve(self.left)
        for page in shared:
            pool.share(page)
            self.pages.append(page)

    def ensure(self, positions: int) -> None:
        """Take pages until positions 0..positions-1 have slots."""
        while len(self.pages) * self.pool.page_size < positions:
            if self.left <= 0:
                raise PagePoolError("the sequence needs more pages than it reserved")
            self.pages.append(self.pool.take())
            self.left -= 1

    def slot(self, position: int) -> int:
        size = self.pool.page_size
        return self.pages[position // size] * size + position % size

    def release(self) -> None:
        """Every page back to the pool (shared ones once no one holds them), and the pages
        promised but not taken (idempotent)."""
        self.pool.give_back(self.pages)
        self.pool.unreserve(self.left)
        self.pages, self.left = [], 0


def prefix_keys(tokens: list[int], page_size: int, pages: int) -> list[bytes]:
    """Keys naming the first ``pages`` full pages of ``tokens``: page k's key is a chained
    SHA-256 over every token of positions 0..(k+1)*page_size-1 (a page's keys and values
    depend on all of them)."""
    keys, digest = [], b""
    for k in range(pages):
        page = np.asarray(tokens[k * page_size:(k + 1) * page_size], np.int64).tobytes()
        digest = hashlib.sha256(digest + page).digest()
        keys.append(digest)
    return keys


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
