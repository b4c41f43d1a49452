"""The README's language-model example runs as written on a bf16 checkpoint directory made
the way the Hub's are (transformers' save_pretrained, a tokenizer with a chat template)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .bpe import train
from .hf_models import CHATML, build

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_llm_example(tmp_path, capsys, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "load_pretrained" in b)
    path = re.search(r'load_pretrained\("([^"]+)"', example).group(1)
    directory = tmp_path / Path(path).name
    tok = train(300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    build("llama", directory, dtype="bfloat16", vocab_size=302,
          eos_token_id=tok.token_to_id("<|im_end|>"))
    (tmp_path / "tokenizer.json").rename(directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NEEDLE_DEVICE", "cpu")
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert 1 <= len(namespace["new_ids"]) <= 32
    assert namespace["model"].dtype == "bfloat16"
    assert capsys.readouterr().out.strip() == namespace["model"].tokenizer.decode(
        namespace["new_ids"]).strip()
