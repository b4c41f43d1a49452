"""A tiny Llama checkpoint written by transformers' save_pretrained, with a BPE tokenizer
trained here and a ChatML template (nothing is downloaded)."""

from __future__ import annotations

import json

import pytest

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from ..models.bpe import train
    from ..models.hf_models import build

    directory = tmp_path_factory.mktemp("serve_model")
    tok = train(300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(directory / "tokenizer.json"))
    im_end = tok.token_to_id("<|im_end|>")
    build("llama", directory, vocab_size=302, eos_token_id=im_end,
          max_position_embeddings=256)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
         "chat_template": CHATML}))
    return directory


@pytest.fixture(scope="session")
def model(model_dir):
    from needle.models import load_pretrained

    return load_pretrained(model_dir, device="cpu", dtype="float32")
