"""The serving engine: continuous batching over a paged KV cache.

A loop of schedule -> one batched step -> append tokens -> free finished sequences
(design §9, after vLLM and nano-vllm). Requests can be submitted and cancelled from any
thread at any time; they join and leave the batch between steps. ``Engine.step`` runs one
step in the caller's thread (tests, ``generate``); ``start()`` runs steps on a background
thread for a server. Outputs stream through each request's queue (``Request.stream``).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import GenerationError, NeedleError
from ..models.causal_lm import CausalLM
from ..models.generate import prompt_ids
from ..models.sampling import Sampler
from ..models.tokenizer import StreamDecoder
from . import batch as batch_step
from . import choice, scoring
from .captured import DecodeGraphs
from .grammar import Grammars
from .metrics import EngineMetrics
from .pages import PagedKVCache
from .request import Request, RequestParams, TokenEvent, TokenLogprob
from .scheduler import Scheduler, Work

DEFAULT_PAGE_SIZE = 16
DEFAULT_BATCH_TOKENS = 2048


class EngineStoppedError(NeedleError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class Engine:
    """Batched generation for one model.

    ``max_seqs``: sequences decoding together. ``kv_memory``: bytes of the KV page pool
    (default: room for ``max_seqs`` sequences of ``model.max_seq_len`` positions).
    ``max_batch_tokens``: tokens per step (decode tokens plus prompt chunks; default 2,048,
    or twice ``max_seqs`` if more).
    ``max_queue``: waiting requests beyond which ``submit`` raises ``QueueFullError``.
    ``prefix_cache``: keep finished sequences' full pages for prompts that begin with their
    tokens, until the pages are needed (``pages.py``); off, only running sequences share.
    """

    def __init__(self, model, max_seqs: int = 32, kv_memory: int | None = None,
                 page_size: int = DEFAULT_PAGE_SIZE, max_batch_tokens: int | None = None,
                 max_queue: int = 1024, prefix_cache: bool = True):
        if not isinstance(model, CausalLM):
            raise GenerationError(f"Engine: model must be a CausalLM (from load_pretrained), got "
                                  f"{type(model).__name__}")
        for name, value in (("max_seqs", max_seqs), ("page_size", page_size),
                            ("max_queue", max_queue), ("kv_memory", kv_memory)):
            if value is None and name == "kv_memory":  # room for max_seqs full sequences
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GenerationError(f"{name} must be an int >= 1, got {value!r}")
        self.model = model
        if kv_memory is None:
            pages = max_seqs * -(-model.max_seq_len // page_size)
            kv_memory = pages * PagedKVCache.page_bytes(model.config, page_size, model.dtype)
        self.cache = PagedKVCache.from_budget(model.config, kv_memory, page_size,
                                              model.device, model.dtype, bool(prefix_cache))
        # A step's host work (~15-25 ms for an eager step of a 1.1B model on an H200) hardly
        # grows with its tokens, so one chunk of 2,048 reads a long prompt in one step:
        # 2,000-token TTFT 17 ms against 60-95 ms in 512-token chunks, and decoding streams'
        # longest gap meanwhile 23-27 ms against 29-32 (.hx/s36/r7.sh; docs/serving.md)
        max_batch_tokens = max_batch_tokens or max(DEFAULT_BATCH_TOKENS, 2 * max_seqs)
        if max_batch_tokens <= max_seqs:
            raise GenerationError(f"max_batch_tokens ({max_batch_tokens}) must exceed max_seqs "
                                  f"({max_seqs}), or prompts could never be read")
        self.scheduler = Scheduler(self.cache.pool, max_seqs, max_batch_tokens, max_queue)
        self.graphs = DecodeGraphs(model, self.cache,
                                   self.cache.pool.pages_for(model.max_seq_len))
        self.metrics = EngineMetrics()
        self._lock = threading.Condition()
        self._incoming: deque[Request] = deque()
        self._cancelled: set[int] = set()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._queued: _Queued | None = None  # a step on the device whose tokens are unread
        self._logits = None  # the last step's logits (device), for logprobs
        self._prompt_scores: list = []  # the last step's scored rows' log-softmax (device)
        self._queue_ahead = os.environ.get("NEEDLE_SERVE_AHEAD", "1") != "0"
        self._grammars: Grammars | None = None  # made on the first constrained request

    # --- submitting ------------------------------------------------------------------------
    def submit(self, prompt, params: RequestParams | None = None, listener=None) -> Request:
        """Queue a prompt (token ids, or text when the model has a tokenizer); returns the
        Request, whose ``stream()`` yields its TokenEvents."""
        request = self.make_request(prompt, params or RequestParams())
        request.listener = listener
        with self._lock:
            if self._stopping:
                raise EngineStoppedError("the engine is shutting down; no new requests")
            self.scheduler.add(request)  # QueueFullError / RequestTooLargeError
            self.metrics.prompt_tokens += len(request.prompt)
            self._lock.notify_all()
        return request

    def make_request(self, prompt, params: RequestParams) -> Request:
        model = self.model
        if isinstance(prompt, str):
            if model.tokenizer is None:
                raise GenerationError("a text prompt needs the model's tokenizer "
                                      "(tokenizer.json); pass token ids instead")
            prompt = model.tokenizer.encode(prompt)
        ids = prompt_ids(prompt, model.config.vocab_size)
        outside = [t for t, _ in params.logit_rules.bias
                   if not 0 <= t < model.config.vocab_size]
        if outside:
            raise GenerationError(f"logit_bias names token {outside[0]}, outside the "
                                  f"vocabulary [0, {model.config.vocab_size})")
        room = model.max_seq_len - len(ids)
        if room < (0 if params.max_tokens == 0 else 1):  # 0: scoring the prompt alone
            raise GenerationError(f"the prompt has {len(ids)} tokens; the model's max_seq_len "
                                  f"{model.max_seq_len} leaves no room for an answer")
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise GenerationError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) "
                                  f"exceed the model's max_seq_len {model.max_seq_len}")
        gen = model.generation_config
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(gen.eos_token_ids)
        s = params.sampling
        sampler = Sampler(s.temperature, s.top_k, s.top_p, s.seed, min_p=s.min_p,
                          repetition_penalty=s.repetition_penalty)
        sampler.observe(ids)
        detok = StreamDecoder(model.tokenizer) if model.tokenizer is not None else None
        request = Request(ids, params, max_tokens, frozenset(stop_ids), detok, sampler=sampler,
                          constraint=self._constraint(params))
        if params.prompt_logprobs is not None:
            request.prompt_logprobs.append(None)  # the first token: nothing precedes it
        return request

    def _constraint(self, params: RequestParams):
        """A fresh matcher of the request's grammar (None without one); the model's grammar
        compiler is made on the first (grammar.py)."""
        if params.grammar is None:
            return None
        with self._lock:  # one compiler, whichever thread submits first
            if self._grammars is None:
                model = self.model
                self._grammars = Grammars(model.tokenizer, model.config.vocab_size,
                                          model.generation_config.eos_token_ids)
        return self._grammars.constraint(params.grammar)

    def cancel(self, request: Request) -> None:
        """Stop a request (waiting or running) between steps; its pages are freed and its
        stream ends with finish_reason "cancelled"."""
        with self._lock:
            if not request.finished:
                self._cancelled.add(request.id)
                self._lock.notify_all()

    # --- running ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or self._cancelled or self._queued is not None)

    def step(self) -> int:
        """Admit, run one batched step, hand out the tokens; returns tokens produced.

        A captured decode step whose batch cannot change before the next one (nothing
        waiting or cancelled, no sequence at its last token) has the next step queued on
        the device, its tokens the ones chosen there, before its own tokens are read: the
        device runs a step while the host reads, checks and hands out the last one's."""
        start = time.perf_counter()
        queued, self._queued = self._queued, None
        work = queued.work if queued is not None else None
        try:
            if queued is None:
                with self._lock:
                    self._apply_cancels()
                    for r in self.scheduler.admit():
                        self.metrics.cached_prompt_tokens += r.cached_tokens
                    work = self.scheduler.plan()
                if not work:
                    return 0
                queued = self._launch(work)
            with self._lock:
                following = self._following(queued)
            if following is not None:
                self._queued = self._launch(following, fed=True)
                self.metrics.queued_ahead += 1
            tokens = queued.tokens()
            prompt_scores = scoring.read(queued.prompt_slices, queued.scored)
        except Exception as e:  # noqa: BLE001 - every request of the step learns why
            self._queued = None
            with self._lock:
                for w in work or ():
                    if not w.request.finished:
                        self._finish(w.request, TokenEvent(None, "", "error", str(e)))
            raise
        produced = 0
        with self._lock:
            for row, logprob in zip(queued.scored, prompt_scores):
                row.request.prompt_logprobs.append(logprob)
            j = 0  # the sampling row of w
            for w in work:
                r = w.request
                if w.start < len(r.prompt):  # a prompt chunk: its pages may be shared now
                    r.prefilled = w.start + w.count
                    self.scheduler.remember_prefix(r)
                if not w.samples:
                    continue
                token = tokens[j]
                if r.max_tokens == 0 and not r.finished:  # its prompt scored: nothing to make
                    self._finish(r, TokenEvent(None, "", "length"))
                elif not r.finished:  # else it ended after this step was queued: dropped
                    self._append(r, token, queued.logprob(j, token, r.params.logprobs))
                    produced += 1
                j += 1
        self.metrics.record_step(produced, time.perf_counter() - start)
        return produced

    def run_until_idle(self) -> None:
        while self.has_work():
            self.step()

    def generate(self, prompts: Sequence, params: RequestParams | None = None) -> list[list[int]]:
        """New token ids for each prompt, all decoded together."""
        requests = [self.submit(p, params) for p in prompts]
        if self._thread is None:
            self.run_until_idle()
        for r in requests:
            for _ in r.stream():
                pass
        errors = [r for r in requests if r.finish_reason == "error"]
        if errors:
            raise GenerationError(f"generation failed: {errors[0].error}")
        return [list(r.output) for r in requests]

    # --- a background loop -----------------------------------------------------------------
    def start(self) -> None:
        """Run steps on a daemon thread until ``shutdown``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="needle-engine",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self.has_work() and not self._stopping:
                    self._pause()
                    self._lock.wait()
                if self._stopping and not self.has_work():
                    return
            try:
                self.step()
            except Exception:  # noqa: BLE001 - the step's requests got the error already
                pass

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Take no new requests; finish (``drain``) or cancel the ones in flight; stop."""
        with self._lock:
            self._stopping = True
            if not drain:
                for r in list(self.scheduler.waiting) + self.scheduler.running:
                    self._cancelled.add(r.id)
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        else:
            self.run_until_idle()

    def _pause(self) -> None:
        """Called (lock held) before the background loop waits for work: a hook for a
        tensor-parallel engine, whose other ranks then wait on the host."""

    # --- internals (called with the lock held, except _batch) ------------------------------
    def _apply_cancels(self) -> None:
        if not self._cancelled:
            return
        s = self.scheduler
        for r in [r for r in list(s.waiting) + s.running if r.id in self._cancelled]:
            self._finish(r, TokenEvent(None, "", "cancelled"))
        self._cancelled.clear()

    def _finish(self, request: Request, event: TokenEvent) -> None:
        # after a failed step the request's pages may hold anything: not cached
        self.scheduler.finish(request, keep=event.finish_reason != "error")
        request.finish_reason, request.error = event.finish_reason, event.error
        self.metrics.finished[event.finish_reason] = \
            self.metrics.finished.get(event.finish_reason, 0) + 1
        request.emit(event)

    @staticmethod
    def _tokens_at(request: Request, start: int, stop: int) -> list[int]:
        """The sequence's tokens at positions start..stop-1 (prompt, then output)."""
        n = len(request.prompt)
        return list(request.prompt[start:min(stop, n)]) + \
            list(request.output[max(start - n, 0):max(stop - n, 0)])

    def _batch(self, work: list[Work], max_pages: int | None = None,
               dense_prompts: bool = True) -> tuple[batch_step.StepBatch,
                                                    list[scoring.ScoredRow]]:
        """The step's tokens laid end to end (decode tokens first, as the scheduler plans
        them); prompt chunks marked for dense attention unless ``dense_prompts`` is off.
        With it, the rows of prompt positions whose next token a request scores (its
        ``score_rows``), and what each scores."""
        tokens, positions, seq_of, slots, rows, scored = [], [], [], [], [], []
        max_pages = max_pages or max(len(w.request.table.pages) for w in work)
        tables = -np.ones((len(work), max_pages), np.int32)
        chunks = []
        at = 0  # tokens laid so far
        for i, w in enumerate(work):
            table, stop = w.request.table, w.start + w.count
            prompt = w.request.prompt
            if w.request.params.prompt_logprobs is not None and w.start < len(prompt):
                # each position but the prompt's last scores the prompt token after it
                scored += [(at + p - w.start, scoring.ScoredRow(w.request, prompt[p + 1]))
                           for p in range(w.start, min(stop, len(prompt) - 1))]
            tables[i, :len(table.pages)] = table.pages
            if w.start < len(w.request.prompt) and dense_prompts:  # a chunk of the prompt
                sequence = table.slots(0, stop)  # the chunk attends to all of it
                chunks.append((at, w.count, sequence))
                slots.append(sequence[w.start:])
            else:
                slots.append(table.slots(w.start, stop))
            tokens.append([0] * w.count if w.fed else self._tokens_at(w.request, w.start, stop))
            positions.append(np.arange(w.start, stop))
            seq_of.append(np.full(w.count, i))
            at += w.count
            if w.samples:
                rows.append(at - 1)
        batch = batch_step.StepBatch(np.concatenate(tokens).astype(np.int64),
                                     np.concatenate(positions), np.concatenate(seq_of),
                                     np.concatenate(slots), tables, np.array(rows, np.int64),
                                     chunks)
        batch.score_rows = np.array([row for row, _ in scored], np.int64)
        return batch, [s for _, s in scored]

    def _launch(self, work: list[Work], fed: bool = False) -> _Queued:
        """Queue one batched step (``fed``: a decode step whose tokens are the ones the
        previous step chose, on the device). Decode-only steps replay a captured step where
        the backend can; each sequence's next token is its argmax when every one is greedy,
        else ``nd.sample`` with its request's settings (``choice.py``)."""
        sampling = [w for w in work if w.samples]
        greedy = all(w.request.sampler.greedy for w in sampling)
        decode_only = len(sampling) == len(work) == sum(w.count for w in work)
        captured = (self.graphs.enabled and decode_only
                    and self.graphs.bucket(len(work)) is not None)
        batch, scored = self._batch(work, self.graphs.max_pages if captured else None)
        if not greedy:
            batch.sampling = choice.sampling_rows([w.request.sampler for w in sampling],
                                                  [w.start + w.count for w in sampling],
                                                  self.model.config.vocab_size)
        read = self.execute(batch, captured, greedy, fed)
        scored_rows = [j for j, w in enumerate(sampling)
                       if w.request.params.logprobs is not None]
        on_host = [(j, w.request) for j, w in enumerate(sampling) if choice.needs_host(w.request)]
        if on_host:  # chosen again on the host: a grammar's mask, a bias, penalties
            read = choice.chosen_on_host(read, self._logits, on_host, batch.sampling)
        # the next step may be fed this one's choices on the device unless a sequence's
        # repetition penalty needs its seen tokens, which the host has not updated yet, a
        # sequence's logprobs need this step's logits before the next step rewrites them,
        # or a sequence's token is chosen on the host
        chains = captured and not scored_rows and not on_host and (
            greedy or (self.graphs.samples_on_device and batch.sampling.seen is None))
        queued = _Queued(work, sampling, read, chains)
        if scored_rows:
            queued.scores = choice.log_softmax_rows(self._logits, scored_rows)
        if scored:
            queued.scored, queued.prompt_slices = scored, self._prompt_scores
        return queued

    def execute(self, batch: batch_step.StepBatch, captured: bool, greedy: bool,
                fed: bool = False) -> Callable[[], np.ndarray]:
        """Queue one step: ``batch`` through the recorded decode step (``captured``: every
        token decodes, padded to a bucket; ``fed``: its tokens are the ones the step queued
        just before chose) or eagerly. Returns a function that gives the token chosen for
        each logits row (the argmax where ``greedy``), on the host. Tensor-parallel ranks
        other than 0 run the steps rank 0 decides through this alone (``tp_engine.py``)."""
        if captured:
            read = self.graphs.run(batch, greedy, fed)
            self._logits = self.graphs.logits
            return read
        inputs = batch_step.upload(batch, self.model.device)
        hidden = batch_step.hidden_states(self.model, self.cache, inputs)
        logits = self._logits = batch_step.logits(self.model, hidden, inputs,
                                                  len(batch.logit_rows))
        self._prompt_scores = (scoring.log_softmax_slices(self.model, hidden, batch.score_rows)
                               if len(batch.score_rows) else [])
        if greedy:
            out = logits.argmax(axis=-1).numpy().reshape(-1)
            return lambda: out
        if self.graphs.samples_on_device:
            rows = choice.DeviceRows(len(batch.logit_rows), self.model.config.vocab_size,
                                     self.model.device)
            rows.load(batch.sampling)
            return rows.choose(logits).numpy_later()
        return lambda: choice.choose_on_host(logits.numpy(), batch.sampling)

    def _following(self, step: _Queued) -> list[Work] | None:
        """(Lock held.) The step after ``step`` if it can be queued before ``step``'s tokens
        are read: the same sequences one token further, each with room for it."""
        if not (step.chains and self._queue_ahead) or self._cancelled or self.scheduler.waiting:
            return None
        work = []
        for w in step.work:
            r = w.request
            # r.output lacks ``step``'s token: this one would make token len(output) + 2
            if r.finished or len(r.output) + 2 > r.max_tokens:
                return None
            work.append(Work(r, w.start + 1, 1, fed=True))
        for w in work:
            w.request.table.ensure(w.start + 1)
        return work

    def _append(self, r: Request, token: int, logprob: TokenLogprob | None = None) -> None:
        """Add a chosen token; emit it with its text; finish the request if it stops."""
        if r.first_token_at is None:
            r.first_token_at = time.perf_counter()
        r.output.append(token)
        if logprob is not None:
            r.logprobs.append(logprob)
        r.sampler.observe((token,))
        piece = r.detokenizer.push(token) if r.detokenizer is not None else ""
        reason = None
        if token in r.stop_ids:
            reason = "stop"
        elif len(r.output) >= r.max_tokens:
            reason = "length"
        if r.constraint is not None and r.constraint.consume(token) and reason is None:
            reason = "stop"  # the grammar is complete: nothing else may follow
        if reason is not None and r.detokenizer is not None:
            piece += r.detokenizer.flush()
        text = r.text + piece
        cuts = []  # (where, which) of each stop string found in the text's new part
        for stop in r.params.stop:
            at = text.find(stop, max(0, len(r.text) - len(stop) + 1))
            if at >= 0:
                cuts.append((at, stop))
        if cuts:
            at, r.stopped_by = min(cuts)
            text, reason = text[:at], "stop"
        # hold back a tail that may be the start of a stop string
        keep = max((len(s) - 1 for s in r.params.stop), default=0) if reason is None else 0
        emitted = len(r.text) - r.held
        visible = max(emitted, len(text) - keep)
        r.text, r.held = text, len(text) - visible
        event = TokenEvent(token, text[emitted:visible], reason, logprob=logprob)
        if reason is not None:
            self._finish(r, event)
        else:
            r.emit(event)

    # --- statistics ------------------------------------------------------------------------
    def stats(self) -> dict:
        pool = self.cache.pool.stats()
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "pages_total": pool.total, "pages_used": pool.used,
                "pages_reserved": pool.reserved, "page_size": pool.page_size,
                "prompt_tokens_total": self.metrics.prompt_tokens,
                "prompt_tokens_cached_total": self.metrics.cached_prompt_tokens,
                "pages_cached": pool.cached,
                "generation_tokens_total": self.metrics.generated,
                "tokens_per_second": self.metrics.tokens_per_second(),
                "steps_total": self.metrics.steps,
                "steps_queued_ahead_total": self.metrics.queued_ahead,
                "finished": dict(self.metrics.finished)}


@dataclass
class _Queued:
    """A step queued on the device: its work, the rows that choose a token, and the read of
    their tokens."""

    work: list[Work]
    sampling: list[Work]
    read: Callable[[], np.ndarray]
    chains: bool  # a captured step whose successor may be fed its tokens on the device
    scores: dict | None = None  # sampling row -> its log-softmax (host), where asked for
    scored: list = field(default_factory=list)  # the prompt rows scored (scoring.ScoredRow)
    prompt_slices: list = field(default_factory=list)  # their log-softmax (device)

    def tokens(self) -> list[int]:
        return [int(t) for t in self.read().reshape(-1)]

    def logprob(self, row: int, token: int, top: int | None) -> TokenLogprob | None:
        """The chosen token's log-probability and the ``top`` likeliest, for a sampling row
        whose request asked for them."""
        if top is None or not self.scores:
            return None
        return choice.token_logprob(self.scores[row], token, top)
