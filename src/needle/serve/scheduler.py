"""Which sequences run in the next step, and which tokens of each (continuous batching).

Requests wait in arrival order; one is admitted when a running slot is free (``max_seqs``)
and the page pool can promise every page it may need. Each step feeds every decoding
sequence its last token, then spends the rest of the step's token budget
(``max_batch_tokens``) on prompt chunks of the sequences still prefilling, oldest first:
a long prompt is split across steps (chunked prefill), so running streams keep getting a
token every step while it is read.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..errors import NeedleError
from .pages import BlockTable, PagePool, prefix_keys
from .request import Request


class QueueFullError(NeedleError):
    """More requests are waiting than the engine's queue limit: retry later (HTTP 429)."""


class RequestTooLargeError(NeedleError):
    """A request needs more KV pages than the whole pool holds (HTTP 413)."""


@dataclass
class Work:
    """One sequence's part of a step: ``count`` tokens from position ``start``."""

    request: Request
    start: int
    count: int
    fed: bool = False  # a decode token not yet read: the previous step's choice, on the device

    @property
    def samples(self) -> bool:
        """Whether this part ends at the sequence's last known token, so that its logits
        choose the next token (every decode step; the last chunk of a prompt)."""
        return self.fed or self.start + self.count == self.request.length


class Scheduler:
    def __init__(self, pool: PagePool, max_seqs: int, max_batch_tokens: int, max_queue: int):
        self.pool, self.max_seqs = pool, max_seqs
        self.max_batch_tokens, self.max_queue = max_batch_tokens, max_queue
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def pages_needed(self, request: Request) -> int:
        return self.pool.pages_for(len(request.prompt) + request.max_tokens)

    def add(self, request: Request) -> None:
        need = self.pages_needed(request)
        if need > self.pool.num_pages:
            raise RequestTooLargeError(
                f"the prompt ({len(request.prompt)} tokens) plus max_tokens "
                f"({request.max_tokens}) need {need} KV pages but the pool has "
                f"{self.pool.num_pages}; ask for fewer tokens or give the server more "
                "--kv-memory")
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"{len(self.waiting)} requests are already waiting (the "
                                 f"queue limit); retry later")
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Move waiting requests to running while slots and pages allow, in order."""
        admitted = []
        while self.waiting and len(self.running) < self.max_seqs:
            request = self.waiting[0]
            need = self.pages_needed(request)
            shared = self._shared_prefix(request)
            reviving = sum(map(self.pool.is_cached, shared))
            if not self.pool.can_reserve(need - len(shared), reviving):
                break  # first come, first served: later requests wait behind it
            self.waiting.popleft()
            request.table = BlockTable(self.pool, need, shared)
            request.prefilled = request.cached_tokens = len(shared) * self.pool.page_size
            self.running.append(request)
            admitted.append(request)
        return admitted

    def _shared_prefix(self, request: Request) -> list[int]:
        """Named pages (held by other sequences, or cached) with the same leading prompt
        tokens (whole pages; the last prompt token is always computed, for its logits).
        None for a request scoring its prompt: every position's logits are wanted."""
        size = self.pool.page_size
        if request.prefix_keys is None:
            request.prefix_keys = prefix_keys(request.prompt, size,
                                              (len(request.prompt) - 1) // size)
        if request.params.prompt_logprobs is not None:
            return []
        shared = []
        for key in request.prefix_keys:
            page = self.pool.lookup(key)
            if page is None:
                break
            shared.append(page)
        return shared

    def remember_prefix(self, request: Request) -> None:
        """Offer the request's full prompt pages written so far for sharing."""
        size = self.pool.page_size
        done = min(request.prefilled // size, len(request.prefix_keys or ()))
        for k in range(request.remembered, done):
            self.pool.remember(request.prefix_keys[k], request.table.pages[k])
        request.remembered = max(request.remembered, done)

    def plan(self) -> list[Work]:
        """This step's work: one token per decoding sequence, then prompt chunks."""
        work = [Work(r, r.length - 1, 1) for r in self.running if r.prefilled == len(r.prompt)]
        budget = self.max_batch_tokens - len(work)
        for r in self.running:
            left = len(r.prompt) - r.prefilled
            if left and budget > 0:
                n = min(left, budget)
                work.append(Work(r, r.prefilled, n))
                budget -= n
        for w in work:
            w.request.table.ensure(w.start + w.count)
        return work

    def finish(self, request: Request, keep: bool = True) -> None:
        """Take a request out (finished or cancelled) and return its pages; with ``keep``
        (its cache holds what it wrote: not after a failed step) its full pages stay
        cached under their prefix names for later prompts that begin with its tokens."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.table is not None:
            if keep and self.pool.cache_prefixes:
                self._remember_written(request)
            request.table.release()

    def _remember_written(self, request: Request) -> None:
        """Name every full page whose positions' keys and values are written: the prompt
        read so far, and the answer but its last token (whose keys are written by a
        step that may not have run)."""
        size, pages = self.pool.page_size, request.table.pages
        written = (request.prefilled if request.prefilled < len(request.prompt)
                   else request.length - 1)
        full = min(written // size, len(pages))
        if full <= request.remembered:
            return
        tokens = list(request.prompt) + list(request.output)
        for k, key in enumerate(prefix_keys(tokens, size, full, request.prefix_keys or ())):
            self.pool.remember(key, pages[k])
