"""``needle.finetune.data`` against transformers: a BPE tokenizer trained here, saved as a model
directory would hold it (tokenizer.json + tokenizer_config.json with a ChatML template), read
by needle's Tokenizer and by ``transformers.AutoTokenizer``. Chat labels are checked against
transformers' ``assistant_masks`` from the same template with ``{% generation %}`` tags."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers

from needle.errors import ArgumentError, DataFormatError
from needle.finetune.data import IGNORE, Example, batches, read_examples
from needle.models.tokenizer import Tokenizer
from tests.models.bpe import train
from tests.models.hf_models import CHATML

# CHATML with the assistant's content and <|im_end|> inside {% generation %}: what transformers
# needs for return_assistant_tokens_mask; it renders the same text as CHATML
TAGGED = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
          "{% if message['role'] == 'assistant' %}{% generation %}"
          "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
          "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOOLS = ("{% if tools %}<|im_start|>system\\nTools: {{ tools | tojson }}<|im_end|>\\n"
         "{% endif %}")
SYSTEM = {"role": "system", "content": "Answer briefly."}
TWO_TURNS = [SYSTEM, {"role": "user", "content": "the quick brown fox"},
             {"role": "assistant", "content": "jumps over"},
             {"role": "user", "content": "and then?"},
             {"role": "assistant", "content": "the lazy dog."}]
WEATHER = [{"type": "function", "function": {
    "name": "weather", "description": "Today's weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def tokenizer_dir(directory, template: str | None = CHATML, eos: str | None = "<|im_end|>"):
    """A model directory's tokenizer files, as tests/models/hf_models.build_with_tokenizer
    writes them (the same BPE and ChatML tokens), with a chosen template and eos."""
    directory.mkdir(exist_ok=True)
    tok = train(300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if eos is not None:
        config["eos_token"] = eos
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """(needle Tokenizer, transformers tokenizer) of one ChatML directory."""
    directory = tokenizer_dir(tmp_path_factory.mktemp("chatml"))
    return Tokenizer.from_directory(directory), transformers.AutoTokenizer.from_pretrained(
        directory)


def write_jsonl(path, records, raw: dict[int, str] | None = None):
    """Records one a line; ``raw`` puts text verbatim at given 1-based lines ("" blank)."""
    lines = [json.dumps(r) for r in records]
    for n, text in sorted((raw or {}).items()):
        lines.insert(n - 1, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def learned(example: Example) -> list[int]:
    return [i for i, label in enumerate(example.labels) if label != IGNORE]


# --- the three forms against transformers ----------------------------------------------------
def test_text_form_is_transformers_encoding_plus_eos_all_learned(toks, tmp_path):
    ours, hf = toks
    texts = ["The quick brown fox jumps over the lazy dog.", "Naïve café 🙂"]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    examples = read_examples(path, ours, 512)
    for example, text in zip(examples, texts):
        assert example.ids == hf(text).input_ids + [hf.eos_token_id]
        assert example.labels == example.ids


def test_prompt_completion_learns_the_completion_and_eos_only(toks, tmp_path):
    ours, hf = toks
    prompt, completion = "Tokens, tokens everywhere:", " byte pair encoding"
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "completion": completion},
                                               {"prompt": prompt, "completion": "done<|im_end|>"}])
    first, second = read_examples(path, ours, 512)
    head = hf(prompt).input_ids
    tail = hf(completion, add_special_tokens=False).input_ids + [hf.eos_token_id]
    assert first.ids == head + tail
    assert first.labels == [IGNORE] * len(head) + tail
    assert head[0] == hf.convert_tokens_to_ids("<s>")  # the BOS the post-processor adds
    # a completion already ending in eos gets no second one
    assert second.ids == head + hf("done<|im_end|>", add_special_tokens=False).input_ids
    assert second.ids.count(hf.eos_token_id) == 1


@pytest.mark.parametrize("messages", [TWO_TURNS[1:3], TWO_TURNS[:3], TWO_TURNS],
                         ids=["one_turn", "system", "two_assistant_turns"])
def test_chat_labels_are_transformers_assistant_masks(toks, tmp_path, messages):
    ours, hf = toks
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}])
    (example,) = read_examples(path, ours, 512)
    plain = hf.apply_chat_template(messages, tokenize=True, return_dict=False)
    tagged = hf.apply_chat_template(messages, chat_template=TAGGED, tokenize=True,
                                    return_dict=True, return_assistant_tokens_mask=True)
    assert example.ids == plain == tagged["input_ids"]
    mask = tagged["assistant_masks"]
    assert learned(example) == [i for i, m in enumerate(mask) if m]
    assert all(label in (IGNORE, i) for label, i in zip(example.labels, example.ids))
    # each assistant turn is learned with its <|im_end|>, nothing of the user's
    spans = ours.decode([i for i, label in zip(example.ids, example.labels) if label != IGNORE],
                        skip_special_tokens=False)
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert spans == "".join(r + "<|im_end|>" for r in replies)


def test_tools_reach_the_template_and_are_not_learned(tmp_path):
    directory = tokenizer_dir(tmp_path / "tools", template=TOOLS + CHATML)
    ours, hf = Tokenizer.from_directory(directory), transformers.AutoTokenizer.from_pretrained(
        directory)
    messages = TWO_TURNS[1:3]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": messages, "tools": WEATHER}])
    (example,) = read_examples(path, ours, 2048)
    assert example.ids == hf.apply_chat_template(messages, tools=WEATHER, tokenize=True,
                                                 return_dict=False)
    assert '"name": "weather"' in ours.decode(example.ids)
    assert ours.decode([i for i, label in zip(example.ids, example.labels) if label != IGNORE],
                       skip_special_tokens=False) == "jumps over<|im_end|>"


def test_json_list_file_and_blank_lines(toks, tmp_path):
    ours, _ = toks
    records = [{"text": "the lazy dog"}, {"prompt": "ping", "completion": "pong"},
               {"messages": TWO_TURNS[1:3]}]
    as_list = tmp_path / "d.json"
    as_list.write_text(json.dumps(records, indent=2))
    as_lines = write_jsonl(tmp_path / "d.jsonl", records, raw={1: "", 3: "   ", 6: ""})
    assert read_examples(as_list, ours, 512) == read_examples(as_lines, ours, 512)
    assert len(read_examples(as_list, ours, 512)) == 3


def test_eos_from_the_tokenizer_else_eos_id_else_none(tmp_path):
    directory = tokenizer_dir(tmp_path / "no_eos", eos=None)
    ours = Tokenizer.from_directory(directory)
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ping", "completion": "pong"}])
    plain = ours.encode("ping") + ours.encode("pong", add_special_tokens=False)
    assert read_examples(path, ours, 64)[0].ids == plain
    assert read_examples(path, ours, 64, eos_id=1)[0].ids == plain + [1]
    with_eos = Tokenizer.from_directory(tokenizer_dir(tmp_path / "eos"))
    assert read_examples(path, with_eos, 64, eos_id=1)[0].ids[-1] == with_eos.token_id(
        "<|im_end|>")  # the tokenizer's eos_token wins, as in TRL


# --- max_len ---------------------------------------------------------------------------------
def test_truncation_cuts_ids_and_labels(toks, tmp_path):
    ours, _ = toks
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "the quick brown fox jumps"},
                                               {"prompt": "ping", "completion": "pong"}])
    full = read_examples(path, ours, 512)
    cut = read_examples(path, ours, 4)
    for short, whole in zip(cut, full):
        assert short.ids == whole.ids[:4] and short.labels == whole.labels[:4]
    with pytest.raises(DataFormatError, match=r"line 1: \d+ tokens, more than max_len=4"):
        read_examples(path, ours, 4, truncate=False)


def test_examples_left_without_labels_are_dropped(toks, tmp_path):
    ours, _ = toks
    long_prompt = {"prompt": "the quick brown fox jumps over the lazy dog", "completion": "x"}
    path = write_jsonl(tmp_path / "d.jsonl", [long_prompt, {"text": "dog"}, long_prompt])
    (kept,) = read_examples(path, ours, 6)
    assert kept.ids == ours.encode("dog") + [ours.token_id("<|im_end|>")]
    only_long = write_jsonl(tmp_path / "long.jsonl", [long_prompt, long_prompt])
    with pytest.raises(DataFormatError, match="all 2 were dropped.*raise max_len"):
        read_examples(only_long, ours, 6)


# --- errors ----------------------------------------------------------------------------------
BAD = {
    "not_object": ("[1, 2]", "must be a JSON object"),
    "unknown_form": ('{"question": "q", "answer": "a"}', "no known form"),
    "text_not_string": ('{"text": 5}', "'text' must be a string"),
    "prompt_only": ('{"prompt": "q"}', "'prompt' and 'completion' must both be strings"),
    "completion_list": ('{"prompt": "q", "completion": ["a"]}', "must both be strings"),
    "messages_not_list": ('{"messages": "hi"}', "non-empty list of objects"),
    "message_no_content": ('{"messages": [{"role": "user"}]}', "string 'role' and 'content'"),
    "message_not_object": ('{"messages": ["hi"]}', "string 'role' and 'content'"),
    "no_assistant": ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant"),
    "tools_not_list": ('{"messages": [{"role": "assistant", "content": "a"}], "tools": 3}',
                       "'tools' must be a list"),
    "invalid_json": ('{"text": "unterminated', "not valid JSON"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_record_names_file_and_line(toks, tmp_path, name):
    ours, _ = toks
    line, message = BAD[name]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}], raw={2: "", 3: line})
    with pytest.raises(DataFormatError, match=message) as info:
        read_examples(path, ours, 64)
    assert f"{path}, line 3" in str(info.value)


def test_bad_record_in_json_list_names_index(toks, tmp_path):
    ours, _ = toks
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": "fine"}, {"text": None}]))
    with pytest.raises(DataFormatError, match=r"list index 1: 'text' must be a string"):
        read_examples(path, ours, 64)
    path.write_text('[{"text": "fine"},\n {"text": }]')
    with pytest.raises(DataFormatError, match="not valid JSON.*line 2"):
        read_examples(path, ours, 64)


def test_missing_and_empty_files(toks, tmp_path):
    ours, _ = toks
    with pytest.raises(DataFormatError, match="does not exist"):
        read_examples(tmp_path / "nope.jsonl", ours, 64)
    for text in ("", "\n  \n", "[]"):
        (tmp_path / "empty.jsonl").write_text(text)
        with pytest.raises(DataFormatError, match="holds no records"):
            read_examples(tmp_path / "empty.jsonl", ours, 64)


def test_messages_need_a_chat_template(tmp_path):
    ours = Tokenizer.from_directory(tokenizer_dir(tmp_path / "plain", template=None))
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"messages": TWO_TURNS}])
    with pytest.raises(DataFormatError, match="line 2: .*has none; use the text or prompt"):
        read_examples(path, ours, 64)


def test_template_refusing_a_conversation_names_the_line(tmp_path):
    refuse = ("{% if messages[0]['role'] == 'assistant' %}"
              "{{ raise_exception('start with a user message') }}{% endif %}")
    ours = Tokenizer.from_directory(tokenizer_dir(tmp_path / "strict", template=refuse + CHATML))
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [
        {"role": "assistant", "content": "hi"}]}])
    with pytest.raises(DataFormatError, match="line 1: .*start with a user message"):
        read_examples(path, ours, 64)


def test_template_that_is_not_incremental_is_refused(tmp_path):
    counting = "{{ messages | length }}" + CHATML  # every prefix renders a different head
    ours = Tokenizer.from_directory(tokenizer_dir(tmp_path / "count", template=counting))
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": TWO_TURNS}])
    with pytest.raises(DataFormatError,
                       match="line 1: the chat template does not render conversations "
                             "incrementally.*prompt/completion form"):
        read_examples(path, ours, 512)


@pytest.mark.parametrize("max_len", [0, -3, 2.5, True])
def test_max_len_must_be_a_positive_int(toks, tmp_path, max_len):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}])
    with pytest.raises(ArgumentError, match="max_len"):
        read_examples(path, toks[0], max_len)


# --- batches ---------------------------------------------------------------------------------
EXAMPLES = [Example(list(range(10 * k, 10 * k + n)), [IGNORE] + list(range(10 * k + 1,
                                                                           10 * k + n)))
            for k, n in enumerate([3, 5, 2, 4, 1])]


def test_batches_pad_right_to_the_longest_and_keep_order():
    out = list(batches(EXAMPLES, 2, pad_id=7, shuffle=False, seed=0))
    assert [ids.shape for ids, _ in out] == [(2, 5), (2, 4), (1, 1)]  # last batch smaller
    for ids, labels in out:
        assert ids.dtype == labels.dtype == np.int64
    ids, labels = out[0]
    assert ids.tolist() == [[0, 1, 2, 7, 7], [10, 11, 12, 13, 14]]
    assert labels.tolist() == [[IGNORE, 1, 2, IGNORE, IGNORE], [IGNORE, 11, 12, 13, 14]]


def test_batches_shuffle_is_a_seeded_permutation():
    def firsts(seed):
        return [int(row[0]) for ids, _ in batches(EXAMPLES, 2, pad_id=0, shuffle=True,
                                                  seed=seed) for row in ids]

    expected = [10 * int(k) for k in np.random.default_rng(3).permutation(5)]
    assert firsts(3) == firsts(3) == expected
    assert sorted(firsts(4)) == [0, 10, 20, 30, 40]
    assert any(firsts(s) != firsts(3) for s in range(4, 8))


@pytest.mark.parametrize("size", [0, -1, 1.5, "2", True])
def test_batch_size_must_be_a_positive_int(size):
    with pytest.raises(ArgumentError, match="batch_size"):
        next(batches(EXAMPLES, size, pad_id=0, shuffle=False, seed=0))
