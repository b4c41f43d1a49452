"""The README's serving example (the openai client part) runs as written against a real
server, with the URL's port replaced by the test server's."""

from __future__ import annotations

import re
from pathlib import Path

from .test_server import Running  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_serving_example(model, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "OpenAI(" in b)
    name = re.search(r'model="([^"]+)"', example).group(1)
    server = Running(model, name=name, api_key=None, max_seqs=4)
    try:
        code = example.replace("http://127.0.0.1:8000", server.url)
        prompt_ids = model.tokenizer.encode("The quick brown")
        namespace = {"model": model, "prompt_ids": prompt_ids}
        exec(compile(code, "README.md", "exec"), namespace)
        reply = namespace["reply"].choices[0].message.content
        assert capsys.readouterr().out == reply + "\n"
        outs = namespace["outs"]
        assert len(outs) == 2 and outs[0] == model.generate(prompt_ids, 32)
    finally:
        server.stop()
