"""Constrained decoding: answers that follow a JSON schema (OpenAI's ``response_format``).

Each constrained request keeps a matcher of its grammar over the model's tokenizer; before
the request's token is chosen, the matcher says which tokens may come next, the others'
logits become -inf, and the token is chosen from the rest with the request's own settings;
the chosen token then advances the matcher. When the grammar is complete only the end of
text is allowed, so the answer stops there.

The grammar engine is llguidance (the one vLLM, SGLang and llama.cpp use): it compiles a
JSON schema to a grammar and computes a token mask from the tokenizer's vocabulary in tens
of microseconds a token, handling tokens that span several grammar symbols, which a
character-level matcher written here would not do correctly or fast. JSON is generated in
the separators Python's ``json.dumps`` writes (``", "`` and ``": "``) with no other
whitespace: a model cannot pad an answer with spaces forever.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..errors import NeedleError

# llguidance's JSON options: json.dumps' separators, no free whitespace
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(NeedleError):
    """A schema llguidance cannot compile, a model without a tokenizer, or llguidance
    missing."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's answer must follow: ``kind`` "json_schema" with ``source`` the
    schema as JSON text (``{"type": "object"}``: any JSON object), or "lark" with
    ``source`` a grammar in llguidance's Lark dialect (a forced tool call: tools.py), or
    "regex" with ``source`` a regular expression (Rust's syntax) the whole answer matches."""

    kind: str
    source: str

    @staticmethod
    def choice(options: list[str]) -> GrammarSpec:
        """Exactly one of ``options``."""
        return GrammarSpec("lark", "start: " + " | ".join(json.dumps(o) for o in options))

    @staticmethod
    def json_schema(schema: dict) -> GrammarSpec:
        # keys in the schema's order: an object's properties are written in that order
        return GrammarSpec("json_schema", json.dumps(schema))


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("structured output (response_format) needs llguidance: "
                           "pip install 'needle[serve]'") from None
    return llguidance


class Grammars:
    """One model's grammar compiler: its tokenizer in llguidance's form, made once (about a
    second for a 150,000-token vocabulary) on the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        if tokenizer is None:
            raise GrammarError("structured output needs the model's tokenizer "
                               "(tokenizer.json)")
        if not eos_ids:
            raise GrammarError("structured output needs an end-of-text token (eos_token_id "
                               "in generation_config.json or config.json) to end answers")
        self.vocab_size = vocab_size
        llg = _llguidance()
        self._llg = llg
        # the model's logits rows (which may be padded past the tokenizer's ids) or the
        # tokenizer's ids (which may name tokens the model has no row for), whichever is more
        self._mask_size = max(vocab_size, tokenizer.vocab_size)
        self._tokenizer = llg.LLTokenizer(tokenizer.to_json(), n_vocab=self._mask_size,
                                          eos_token=sorted(eos_ids))
        self._executor = llg.LLExecutor()  # a step's masks computed on several threads

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A fresh matcher of ``spec``; GrammarError saying why a schema does not
        compile."""
        matcher_class = self._llg.LLMatcher
        what = {"json_schema": "the JSON schema", "lark": "the grammar",
                "regex": "the regular expression"}.get(spec.kind)
        if what is None:
            raise GrammarError(f"unknown grammar kind {spec.kind!r}")
        try:
            if spec.kind == "json_schema":
                grammar = matcher_class.grammar_from_json_schema(json.loads(spec.source),
                                                                 defaults=JSON_STYLE)
            elif spec.kind == "regex":
                grammar = matcher_class.grammar_from_regex(spec.source)
            else:
                grammar = matcher_class.grammar_from_lark(spec.source)
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"{what} cannot be used: {e}") from None
        matcher = matcher_class(self._tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(f"{what} cannot be used: {matcher.get_error()}")
        return Constraint(matcher, self)

    def allowed_rows(self, constraints: list[Constraint]) -> np.ndarray:
        """(len(constraints), vocab) bool: the tokens each grammar allows next, the masks
        computed together on llguidance's threads."""
        words = (self._mask_size + 31) // 32
        bits = np.zeros((len(constraints), words), np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(c._matcher, i) for i, c in enumerate(constraints)], bits.ctypes.data, words * 4,
            len(constraints))
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        return unpacked[:, :self.vocab_size].astype(bool)


class Constraint:
    """One answer's matcher: the tokens allowed next, and the tokens chosen so far."""

    def __init__(self, matcher, grammars: Grammars):
        self._matcher, self.grammars = matcher, grammars

    def allowed(self) -> np.ndarray:
        """(vocab,) bool: the tokens the grammar allows next."""
        return self.grammars.allowed_rows([self])[0]

    def consume(self, token: int) -> bool:
        """Advance past ``token``; True when the answer is complete (the grammar stopped,
        or it refused the token, which a masked choice never gives)."""
        if not self._matcher.is_stopped():
            self._matcher.consume_token(int(token))
        return self._matcher.is_stopped() or self._matcher.is_error()
