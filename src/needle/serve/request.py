"""A request to the engine: its prompt, its settings, and what it has produced so far.

``RequestParams`` are the per-request settings (sampling, max_tokens, stop strings and stop
token ids); ``Request`` is one sequence's life: waiting, running (prefilling its prompt in
chunks, then decoding), finished. Outputs go to the request's thread-safe queue as
``TokenEvent``s, so any thread (the HTTP server's event loop, a program) can stream them.
"""

from __future__ import annotations

import itertools
import numbers
import queue
import time
from dataclasses import dataclass, field

from ..errors import GenerationError
from ..models.sampling import Sampler, SamplingParams
from .grammar import GrammarSpec
from .logit_rules import LogitRules

_ids = itertools.count()
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability under the model (its raw logits, before sampling's
    temperature and filters) and the ``top`` likeliest tokens' (id, log-probability),
    likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestParams:
    """Settings of one request. ``max_tokens`` None: up to the model's max_seq_len."""

    sampling: SamplingParams = SamplingParams()
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # each token's log-probability and that of the ``logprobs`` likeliest tokens (None: off)
    logprobs: int | None = None
    # the same for each prompt token after the first, under the tokens before it (None:
    # off): what scoring a text needs (OpenAI's echo with logprobs; lm-evaluation-harness).
    # The prompt is then read whole, none of it from the prefix cache.
    prompt_logprobs: int | None = None
    # what the answer must follow (a JSON schema: grammar.py), None: anything
    grammar: GrammarSpec | None = None
    # OpenAI's logit_bias and presence / frequency penalties (logit_rules.py)
    logit_rules: LogitRules = LogitRules()

    def __post_init__(self):
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, numbers.Integral) or isinstance(k, bool)
                                  or not 0 <= k <= MAX_LOGPROBS):
                raise GenerationError(f"{name} must be an int in [0, {MAX_LOGPROBS}] or None, "
                                      f"got {k!r}")
        m = self.max_tokens
        least = 0 if self.prompt_logprobs is not None else 1  # scoring alone makes no token
        if m is not None and (not isinstance(m, numbers.Integral) or isinstance(m, bool)
                              or m < least):
            raise GenerationError(f"max_tokens must be an int >= {least} or None, got {m!r}"
                                  + ("" if least == 0 else
                                     " (0 only with prompt_logprobs: scoring a prompt)"))
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
                raise GenerationError(f"{name} must be a tuple (or list) of "
                                      f"{'strings' if name == 'stop' else 'token ids'}, got "
                                      f"{value!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise GenerationError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, numbers.Integral) or isinstance(t, bool)
               for t in self.stop_token_ids):
            raise GenerationError(f"stop_token_ids must be ints, got {self.stop_token_ids!r}")


@dataclass
class TokenEvent:
    """A step's output for one request: the new token (None on the final event of a cancel
    or error), the text it completes (stop strings cut off) and, when it ends the request,
    why: "stop" (a stop token or string), "length" (max_tokens or the context), "cancelled",
    or "error"."""

    token: int | None
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    logprob: TokenLogprob | None = None  # where the request asked for logprobs


@dataclass
class Request:
    prompt: list[int]
    params: RequestParams
    max_tokens: int  # resolved against the context
    stop_ids: frozenset[int]
    detokenizer: object | None = None
    id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one an output token
    # one a prompt token where params.prompt_logprobs is set: None for the first (nothing
    # precedes it), filled as the prompt's chunks are read
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    text: str = ""
    held: int = 0  # characters of text not yet emitted (a possible start of a stop string)
    finish_reason: str | None = None
    error: str | None = None
    events: queue.Queue = field(default_factory=queue.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    prefilled: int = 0  # prompt positions already in the cache
    cached_tokens: int = 0  # prompt positions found cached (shared pages) at admission
    prefix_keys: list | None = None  # keys of its full prompt pages (pages.prefix_keys)
    remembered: int = 0  # full prompt pages offered for sharing so far
    table: object | None = None  # BlockTable once admitted
    sampler: Sampler | None = None
    listener: object | None = None  # called with each event (the server's loop hook)
    constraint: object | None = None  # its grammar's matcher (grammar.Constraint), if any
    stopped_by: str | None = None  # the stop string that ended it, if one did

    @property
    def length(self) -> int:
        """Positions in the sequence: the prompt and every token produced."""
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def emit(self, event: TokenEvent) -> None:
        self.events.put(event)
        if self.listener is not None:
            self.listener(event)

    def stream(self, timeout: float | None = None):
        """The request's events as they come, up to and including the final one."""
        while True:
            event = self.events.get(timeout=timeout)
            yield event
            if event.finish_reason is not None:
                return
