"""Chat templates rendered exactly as transformers renders them: the public forms of the
Llama 3, ChatML (Qwen2), Gemma and Mistral templates plus one that uses namespaces, loop
controls and tools, compared with ``transformers.AutoTokenizer.apply_chat_template`` on the
same tokenizer files — including the directory transformers itself saves
(chat_template.jinja) and the errors templates raise."""

from __future__ import annotations

import json

import pytest
import transformers

from needle.errors import ModelFormatError
from needle.models.chat import ChatTemplateError
from needle.models.tokenizer import Tokenizer

from .bpe import train

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "[INST]",
            "[/INST]"]

TEMPLATES = {
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
        "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}"),
    "chatml": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for message in messages %}{% if (message['role'] == 'user') != "
        "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
        "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
        "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
        "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
        "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{'<start_of_turn>model\n'}}{% endif %}"),
    "mistral": (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
        "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
        "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
        "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception("
        "'Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"),
    "tools": (
        "{%- set ns = namespace(system='', turns=0) -%}\n"
        "{%- for m in messages -%}\n"
        "  {%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- continue -%}"
        "{%- endif -%}\n"
        "  {%- set ns.turns = ns.turns + 1 -%}\n"
        "  {%- if ns.turns > 3 -%}{%- break -%}{%- endif -%}\n"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{%- endfor %}\n"
        "{% if ns.system %}system: {{ ns.system }}{% endif %}\n"
        "{% if tools %}tools: {{ tools | tojson(indent=2) }}{% endif %}\n"
        "{% if date %}date: {{ date }}{% endif %}\n"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello, who are you?"}],
    [{"role": "user", "content": " needle <ok> & café "},
     {"role": "assistant", "content": "A framework."},
     {"role": "user", "content": "Which one?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
     {"role": "assistant", "content": "Bye"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module", params=list(TEMPLATES))
def tokenizers_dir(request, tmp_path_factory):
    """(template name, directory with tokenizer.json + tokenizer_config.json)."""
    directory = tmp_path_factory.mktemp(f"tok-{request.param}")
    tok = train(300)
    tok.add_special_tokens(SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False,
                      "special": True},
        "chat_template": TEMPLATES[request.param]}))
    return request.param, directory


def _render_both(directory, conversation, **kwargs):
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    ours = Tokenizer.from_directory(directory)
    results = []
    for tok in (hf, ours):
        try:
            results.append(("ok", tok.apply_chat_template(conversation, **kwargs)))
        except Exception as e:  # both must refuse the same conversations
            results.append(("error", type(e).__name__))
    return results


def _assert_same(hf, ours):
    if hf[0] == "error":  # a template's raise_exception: needle names it ChatTemplateError
        assert ours == ("error", "ChatTemplateError"), (hf, ours)
    else:
        assert ours == hf


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_text_matches_transformers(tokenizers_dir, index, generation_prompt):
    name, directory = tokenizers_dir
    _assert_same(*_render_both(directory, CONVERSATIONS[index], tokenize=False,
                               add_generation_prompt=generation_prompt))


def test_token_ids_and_dicts_match_transformers(tokenizers_dir):
    _, directory = tokenizers_dir
    conversation = CONVERSATIONS[1]
    hf, ours = _render_both(directory, conversation, add_generation_prompt=True)
    assert ours == ("ok", dict(hf[1]))
    hf, ours = _render_both(directory, conversation, add_generation_prompt=True,
                            return_dict=False)
    assert ours == hf
    hf, ours = _render_both(directory, [conversation, CONVERSATIONS[0]], tokenize=False,
                            add_generation_prompt=True)
    assert ours == hf


def test_tools_and_extra_variables_reach_the_template(tokenizers_dir):
    _, directory = tokenizers_dir
    for conversation in CONVERSATIONS[1:]:
        _assert_same(*_render_both(directory, conversation, tools=TOOLS, date="2026-11-23",
                                   tokenize=False, add_generation_prompt=True))


def test_the_directory_transformers_saves(tokenizers_dir, tmp_path):
    """transformers 5 writes the template to chat_template.jinja: needle reads it there."""
    _, directory = tokenizers_dir
    transformers.AutoTokenizer.from_pretrained(directory).save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    hf, ours = _render_both(tmp_path, CONVERSATIONS[0], tokenize=False,
                            add_generation_prompt=True)
    assert ours == hf


@pytest.mark.parametrize("tokenizers_dir", ["gemma", "mistral"], indirect=True)
def test_raise_exception_is_a_clear_error(tokenizers_dir):
    """The templates that refuse a conversation (the others accept every one)."""
    _, directory = tokenizers_dir
    ours = Tokenizer.from_directory(directory)
    with pytest.raises(ChatTemplateError, match="roles must alternate|System role"):
        ours.apply_chat_template([{"role": "system", "content": "x"},
                                  {"role": "system", "content": "y"}], tokenize=False)


def test_sandbox_refuses_python_internals(tmp_path):
    """Templates are untrusted: attribute tricks that reach Python internals fail."""
    tok = train(300)
    tok.save(str(tmp_path / "tokenizer.json"))
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": evil}))
    ours = Tokenizer.from_directory(tmp_path)
    with pytest.raises(ChatTemplateError):
        ours.apply_chat_template(CONVERSATIONS[0], tokenize=False)


def test_missing_and_broken_templates(tmp_path):
    tok = train(300)
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_directory(tmp_path)
    with pytest.raises(ModelFormatError, match="no chat template"):
        ours.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ours.apply_chat_template(CONVERSATIONS[0], chat_template="{% for %}")
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        ours.apply_chat_template([], chat_template=TEMPLATES["chatml"])
