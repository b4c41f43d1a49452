"""The OpenAI request and response shapes: checking a request body and turning it into an
engine request, and the JSON of responses, stream chunks and errors.

Only the HTTP layer (``server.py``) uses this module; it has no HTTP in it, so the
validation is testable on its own. Fields OpenAI defines that needle cannot honour
(best_of, suffix, audio) are refused with a 400 that says so, never silently ignored;
logit_bias and the presence / frequency penalties are applied (``logit_rules.py``). Chat
takes ``tools`` (``tools.py``: rendered by the chat template, the answer read for calls,
or with ``tool_choice`` "required" or a named function constrained to one call);
``response_format`` json_object / json_schema constrains the answer (``grammar.py``).
``n`` answers a prompt n times (a seed given: its j-th answer draws with seed + j).
Completions take a list of prompts (a choice each) and ``echo`` (the prompt returned before
the completion; with ``logprobs``, every prompt token scored: how lm-evaluation-harness
computes loglikelihoods; ``max_tokens: 0`` then scores alone). Extensions accepted as vLLM does:
top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, and chat's
chat_template_kwargs (variables for the chat template, e.g. Qwen3's enable_thinking).
"""

from __future__ import annotations

import dataclasses
import numbers
import time
import uuid
from dataclasses import dataclass

from ..errors import NeedleError
from ..models.sampling import SamplingParams
from .api_error import ApiError
from .api_error import bad as _bad
from .api_error import number as _number
from .guidance_api import grammar_field, logit_rules_field
from .request import MAX_LOGPROBS, RequestParams, TokenLogprob
from .tools import ToolCall, ToolCallParser, ToolRequest, template_message, tool_request

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


MAX_PROMPTS = 64  # choices in one request: prompts times n
# OpenAI takes 4 stop strings; evaluation harnesses send a task's `until` list and the
# end-of-text strings, often more (vLLM sets no limit)
MAX_STOP = 32


@dataclass
class ParsedRequest:
    prompts: list  # each text or token ids for the engine (a choice each)
    params: RequestParams
    stream: bool
    include_usage: bool
    echo: bool = False  # completions: the prompt's text (and logprobs) before the answer's
    n: int = 1  # choices a prompt (choice i * n + j is prompt i's j-th)
    tools: ToolRequest | None = None  # chat: the tools offered, if any

    def submissions(self) -> list[tuple[object, RequestParams]]:
        """(prompt, settings) of each choice, in choice order: a prompt's j-th answer
        draws with seed + j where a seed is given (the first is the n = 1 answer)."""
        out = []
        for prompt in self.prompts:
            for j in range(self.n):
                s = self.params.sampling
                seed = None if s.seed is None else s.seed + j
                out.append((prompt, dataclasses.replace(
                    self.params, sampling=dataclasses.replace(s, seed=seed))))
        return out

    @property
    def prompt(self):
        return self.prompts[0]


def _int(body: dict, name: str, lo: int, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < lo:
        raise _bad(f"{name} must be an integer >= {lo}, got {value!r}", name)
    return int(value)


def _refuse_unsupported(body: dict) -> None:
    if body.get("best_of", 1) not in (1, None):
        raise _bad("best_of is not supported", "best_of")
    if body.get("suffix"):
        raise _bad("suffix is not supported", "suffix")
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]) or body.get("audio"):
        raise _bad("only text output is supported", "modalities")
    if body.get("web_search_options") is not None:
        raise _bad("web search is not supported: needle answers from the model alone",
                   "web_search_options")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or \
            any(not isinstance(s, str) or not s for s in stop):
        raise _bad(f"stop must be a non-empty string or a list of up to {MAX_STOP} of them",
                   "stop")
    return tuple(stop)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives a token's logprobs list (None: no logprobs): completions'
    ``logprobs`` (0-5), chat's ``logprobs`` (true/false) with ``top_logprobs`` (0-20)."""
    if not chat:
        return _int_in(body, "logprobs", 0, 5)
    wanted = body.get("logprobs")
    if wanted not in (None, True, False):
        raise _bad(f"logprobs must be true or false, got {wanted!r}", "logprobs")
    top = _int_in(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top and not wanted:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _int_in(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = _int(body, name, lo)
    if value is not None and value > hi:
        raise _bad(f"{name} must be an integer in [{lo}, {hi}], got {value!r}", name)
    return value


def _echo(body: dict, chat: bool) -> bool:
    echo = body.get("echo", False)
    if echo not in (True, False):
        raise _bad(f"echo must be true or false, got {echo!r}", "echo")
    if echo and chat:
        raise _bad("echo is a /v1/completions field: send the conversation's text as a "
                   "completions prompt to have it scored", "echo")
    return echo


def request_params(body: dict, default_max_tokens: int | None, generation_config,
                   chat: bool = False) -> RequestParams:
    """The engine settings of a completions or chat body; None fields take the model's
    generation_config.json values, as ``needle generate`` does. With ``echo``, the
    completions' ``logprobs`` are asked of the prompt's tokens too, and ``max_tokens``
    may be 0 (the prompt scored, nothing generated)."""
    _refuse_unsupported(body)
    logprobs = _logprobs(body, chat)
    echo = _echo(body, chat)
    max_tokens = _int(body, "max_completion_tokens", 1)
    max_tokens = _int(body, "max_tokens", 0 if echo else 1, max_tokens)
    prompt_logprobs = logprobs if echo else None
    if max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0  # the engine makes no token only for a prompt it scores
    if max_tokens is None:
        max_tokens = default_max_tokens
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, open_lo=True)
    min_p = _number(body, "min_p", 0.0, 1.0)
    penalty = _number(body, "repetition_penalty", 0.0, 100.0, open_lo=True)
    top_k = _int(body, "top_k", -1)
    top_k = None if top_k in (None, -1) else top_k
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise _bad(f"seed must be an integer, got {seed!r}", "seed")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or any(not isinstance(t, int) or isinstance(t, bool)
                                        for t in ids):
        raise _bad("stop_token_ids must be a list of integers", "stop_token_ids")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos must be true or false", "ignore_eos")
    sampling: SamplingParams = generation_config.sampling(temperature, top_k, top_p, min_p,
                                                          penalty, seed)
    return RequestParams(sampling, max_tokens, _stop(body), tuple(ids), ignore_eos, logprobs,
                         prompt_logprobs, grammar_field(body), logit_rules_field(body))


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    return stream, bool(options.get("include_usage", False))


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(body: dict) -> list:
    """The completions prompt as a list of prompts: a string, a list of token ids, or a
    list of either (a batch: a choice each)."""
    prompt = body.get("prompt")
    if (isinstance(prompt, str) and prompt) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(
            (isinstance(p, str) and p) or _is_ids(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise _bad(f"prompt is a batch of {len(prompt)} prompts; at most {MAX_PROMPTS} "
                       "a request", "prompt")
        return list(prompt)
    raise _bad("prompt must be a non-empty string, a list of token ids, or a list of "
               "either", "prompt")


def _n(body: dict, prompts: int) -> int:
    n = _int(body, "n", 1, 1)
    if n * prompts > MAX_PROMPTS:
        raise _bad(f"{prompts} prompt(s) times n = {n} is {n * prompts} choices; at most "
                   f"{MAX_PROMPTS} a request", "n")
    return n


def parse_completion(body: dict, generation_config) -> ParsedRequest:
    prompts = _prompts(body)
    params = request_params(body, COMPLETIONS_DEFAULT_MAX_TOKENS, generation_config)
    stream, include_usage = _stream_flags(body)
    return ParsedRequest(prompts, params, stream, include_usage, bool(body.get("echo")),
                         _n(body, len(prompts)))


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    kinds = sorted({p.get("type") for p in content if isinstance(p, dict)} - {"text"}
                   if isinstance(content, list) else ())
    if kinds:  # image_url, input_audio, file: what a vision or audio model would read
        raise _bad(f"messages[{i}].content has {', '.join(map(str, kinds))} parts; needle "
                   "serves text models and reads text parts only (a vision-language "
                   "checkpoint runs its language model, without its vision tower)", "messages")
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user",
                                                            "assistant", "tool"):
            raise _bad(f"messages[{i}] needs a role of system, user, assistant or tool",
                       "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m, i), **template_message(m, i)})
    return out


# what the server itself passes to the template, which chat_template_kwargs may not set
_TEMPLATE_OWN = ("conversation", "messages", "add_generation_prompt", "continue_final_message",
                 "tools", "documents", "chat_template", "tokenize", "return_dict")


def _template_kwargs(body: dict) -> dict:
    """vLLM's ``chat_template_kwargs``: variables the chat template reads (Qwen3's
    ``enable_thinking``, a system date...), as an object of names to JSON values."""
    extra = body.get("chat_template_kwargs")
    if extra is None:
        return {}
    if not isinstance(extra, dict) or not all(isinstance(k, str) and k.isidentifier()
                                              for k in extra):
        raise _bad("chat_template_kwargs must be an object of template variable names to "
                   "values", "chat_template_kwargs")
    taken = sorted(set(extra) & set(_TEMPLATE_OWN))
    if taken:
        raise _bad(f"chat_template_kwargs may not set {', '.join(taken)}, which the server "
                   "sets", "chat_template_kwargs")
    return extra


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _reasoning_effort(body: dict, extra: dict) -> dict:
    """OpenAI's ``reasoning_effort``: "none" and "minimal" ask a reasoning model not to
    think, which a template with Qwen3's switch hears as ``enable_thinking: false`` (unless
    chat_template_kwargs sets it); the other efforts leave the model's thinking as it is
    (needle has no budget of thinking tokens)."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return extra
    if effort not in EFFORTS:
        raise _bad(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {effort!r}",
                   "reasoning_effort")
    if effort in ("none", "minimal") and "enable_thinking" not in extra:
        return {**extra, "enable_thinking": False}
    return extra


def parse_chat(body: dict, tokenizer, generation_config,
               tool_parser: ToolCallParser | None = None) -> ParsedRequest:
    """A chat body checked and its conversation rendered (with the tools it offers, where
    ``tool_choice`` is not "none") to prompt ids; ``tool_parser``: the server's format of
    tool calls, None where the model has none."""
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer, so it cannot chat; use "
                            "/v1/completions with token ids", "messages")
    messages = chat_messages(body)
    extra = _reasoning_effort(body, _template_kwargs(body))
    tools = tool_request(body, tool_parser)
    params = request_params(body, None, generation_config, chat=True)
    if tools is not None and tools.forced is not None:
        params = _forced_call(params, tools, tool_parser, tokenizer)
    offered = tools.tools if tools is not None and tools.parse else None
    try:
        ids = tokenizer.apply_chat_template(messages, tools=offered, add_generation_prompt=True,
                                            return_dict=False, **extra)
    except NeedleError as e:
        raise _bad(f"the chat template failed: {e}", "messages") from e
    return ParsedRequest([list(ids)], params, *_stream_flags(body), n=_n(body, 1),
                         tools=tools if offered else None)


def _forced_call(params: RequestParams, tools: ToolRequest, parser: ToolCallParser,
                 tokenizer) -> RequestParams:
    """``params`` constrained to one call of the forced tools, in the parser's format."""
    if params.grammar is not None:
        raise _bad("response_format and a forced tool_choice cannot be combined: the answer "
                   "is a tool call", "tool_choice")
    grammar = parser.forced_call(tools.forced, tokenizer)
    if grammar is None:
        raise _bad(f"tool_choice \"required\" or a named function cannot be forced in the "
                   f"{parser.name} format; send \"auto\"", "tool_choice")
    return dataclasses.replace(params, grammar=grammar)


# --- responses ------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens read from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_choice(index: int, text: str, reason: str | None,
                      logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def completion(rid: str, model: str, choices: list[dict], u: dict) -> dict:
    """A completions response of ``completion_choice``s (one a prompt)."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": u}


def completion_chunk(rid: str, model: str, text: str, reason: str | None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                         "finish_reason": reason}]}


def chat_choice(index: int, text: str | None, reason: str | None,
                logprobs: dict | None = None, calls: list[ToolCall] = (),
                reasoning: str | None = None) -> dict:
    """A chat choice: the answer's text, or the text before its tool calls (None where
    there is none) and the calls, whose finish reason is then "tool_calls"; a reasoning
    model's thinking as ``reasoning_content`` (vLLM's field)."""
    message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning or None
    if calls:
        message["tool_calls"] = [c.as_openai() for c in calls]
        reason = "tool_calls"
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def chat_completion(rid: str, model: str, choices: list[dict], u: dict) -> dict:
    """A chat response of ``chat_choice``s (n of them)."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": u}


def chat_chunk(rid: str, model: str, delta: dict, reason: str | None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": reason}]}


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes a token stands for (``token_id:N`` without a tokenizer)."""
    if tokenizer is None:
        return f"token_id:{token}".encode()
    return tokenizer.token_bytes(token)


def token_text(tokenizer, token: int) -> str:
    """A token as the logprobs show it: its bytes as text, a part of a character as
    U+FFFD (the ``bytes`` field of chat's logprobs has them exactly)."""
    return token_bytes(tokenizer, token).decode("utf-8", errors="replace")


def chat_logprobs(items: list[TokenLogprob], tokenizer) -> dict:
    """Chat's logprobs object: each token's text, log-probability and bytes, with its
    alternatives."""
    def entry(token: int, logprob: float) -> dict:
        raw = token_bytes(tokenizer, token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(raw)}

    return {"content": [{**entry(t.token, t.logprob),
                         "top_logprobs": [entry(a, lp) for a, lp in t.top]} for t in items],
            "refusal": None}


def completion_logprobs(items: list[TokenLogprob], tokenizer, offset: int = 0,
                        prompt: list[int] | None = None,
                        prompt_items: list[TokenLogprob | None] = ()) -> dict:
    """Completions' logprobs object: tokens, their log-probabilities, each token's
    alternatives (a dict text -> log-probability) and its offset in the text. With
    ``prompt`` (echo), the prompt's tokens come first, scored by ``prompt_items`` (None
    for the first, as OpenAI has it: nothing precedes it)."""
    ids = list(prompt or ()) + [t.token for t in items]
    scored = list(prompt_items) + list(items) if prompt else list(items)
    tokens = [token_text(tokenizer, t) for t in ids]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens,
            "token_logprobs": [None if t is None else t.logprob for t in scored],
            "top_logprobs": [None if t is None else
                             {token_text(tokenizer, a): lp for a, lp in t.top} for t in scored],
            "text_offset": offsets}


def prompt_text(prompt, ids: list[int], tokenizer) -> str:
    """What echo returns of a prompt: its text as sent, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(ids) if tokenizer is not None else ""


def choices_usage(requests: list, n: int) -> dict:
    """The usage of a request's choices (n answers a prompt, in choice order): a prompt's
    tokens counted once, however many answers it has, as OpenAI counts them."""
    firsts = requests[::n]
    return usage(sum(len(r.prompt) for r in firsts), sum(len(r.output) for r in requests),
                 sum(r.cached_tokens for r in firsts))


def usage_chunk(rid: str, model: str, obj: str, u: dict) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [], "usage": u}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's names: a cancelled or failed request ends as "stop" / "error" is kept."""
    return {"cancelled": "stop"}.get(reason, reason)
