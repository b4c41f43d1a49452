"""A tiny Llama that has learned two answers of a tool-using conversation, saved with
``save_pretrained`` beside a tokenizer trained here and a hermes-style chat template (the
format of Qwen 2.5 and 3: tools listed in the system turn, calls written as
``<tool_call>{...}</tool_call>``, results sent back as ``<tool_response>``).

The prompts it learns are rendered by transformers' own ``apply_chat_template``, so the
server answers them only if it renders OpenAI's messages (tools, an assistant's
``tool_calls``, a ``tool`` message) into the same ids. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

# the model's template, written for these tests (Qwen's is longer; the format is the same)
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions. Write each call as
<tool_call>{"name": ..., "arguments": ...}</tool_call>.
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls is defined %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGUMENTS = {"city": "Paris"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RESULT = json.dumps({"sky": "sunny", "celsius": 21})
ANSWER = "It is sunny and 21 degrees in Paris."


def conversation_after_call(call_id: str) -> list[dict]:
    """The question, the model's call as OpenAI returns it, and the tool's result."""
    return QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT}]


def reference_tokenizer(directory: Path):
    return transformers.PreTrainedTokenizerFast.from_pretrained(directory)


def transformers_prompt(tokenizer, messages: list[dict], tools=TOOLS) -> list[int]:
    """The prompt ids transformers renders (tool-call arguments as objects, its convention)."""
    converted = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
        converted.append(m)
    return tokenizer.apply_chat_template(converted, tools=tools, add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def build(directory: Path, steps: int = 400, template: str = TEMPLATE,
          answers: tuple[str, str] = (CALL, ANSWER), tools=TOOLS) -> None:
    """Train and save the model and its tokenizer in ``directory``: ``answers`` are what it
    learns to say to the question and after the tool's result (a reasoning model's
    include their thinking), its prompts rendered with ``tools`` offered (None: none)."""
    from ..models.bpe import train

    tok = train(300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    # not special: clients see them (as Qwen's tokenizers have them)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    tok.save(str(directory / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
         "chat_template": template}))
    reference = reference_tokenizer(directory)
    examples = [(transformers_prompt(reference, QUESTION, tools), answers[0]),
                (transformers_prompt(reference, conversation_after_call("call_0"), tools),
                 answers[1])]
    sequences = [(prompt, tok.encode(answer, add_special_tokens=False).ids + [eos])
                 for prompt, answer in examples]
    longest = max(len(p) + len(a) for p, a in sequences)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1 << (longest + 64).bit_length(), bos_token_id=0,
        eos_token_id=eos)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    _memorize(model, sequences, steps)
    model.save_pretrained(directory, safe_serialization=True)


def _memorize(model, sequences: list[tuple[list[int], list[int]]], steps: int) -> None:
    """Train until every answer token is the model's greedy choice after its prefix."""
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = []
    for prompt, answer in sequences:
        ids = torch.tensor([prompt + answer])
        labels = ids.clone()
        labels[0, :len(prompt)] = -100  # learn the answers only
        batches.append((ids, labels))
    for step in range(steps):
        optimizer.zero_grad()
        loss = sum(model(input_ids=ids, labels=labels).loss for ids, labels in batches)
        loss.backward()
        optimizer.step()
        if step % 25 == 24 and _all_greedy(model, batches):
            return
    assert _all_greedy(model, batches), "the tool model did not learn its answers"


@torch.no_grad()
def _all_greedy(model, batches) -> bool:
    for ids, labels in batches:
        choice = model(input_ids=ids).logits[0, :-1].argmax(-1)
        wanted = labels[0, 1:]
        if not bool((choice[wanted != -100] == wanted[wanted != -100]).all()):
            return False
    return True


# a reasoning model's version: the same template with Qwen3's switch (enable_thinking false
# closes an empty thinking in the prompt), answers that think first
THINKING_TEMPLATE = TEMPLATE.replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n<think>\n\n</think>\n"
    "{% endif %}\n{% endif %}")
THINK_CALL = "<think>\nThe user wants the weather: I call the tool.\n</think>\n\n"
THINK_ANSWER = "<think>\nThe tool says sunny.\n</think>\n\n"


def build_thinker(directory: Path) -> None:
    """The model that thinks before its call and before its answer."""
    build(directory, template=THINKING_TEMPLATE,
          answers=(THINK_CALL + CALL, THINK_ANSWER + ANSWER))
