"""The OpenAI-compatible HTTP server over an ``Engine``, on starlette (ASGI) and uvicorn.

The engine steps on its own thread; each HTTP request submits to it and awaits its
events, which the engine thread hands to the event loop (``call_soon_threadsafe``). A
client that goes away mid-answer cancels its sequence, which frees its pages at the next
step. Shutting down (Ctrl-C) stops accepting requests, lets the running ones finish,
then stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from ..errors import GenerationError, NeedleError
from . import answer, anthropic_api, reasoning, responses_api, tokenize_api, tools
from . import openai_api as api
from .anthropic_sse import MessageStream
from .engine import Engine, EngineStoppedError
from .request import Request, TokenEvent
from .responses_sse import ResponseStream
from .scheduler import QueueFullError, RequestTooLargeError
from .sse import Stream

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused with 413


def _error(e: api.ApiError, kind: str = "") -> JSONResponse:
    """The error as JSON: OpenAI's shape, or Anthropic's for ``kind`` "messages"."""
    body = anthropic_api.error_body(e) if kind == "messages" else e.body()
    return JSONResponse(body, status_code=e.status)


def _engine_error(e: NeedleError) -> api.ApiError:
    """The HTTP answer to an engine refusal."""
    if isinstance(e, QueueFullError):
        return api.ApiError(429, str(e), code="queue_full", kind="rate_limit_error")
    if isinstance(e, EngineStoppedError):
        return api.ApiError(503, str(e), code="shutting_down", kind="server_error")
    if isinstance(e, RequestTooLargeError):
        return api.ApiError(413, str(e), code="kv_cache_too_small")
    if isinstance(e, GenerationError) and "max_seq_len" in str(e):
        return api.ApiError(400, str(e), "messages", "context_length_exceeded")
    return api.ApiError(400, str(e))


class Server:
    """The ASGI app (``self.app``) of one engine and model name."""

    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None,
                 tool_call_parser: str = "auto", reasoning_parser: str = "auto"):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        tokenizer = engine.model.tokenizer
        # how answers are read for tool calls (None: this model's template renders no tools)
        self.tool_parser = tools.parser_for(tool_call_parser, tokenizer)
        # how chat answers' thinking is told from their answer (None: not)
        self.reasoning = reasoning.parser_for(reasoning_parser, tokenizer)
        self.started = time.time()
        routes = [
            Route("/", self.chat_page, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/messages", self.messages, methods=["POST"]),  # Anthropic's
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            # vLLM's tokenizer endpoints (lm-evaluation-harness uses them when present)
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error},
                             lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.engine.start()
        yield
        await asyncio.to_thread(self.engine.shutdown, True)  # drain

    async def _http_error(self, request: HttpRequest, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        e = api.ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                         kind=kind)
        return _error(e)

    # --- plain endpoints -------------------------------------------------------------------
    async def chat_page(self, request: HttpRequest) -> HTMLResponse:
        page = resources.files("needle.serve").joinpath("static/chat.html").read_text("utf-8")
        return HTMLResponse(page)

    async def health(self, request: HttpRequest) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def models(self, request: HttpRequest) -> JSONResponse:
        if (denied := self._check_key(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": int(self.started),
             "owned_by": "needle",
             "max_model_len": self.engine.model.max_seq_len}]})  # as vLLM's model card

    async def metrics(self, request: HttpRequest) -> PlainTextResponse:
        s = self.engine.stats()
        lines = []

        def metric(name, kind, help_, value, labels=""):
            if not any(line.startswith(f"# HELP {name} ") for line in lines):
                lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
            lines.append(f"{name}{labels} {value}")

        metric("needle_requests_running", "gauge", "Requests in the batch.", s["running"])
        metric("needle_requests_waiting", "gauge", "Requests queued for admission.",
               s["waiting"])
        metric("needle_kv_pages_used", "gauge", "KV cache pages holding keys.", s["pages_used"])
        metric("needle_kv_pages_reserved", "gauge", "KV cache pages promised to requests.",
               s["pages_reserved"])
        metric("needle_kv_pages_total", "gauge", "KV cache pages in the pool.",
               s["pages_total"])
        metric("needle_kv_pages_cached", "gauge",
               "Free KV cache pages holding a finished request's prefix.", s["pages_cached"])
        metric("needle_generation_tokens_per_second", "gauge",
               "Tokens generated per second over the last 10 s.",
               f"{s['tokens_per_second']:.3f}")
        metric("needle_generation_tokens_total", "counter", "Tokens generated.",
               s["generation_tokens_total"])
        metric("needle_prompt_tokens_total", "counter", "Prompt tokens received.",
               s["prompt_tokens_total"])
        metric("needle_prompt_tokens_cached_total", "counter",
               "Prompt tokens whose keys and values were found cached.",
               s["prompt_tokens_cached_total"])
        metric("needle_steps_total", "counter", "Batched steps run.", s["steps_total"])
        metric("needle_steps_queued_ahead_total", "counter",
               "Steps queued before the previous step's tokens were read.",
               s["steps_queued_ahead_total"])
        for reason, n in sorted(s["finished"].items()):
            metric("needle_requests_finished_total", "counter", "Requests ended, by reason.",
                   n, f'{{reason="{reason}"}}')
        return PlainTextResponse("\n".join(lines) + "\n",
                                 media_type="text/plain; version=0.0.4")

    # --- the tokenizer -----------------------------------------------------------------------
    async def tokenize(self, request: HttpRequest) -> JSONResponse:
        model = self.engine.model
        return await self._with_tokenizer(request, lambda body, tok: tokenize_api.tokenize(
            body, tok, model.max_seq_len))

    async def detokenize(self, request: HttpRequest) -> JSONResponse:
        vocab = self.engine.model.config.vocab_size
        return await self._with_tokenizer(request, lambda body, tok: tokenize_api.detokenize(
            body, tok, vocab))

    async def tokenizer_info(self, request: HttpRequest) -> JSONResponse:
        model = self.engine.model
        return await self._with_tokenizer(request, lambda _, tok: tokenize_api.tokenizer_info(
            tok, model.generation_config, model.max_seq_len), read_body=False)

    async def _with_tokenizer(self, request: HttpRequest, answer, read_body: bool = True):
        """``answer(body, tokenizer)`` as JSON, behind the API key; a 400 where the model has
        no tokenizer."""
        if (denied := self._check_key(request)) is not None:
            return denied
        tokenizer = self.engine.model.tokenizer
        try:
            body = await self._body(request) if read_body else {}
            if tokenizer is None:
                raise api.ApiError(400, "this model has no tokenizer (tokenizer.json)")
            return JSONResponse(answer(body, tokenizer))
        except api.ApiError as e:
            return _error(e)

    # --- generation ------------------------------------------------------------------------
    async def completions(self, request: HttpRequest):
        return await self._generate(request, "completions")

    async def chat_completions(self, request: HttpRequest):
        return await self._generate(request, "chat")

    async def responses(self, request: HttpRequest):
        return await self._generate(request, "responses")

    async def messages(self, request: HttpRequest):
        return await self._generate(request, "messages")

    async def count_tokens(self, request: HttpRequest):
        """Anthropic's count_tokens: the prompt a Messages request would read."""
        if (denied := self._check_key(request, "messages")) is not None:
            return denied
        model = self.engine.model
        try:
            body = await self._body(request)
            parsed = api.parse_chat(anthropic_api.chat_body(body, counting=True),
                                    model.tokenizer, model.generation_config, self.tool_parser)
        except api.ApiError as e:
            return _error(e, "messages")
        return JSONResponse({"input_tokens": len(parsed.prompt)})

    def _check_key(self, request: HttpRequest, kind: str = "") -> JSONResponse | None:
        """None where the request carries the API key (``Authorization: Bearer <key>``, or
        Anthropic's ``x-api-key: <key>``), else the 401 (in Anthropic's shape for
        ``kind`` "messages")."""
        if self.api_key is None:
            return None
        bearer = request.headers.get("authorization", "")
        if request.headers.get("x-api-key") is not None:
            bearer = "Bearer " + request.headers["x-api-key"]
        expected = f"Bearer {self.api_key}"
        if not hmac.compare_digest(bearer.encode(), expected.encode()):
            return _error(api.ApiError(401, "missing or wrong API key: send the header "
                                            "'Authorization: Bearer <key>' (or 'x-api-key: "
                                            "<key>')",
                                       code="invalid_api_key", kind="authentication_error"),
                          kind)
        return None

    async def _body(self, request: HttpRequest) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise api.ApiError(413, f"the request body ({length} bytes) exceeds "
                                    f"{MAX_BODY_BYTES} bytes")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise api.ApiError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise api.ApiError(400, f"the request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise api.ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise api.ApiError(404, f"the model {model!r} does not exist; this server "
                                    f"serves {self.model_name!r}", "model", "model_not_found",
                               kind="not_found_error")
        return body

    async def _generate(self, request: HttpRequest, kind: str):
        """A completions, chat, Responses API or Messages API request (the last two read as
        the chat request they amount to: ``responses_api.py``, ``anthropic_api.py``)."""
        if (denied := self._check_key(request, kind)) is not None:
            return denied
        model = self.engine.model
        chat = kind != "completions"
        try:
            body = await self._body(request)
            asked = {"responses": responses_api.chat_body,
                     "messages": anthropic_api.chat_body}.get(kind, lambda b: b)(body)
            parsed = (api.parse_chat(asked, model.tokenizer, model.generation_config,
                                     self.tool_parser) if chat
                      else api.parse_completion(body, model.generation_config))
            if model.tokenizer is None and any(isinstance(p, str) for p in parsed.prompts):
                raise api.ApiError(400, "this model has no tokenizer: send the prompt as "
                                        "token ids", "prompt")
        except api.ApiError as e:
            return _error(e, kind)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()
        submitted: list[Request] = []
        choices = parsed.submissions()  # (prompt, settings) a choice
        try:
            for i, (prompt, params) in enumerate(choices):
                submitted.append(self.engine.submit(
                    prompt, params,
                    listener=lambda ev, i=i: loop.call_soon_threadsafe(events.put_nowait,
                                                                       (i, ev))))
        except NeedleError as e:  # a batch is taken whole or not at all
            for r in submitted:
                self.engine.cancel(r)
            return _error(_engine_error(e), kind)
        if kind == "responses":
            return await self._respond(request, body, parsed, submitted, events)
        if kind == "messages":
            return await self._message(request, parsed, submitted, events)
        rid = api.new_id("chatcmpl" if chat else "cmpl")
        if parsed.stream:
            stream = Stream(submitted, [p for p, _ in choices], parsed.n, rid, self.model_name,
                            chat, model.tokenizer, parsed.echo, self._calls_reader(parsed),
                            self.reasoning)
            return StreamingResponse(self._streamed(stream, events, parsed.include_usage,
                                                    submitted),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            final = await self._final_events(request, events, len(submitted))
        finally:
            for r in submitted:  # a no-op once finished; frees pages on disconnect
                self.engine.cancel(r)
        if final is None:  # the client went away: nobody reads this
            return JSONResponse({}, status_code=499)
        failed = [ev for ev in final if ev.finish_reason == "error"]
        if failed:
            return _error(api.ApiError(500, f"generation failed: {failed[0].error}",
                                       kind="server_error"))
        u = api.choices_usage(submitted, parsed.n)
        if chat:
            return JSONResponse(api.chat_completion(rid, self.model_name, [
                self._chat_choice(i, r, ev, parsed)
                for i, (r, ev) in enumerate(zip(submitted, final))], u))
        answers = [self._completion_choice(i, prompt, r, final[i], parsed.echo)
                   for i, ((prompt, _), r) in enumerate(zip(choices, submitted))]
        return JSONResponse(api.completion(rid, self.model_name, answers, u))

    async def _respond(self, request: HttpRequest, body: dict, parsed: api.ParsedRequest,
                       submitted: list[Request], events: asyncio.Queue):
        """The Responses API's answer to one submitted request, whole or streamed."""
        rid, r = responses_api.new_id("resp"), submitted[0]
        tokenizer = self.engine.model.tokenizer
        if parsed.stream:
            return self._event_stream(ResponseStream(
                r, rid, self.model_name, body, tokenizer, self.reasoning,
                self._calls_reader(parsed)), events, submitted)
        final = await self._final_of(request, events, r, "responses")
        if isinstance(final, JSONResponse):
            return final
        output = responses_api.output_items(*self._answer(r, parsed))
        return JSONResponse(responses_api.response(rid, self.model_name, body, output, r))

    async def _message(self, request: HttpRequest, parsed: api.ParsedRequest,
                       submitted: list[Request], events: asyncio.Queue):
        """The Messages API's answer to one submitted request, whole or streamed."""
        mid, r = anthropic_api.new_id("msg"), submitted[0]
        tokenizer = self.engine.model.tokenizer
        if parsed.stream:
            return self._event_stream(MessageStream(
                r, mid, self.model_name, tokenizer, self.reasoning,
                self._calls_reader(parsed)), events, submitted)
        final = await self._final_of(request, events, r, "messages")
        if isinstance(final, JSONResponse):
            return final
        thought, content, calls = self._answer(r, parsed)
        return JSONResponse(anthropic_api.message(
            mid, self.model_name, r, anthropic_api.content_blocks(thought, content, calls),
            anthropic_api.stop_reason(r, calls)))

    def _event_stream(self, stream, events: asyncio.Queue,
                      submitted: list[Request]) -> StreamingResponse:
        """A Responses or Messages API stream as the HTTP response."""
        return StreamingResponse(self._streamed(stream, events, False, submitted),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _final_of(self, request: HttpRequest, events: asyncio.Queue, r: Request,
                        kind: str):
        """The one request's last event, or the response to send instead (the client left:
        499; the answer failed: 500, in ``kind``'s error shape)."""
        try:
            final = await self._final_events(request, events, 1)
        finally:
            self.engine.cancel(r)
        if final is None:
            return JSONResponse({}, status_code=499)
        if final[0].finish_reason == "error":
            return _error(api.ApiError(500, f"generation failed: {final[0].error}",
                                       kind="server_error"), kind)
        return final[0]

    def _answer(self, r: Request, parsed: api.ParsedRequest):
        """A finished request's (thinking, content, tool calls)."""
        return answer.whole(r, self.engine.model.tokenizer, self.reasoning,
                            self._calls_reader(parsed))

    def _chat_choice(self, index: int, r: Request, final: TokenEvent,
                     parsed: api.ParsedRequest) -> dict:
        thought, content, calls = self._answer(r, parsed)
        return api.chat_choice(index, content, api.finish_reason(final.finish_reason),
                               self._logprobs(r, r.logprobs, True), calls, thought)

    def _calls_reader(self, parsed: api.ParsedRequest) -> tools.CallsReader:
        """How this request's answers are read for tool calls (not at all without tools)."""
        on = parsed.tools is not None and parsed.tools.parse
        return tools.CallsReader(self.tool_parser if on else None, self.engine.model.tokenizer,
                                 parsed.tools is None or parsed.tools.parallel)

    def _completion_choice(self, index: int, prompt, r: Request, final: TokenEvent,
                           echo: bool) -> dict:
        reason = api.finish_reason(final.finish_reason)
        if not echo:
            return api.completion_choice(index, r.text, reason,
                                         self._logprobs(r, r.logprobs, False))
        tokenizer = self.engine.model.tokenizer
        text = api.prompt_text(prompt, r.prompt, tokenizer) + r.text
        logprobs = None if r.params.logprobs is None else api.completion_logprobs(
            r.logprobs, tokenizer, 0, r.prompt, r.prompt_logprobs)
        return api.completion_choice(index, text, reason, logprobs)

    def _logprobs(self, submitted: Request, items: list, chat: bool,
                  offset: int = 0) -> dict | None:
        """The response's logprobs object for ``items`` (None unless the request asked)."""
        if submitted.params.logprobs is None:
            return None
        tokenizer = self.engine.model.tokenizer
        return (api.chat_logprobs(items, tokenizer) if chat
                else api.completion_logprobs(items, tokenizer, offset))

    @staticmethod
    async def _final_events(request: HttpRequest, events: asyncio.Queue,
                            n: int) -> list[TokenEvent] | None:
        """The last event of each of ``n`` requests, or None as soon as the client
        disconnects (checked twice a second while waiting: a non-streaming handler is not
        cancelled for it)."""
        final: dict[int, TokenEvent] = {}
        while len(final) < n:
            try:
                i, event = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            if event.finish_reason is not None:
                final[i] = event
        return [final[i] for i in range(n)]

    async def _streamed(self, stream: Stream, events: asyncio.Queue, include_usage: bool,
                        submitted: list[Request]):
        """The answer's server-sent events (``sse.py``). A disconnect cancels this
        generator; ``finally`` cancels the sequences."""
        try:
            async for chunk in stream.events(events, include_usage):
                yield chunk
        finally:
            for r in submitted:
                self.engine.cancel(r)


def serve(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, log_level: str = "info",
          tool_call_parser: str = "auto", reasoning_parser: str = "auto") -> None:
    """Run the server until Ctrl-C (which drains the running requests, then exits)."""
    import uvicorn

    server = Server(engine, model_name, api_key, tool_call_parser, reasoning_parser)
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=60)
    uvicorn.Server(config).run()
