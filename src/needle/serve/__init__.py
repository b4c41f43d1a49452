"""Serving: many sequences decoded together over a paged KV cache (``Engine``), and an
OpenAI-compatible HTTP server over it (``needle serve``; ``needle.serve.server``).

    from needle.serve import Engine, RequestParams
    engine = Engine(model, max_seqs=32)
    request = engine.submit("Once upon a time", RequestParams(max_tokens=32))
    engine.start()                      # or: engine.run_until_idle() in this thread
    for event in request.stream():
        print(event.text, end="")
"""

from ..models.sampling import SamplingParams
from .engine import Engine, EngineStoppedError
from .pages import PagedKVCache, PagePool, PoolStats
from .request import Request, RequestParams, TokenEvent
from .scheduler import QueueFullError, RequestTooLargeError

__all__ = ["Engine", "EngineStoppedError", "PagePool", "PagedKVCache", "PoolStats",
           "QueueFullError", "Request", "RequestParams", "RequestTooLargeError",
           "SamplingParams", "TokenEvent", "generate_batch"]


def generate_batch(model, prompts, max_new_tokens=None, temperature=None, top_k=None,
                   top_p=None, seed=None, stop=None, min_p=None,
                   repetition_penalty=None) -> list[list[int]]:
    """``model.generate`` for a list of prompts (token ids or text): every prompt decoded
    together by an Engine sized for the batch; the new token ids of each. Settings left as
    None take the model's generation_config.json values; ``stop`` (token ids) replaces the
    end-of-sequence ids, as in ``generate``; ``seed`` seeds every prompt alike."""
    from ..errors import GenerationError
    from ..models.generate import DEFAULT_MAX_NEW_TOKENS

    prompts = list(prompts)
    if not prompts:
        raise GenerationError("generate needs at least one prompt")
    sampling = model.generation_config.sampling(temperature, top_k, top_p, min_p,
                                                repetition_penalty, seed)
    stop_ids = tuple(int(s) for s in stop) if stop is not None else ()
    engine = Engine(model, max_seqs=min(len(prompts), 64))
    requests = []
    for p in prompts:
        probe = engine.make_request(p, RequestParams())  # checks the prompt; its length
        n = max_new_tokens if max_new_tokens is not None else min(
            DEFAULT_MAX_NEW_TOKENS, model.max_seq_len - len(probe.prompt))
        params = RequestParams(sampling, n or None, stop_token_ids=stop_ids,
                               ignore_eos=stop is not None)
        requests.append((p, params))
    out = [engine.submit(p, params) if params.max_tokens else None for p, params in requests]
    engine.run_until_idle()
    failed = [r for r in out if r is not None and r.error]
    if failed:
        raise GenerationError(f"generation failed: {failed[0].error}")
    return [list(r.output) if r is not None else [] for r in out]
