"""Chat templates: a model's ``chat_template`` (Jinja) rendered as transformers renders it.

Templates come from model repositories, so they are untrusted code: they run in jinja2's
``ImmutableSandboxedEnvironment`` (jinja2 >= 3.1.6, whose sandbox has no known escapes) and
see only plain JSON data built from the caller's messages. The environment is transformers':
``trim_blocks`` and ``lstrip_blocks``, the loop-controls extension, a ``tojson`` filter that
does not escape HTML, and the globals ``raise_exception``, ``strftime_now``, ``dict`` and
``namespace``; ``{% generation %}`` blocks render their body. The special tokens of the
tokenizer (``bos_token``, ``eos_token``, ...) are template variables, as in transformers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime

from ..errors import ModelFormatError

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ModelFormatError):
    """A chat template that failed to compile or that raised while rendering (for example
    through ``raise_exception`` when the conversation breaks its rules)."""


def _environment():
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ModelFormatError("chat templates need the 'jinja2' package: pip install jinja2 "
                               "(or needle[llm])") from None

    class GenerationBlocks(Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore names (no way into Python internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore attributes ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=lambda *a, **k: dict(*a, **k), namespace=Namespace)
    return env, jinja2


def plain(value):
    """``value`` rebuilt from plain JSON types (what a template may see); anything else
    becomes an inert placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, bool, int, float):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return plain(value.item())  # numpy scalars
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


class ChatTemplate:
    """One compiled template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        env, self._jinja = _environment()
        try:
            self._template = env.from_string(source)
        except self._jinja.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e} (line "
                                    f"{e.lineno})") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, conversation: list[dict], add_generation_prompt: bool = False,
               continue_final_message: bool = False, tools=None, documents=None,
               **kwargs) -> str:
        """The conversation as the prompt text the model was trained on."""
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ChatTemplateError("a conversation must be a non-empty list of messages "
                                    "(dicts with 'role' and 'content')")
        messages = [{k: v for k, v in m.items() if v is not None} for m in _messages(
            conversation)]
        messages = plain(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt "
                                        "cannot be used together")
            final = messages[-1].get("content")
            if not isinstance(final, str):
                raise ChatTemplateError("continue_final_message needs a final message with "
                                        "string content")
            messages[-1]["content"] = final + _CONTINUE_TAG
        variables = {**self.special_tokens, **plain(kwargs)}
        try:
            text = self._template.render(messages=messages, tools=plain(tools),
                                         documents=plain(documents),
                                         add_generation_prompt=add_generation_prompt,
                                         **variables)
        except self._jinja.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused this conversation: {e}") \
                from None
        if continue_final_message:
            at = text.rfind(_CONTINUE_TAG.strip())
            if at < 0:
                raise ChatTemplateError("continue_final_message: the template dropped the final "
                                        "message")
            text = text[:at]
        return text


def _messages(conversation) -> list[dict]:
    out = []
    for m in conversation:
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"each message must be a dict with 'role' and 'content', "
                                    f"got {m!r}")
        out.append(dict(m))
    return out
