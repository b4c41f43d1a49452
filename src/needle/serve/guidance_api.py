"""The request fields that steer how tokens are chosen: what the answer must follow
(OpenAI's ``response_format``; vLLM's ``structured_outputs`` and ``guided_*``: a JSON
schema, a regular expression or a list of choices) and OpenAI's ``logit_bias`` and
presence / frequency penalties. ``openai_api.py`` reads a request with them."""

from __future__ import annotations

import json
import numbers

from .api_error import bad as _bad
from .api_error import number as _number
from .grammar import GrammarSpec
from .logit_rules import LogitRules


def grammar_field(body: dict) -> GrammarSpec | None:
    """What the answer must follow: OpenAI's ``response_format`` or vLLM's structured
    outputs (``structured_outputs: {"json" | "regex" | "choice": ...}``, or the older
    ``guided_json`` / ``guided_regex`` / ``guided_choice``), at most one of them."""
    vllm = body.get("structured_outputs")
    if vllm is not None and not isinstance(vllm, dict):
        raise _bad("structured_outputs must be an object", "structured_outputs")
    asked = {f"structured_outputs.{k}": v for k, v in (vllm or {}).items() if v is not None}
    asked |= {k: body[k] for k in ("guided_json", "guided_regex", "guided_choice")
              if body.get(k) is not None}
    if body.get("response_format") not in (None, {"type": "text"}):
        asked["response_format"] = body["response_format"]
    if len(asked) > 1:
        raise _bad(f"ask for one kind of structured output, not {', '.join(sorted(asked))}",
                   sorted(asked)[0])
    if not asked:
        return None
    (name, value), = asked.items()
    kind = name.split(".")[-1].removeprefix("guided_")
    if kind == "response_format":
        return _response_format(value)
    if kind == "json" and isinstance(value, (dict, str)):
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as e:
            raise _bad(f"{name} is not valid JSON: {e}", name) from None
        if isinstance(schema, dict):
            return GrammarSpec.json_schema(schema)
    if kind == "regex" and isinstance(value, str) and value:
        return GrammarSpec("regex", value)
    if kind == "choice" and isinstance(value, list) and value and all(
            isinstance(o, str) and o for o in value):
        return GrammarSpec.choice(value)
    raise _bad(f"{name} must be a JSON schema (json), a regular expression (regex) or a "
               "list of strings (choice)", name)


def _response_format(fmt) -> GrammarSpec | None:
    """OpenAI's ``response_format``: "text" (None), "json_object" (any JSON object) or
    "json_schema" (``{"json_schema": {"name", "schema", "strict"}}``), as a grammar the
    answer must follow."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_schema({"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                       "\"schema\": {...}}}", "response_format")
        return GrammarSpec.json_schema(schema)
    raise _bad("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} "
               "or {\"type\": \"json_schema\", \"json_schema\": {...}}", "response_format")


MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries


def logit_rules_field(body: dict) -> LogitRules:
    """OpenAI's ``logit_bias`` ({token id: -100..100}) and ``presence_penalty`` /
    ``frequency_penalty`` (-2..2)."""
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise _bad(f"logit_bias must be an object of up to {MAX_LOGIT_BIAS} token ids to "
                   "numbers in [-100, 100]", "logit_bias")
    pairs = []
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else None
        if token is None or not isinstance(value, numbers.Real) or isinstance(value, bool) \
                or not -100 <= value <= 100:
            raise _bad(f"logit_bias entry {key!r}: {value!r} must be a token id and a number "
                       "in [-100, 100]", "logit_bias")
        pairs.append((token, float(value)))
    return LogitRules(tuple(sorted(pairs)), _number(body, "presence_penalty", -2.0, 2.0, 0.0),
                      _number(body, "frequency_penalty", -2.0, 2.0, 0.0))
