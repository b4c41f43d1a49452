"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET
/tokenizer_info``, with vLLM's request and response shapes.

Clients that split and count tokens against the server use them instead of a tokenizer of
their own: lm-evaluation-harness's ``local-completions`` model looks for ``/tokenizer_info``
and ``/tokenize`` and, finding them, needs no copy of the model's tokenizer. Like
``openai_api.py`` this module has no HTTP in it; ``server.py`` routes to it.
"""

from __future__ import annotations

from ..errors import NeedleError
from .api_error import bad as _bad
from .openai_api import chat_messages
from .tools import tool


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise _bad(f"{name} must be true or false, got {value!r}", name)
    return value


def tokenize(body: dict, tokenizer, max_model_len: int) -> dict:
    """``{"prompt": text, "add_special_tokens": true}`` or a chat's ``{"messages": [...],
    "add_generation_prompt": true, "tools": [...]}`` -> ``{"count", "max_model_len",
    "tokens"}`` (the tokens chat would prompt the model with, its tools rendered too)."""
    if "messages" in body:
        messages = chat_messages(body)
        offered = [tool(t, i) for i, t in enumerate(body["tools"])] \
            if isinstance(body.get("tools"), list) and body["tools"] else None
        try:
            ids = tokenizer.apply_chat_template(
                messages, tools=offered,
                add_generation_prompt=_flag(body, "add_generation_prompt", True),
                return_dict=False)
        except NeedleError as e:
            raise _bad(f"the chat template failed: {e}", "messages") from e
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise _bad("tokenize needs a prompt (a string) or messages (a chat)", "prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens",
                                                                 True))
    ids = [int(t) for t in ids]
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}


def detokenize(body: dict, tokenizer, vocab_size: int) -> dict:
    """``{"tokens": [ids]}`` -> ``{"prompt": text}`` (special tokens kept, as vLLM's)."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or any(
            not isinstance(t, int) or isinstance(t, bool) for t in tokens):
        raise _bad("detokenize needs tokens: a list of token ids", "tokens")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise _bad(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "tokens")
    return {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}


def tokenizer_info(tokenizer, generation_config, max_model_len: int) -> dict:
    """The tokenizer's special tokens and chat template. The end-of-sequence token is the
    tokenizer config's, else the text of generation_config.json's first eos id."""
    special = dict(tokenizer.special_tokens)
    if special.get("eos_token") is None and generation_config.eos_token_ids:
        special["eos_token"] = tokenizer.decode([generation_config.eos_token_ids[0]],
                                                skip_special_tokens=False)
    return {"tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": special.get("eos_token"), "bos_token": special.get("bos_token"),
            "pad_token": special.get("pad_token"), "unk_token": special.get("unk_token"),
            "chat_template": tokenizer.chat_template, "model_max_length": max_model_len}
