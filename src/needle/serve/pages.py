"""The paged KV cache: one pool of fixed-size pages for every sequence (the vLLM design).

``PagePool`` is the bookkeeping (which page ids are free, how many are promised to admitted
sequences); ``PagedKVCache`` holds the device arrays, per layer a key pool and a value pool
shaped (num_pages, page_size, kv_heads, head_dim); ``BlockTable`` is one sequence's list of
page ids. A sequence is admitted only when the pool can promise it every page it may need
(prompt + max_tokens), so a running sequence never waits for memory and nothing is ever
preempted; its pages are taken as its positions reach them and all returned when it
finishes or is cancelled.

Prefix sharing and caching: a full page is named by a chained hash of every token up to
its end (``prefix_keys``). A sequence whose prompt begins with named pages takes them
instead of computing them again, whether another sequence holds them or they are the
cached pages of a finished one: a page named and no longer held stays in the pool as a
cached page, counted free, and is handed out again (least recently used first) only when
no never-used page is left. A conversation's next turn, which sends the whole history
again, then reads only its new tokens.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
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
    use, or promised to admitted sequences) and free to promise; of the free ones,
    ``cached`` hold a finished sequence's named prefix."""

    total: int
    used: int
    reserved: int
    page_size: int
    cached: int = 0

    @property
    def free(self) -> int:
        return self.total - self.reserved


class PagePool:
    """Free page ids, a reference count per page in use (a full page of prompt may be
    shared by sequences whose prompts begin alike), the named pages no sequence holds
    (cached, free to hand out), and the pages promised to admitted sequences but not yet
    taken. Invariant: free pages (never used or cached) >= promised pages, so every
    ``take`` of a promised page succeeds. Not thread-safe: the engine's step loop is its
    only user."""

    def __init__(self, num_pages: int, page_size: int, cache_prefixes: bool = True):
        if num_pages < 1 or page_size < 1:
            raise OutOfMemoryError(f"a KV pool needs at least one page of at least one "
                                   f"position, got {num_pages} pages of {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.cache_prefixes = cache_prefixes
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages
        self._promised = 0
        # prefix sharing: hash of the tokens of positions 0..end of a full page -> that
        # page, while some sequence holds it or it is cached
        self._prefix: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    def _available(self) -> int:
        return len(self._free) + len(self._cached)

    def can_reserve(self, pages: int, reviving: int = 0) -> bool:
        """Whether ``pages`` more can be promised while ``reviving`` cached pages are
        taken back into use (they stop counting as free)."""
        return self._promised + pages <= self._available() - reviving

    def reserve(self, pages: int) -> None:
        if not self.can_reserve(pages):
            raise PagePoolError(f"cannot reserve {pages} pages: "
                                f"{self._available() - self._promised} are free")
        self._promised += pages

    def unreserve(self, pages: int) -> None:
        if pages > self._promised:
            raise PagePoolError(f"cannot release {pages} reserved pages; only "
                                f"{self._promised} are reserved")
        self._promised -= pages

    def take(self) -> int:
        """One page id, from what a sequence reserved: a never-used page while there is
        one, else the least recently used cached page (its name forgotten)."""
        if not self._available() or not self._promised:
            raise PagePoolError("no reserved page to take: take() beyond the reservations")
        self._promised -= 1
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._cached.popitem(last=False)
            del self._prefix[self._key_of.pop(page)]
        self._refs[page] = 1
        return page

    def is_cached(self, page: int) -> bool:
        return page in self._cached

    def share(self, page: int) -> None:
        """One more sequence holds ``page`` (a named prefix page, held or cached)."""
        if page in self._cached:
            del self._cached[page]
        elif self._refs[page] < 1:
            raise PagePoolError(f"page {page} is not in use; it cannot be shared")
        self._refs[page] += 1

    def give_back(self, pages: list[int]) -> None:
        """Pages a sequence no longer holds, in position order: a named one no one else
        holds is cached (the later pages of a prefix first, so that eviction takes a
        prefix from its end), the rest are free again."""
        for page in pages:
            if not 0 <= page < self.num_pages or self._refs[page] < 1:
                raise PagePoolError(f"page {page} was not taken from this pool")
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            if page in self._key_of and self.cache_prefixes:
                self._cached[page] = None
                continue
            key = self._key_of.pop(page, None)
            if key is not None:
                del self._prefix[key]
            self._free.append(page)

    # --- prefix sharing ----------------------------------------------------------------
    def remember(self, key: bytes, page: int) -> None:
        """``page`` now holds the keys and values of the prefix ``key`` names."""
        if key not in self._prefix and page not in self._key_of:
            self._prefix[key], self._key_of[page] = page, key

    def lookup(self, key: bytes) -> int | None:
        return self._prefix.get(key)

    def stats(self) -> PoolStats:
        used = self.num_pages - self._available()
        return PoolStats(self.num_pages, used, used + self._promised, self.page_size,
                         len(self._cached))


class BlockTable:
    """One sequence's pages, in position order, and how many more it may take."""

    def __init__(self, pool: PagePool, reserved_pages: int, shared: list[int] = ()):
        """``shared``: named pages of a prompt prefix, held by other sequences or cached
        (they count against ``reserved_pages`` without being taken). The pool must have
        room (``can_reserve(reserved_pages - len(shared), reviving=cached ones)``)."""
        self.pool, self.pages = pool, []
        self.left = reserved_pages - len(shared)
        if not pool.can_reserve(self.left, sum(map(pool.is_cached, shared))):
            raise PagePoolError(f"cannot reserve {self.left} pages beside {len(shared)} "
                                "shared ones")
        for page in shared:  # cached ones first leave the free pages, then the promise
            pool.share(page)
            self.pages.append(page)
        pool.reserve(self.left)

    def ensure(self, positions: int) -> None:
        """Take pages until positions 0..positions-1 have slots."""
        while len(self.pages) * self.pool.page_size < positions:
            if self.left <= 0:
                raise PagePoolError("the sequence needs more pages than it reserved")
            self.pages.append(self.pool.take())
            self.left -= 1

    def slots(self, start: int, stop: int) -> np.ndarray:
        """The pool slots of positions start..stop-1 (int64)."""
        size = self.pool.page_size
        positions = np.arange(start, stop)
        return np.asarray(self.pages, np.int64)[positions // size] * size + positions % size

    def release(self) -> None:
        """Every page back to the pool (shared ones once no one holds them), and the pages
        promised but not taken (idempotent)."""
        self.pool.give_back(self.pages)
        self.pool.unreserve(self.left)
        self.pages, self.left = [], 0


def prefix_keys(tokens: list[int], page_size: int, pages: int,
                known: list[bytes] = ()) -> list[bytes]:
    """Keys naming the first ``pages`` full pages of ``tokens``: page k's key is a chained
    SHA-256 over every token of positions 0..(k+1)*page_size-1 (a page's keys and values
    depend on all of them). ``known``: the first pages' keys, worked out before (the chain
    goes on from them)."""
    keys = list(known[:pages])
    digest = keys[-1] if keys else b""
    for k in range(len(keys), pages):
        page = np.asarray(tokens[k * page_size:(k + 1) * page_size], np.int64).tobytes()
        digest = hashlib.sha256(digest + page).digest()
        keys.append(digest)
    return keys


class PagedKVCache:
    """Per layer, a key pool and a value pool (num_pages, page_size, kv_heads, head_dim) on
    the model's device, in the model's dtype."""

    def __init__(self, cfg, num_pages: int, page_size: int, device, dtype: str,
                 cache_prefixes: bool = True):
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.keys = [nd.empty(shape, dtype, device) for _ in range(cfg.num_layers)]
        self.values = [nd.empty(shape, dtype, device) for _ in range(cfg.num_layers)]
        self.pool = PagePool(num_pages, page_size, cache_prefixes)

    @staticmethod
    def page_bytes(cfg, page_size: int, dtype: str) -> int:
        """Bytes of one page across every layer, keys and values."""
        return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * ITEMSIZE[dtype]

    @classmethod
    def from_budget(cls, cfg, budget_bytes: int, page_size: int, device, dtype: str,
                    cache_prefixes: bool = True):
        """As many pages as fit in ``budget_bytes``."""
        pages = int(budget_bytes) // cls.page_bytes(cfg, page_size, dtype)
        if pages < 1:
            raise OutOfMemoryError(
                f"a KV budget of {budget_bytes} bytes holds no page of {page_size} positions "
                f"({cls.page_bytes(cfg, page_size, dtype)} bytes); give a larger --kv-memory")
        return cls(cfg, pages, page_size, device, dtype, cache_prefixes)
