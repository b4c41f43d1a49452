"""``needle generate`` end to end on a tiny checkpoint with a tokenizer trained here."""

from __future__ import annotations

import pytest

from needle.cli import main as needle_main
from needle.errors import ModelFormatError
from needle.generate_cli import main
from needle.models import load_pretrained

from .hf_models import build_with_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cli_model")
    build_with_tokenizer(directory)
    return directory


def test_streams_text_and_reports_speed(model_dir, capsys):
    assert main([str(model_dir), "--prompt", "The quick brown", "--max-tokens", "12",
                 "--device", "cpu_numpy", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    model = load_pretrained(model_dir, device="cpu_numpy")
    ids = model.tokenizer.encode("The quick brown")
    expected = model.tokenizer.decode(model.generate(ids, 12))
    assert out == "The quick brown" + expected + "\n"
    assert f"prefill: {len(ids)} tokens" in err
    assert "tokens/s" in err and "decode:" in err and "MiB" in err


def test_sampling_options(model_dir, capsys):
    args = [str(model_dir), "--prompt", "needle", "--max-tokens", "8", "--temperature", "0.9",
            "--top-k", "50", "--top-p", "0.95", "--seed", "3", "--device", "cpu_numpy"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_errors_are_reported_not_raised(tmp_path, model_dir, capsys):
    assert needle_main(["generate", str(tmp_path), "--prompt", "hi"]) == 1
    assert "tokenizer.json does not exist" in capsys.readouterr().err
    with pytest.raises(ModelFormatError):
        main([str(tmp_path), "--prompt", "hi"])
    assert needle_main(["generate", str(model_dir), "--prompt", "hi", "--temperature", "-1",
                        "--device", "cpu_numpy"]) == 1
    assert "temperature" in capsys.readouterr().err


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny Llama with a tokenizer, a ChatML template and <|im_end|> as its eos."""
    directory = tmp_path_factory.mktemp("chat_model")
    build_with_tokenizer(directory, chat=True)
    return directory


def _expected_chat(directory, turns, max_tokens):
    """What the conversation should print: each answer as the library makes it, with the
    answers fed back into the conversation."""
    model = load_pretrained(directory, device="cpu_numpy")
    messages, out = [], ""
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  return_dict=False)
        tokens = model.generate(ids, max_tokens, temperature=0)
        reply = model.tokenizer.decode(tokens)
        out += reply + "\n"
        messages.append({"role": "assistant", "content": reply})
    return out


def test_chat_plays_one_turn_per_line(chat_dir, capsys, monkeypatch):
    import io

    from needle.chat_cli import main as chat_main

    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n\nAnd again?\n"))
    assert chat_main([str(chat_dir), "--device", "cpu_numpy", "--max-tokens", "10",
                      "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out == _expected_chat(chat_dir, ["Hello there", "And again?"], 10)
    assert out.count("\n") == 2


def test_chat_through_a_real_pipe(chat_dir):
    """``printf 'a\\nb\\n' | needle chat DIR`` in a subprocess: two answers, exit 0."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "needle.cli", "chat", str(chat_dir), "--device", "cpu_numpy",
         "--max-tokens", "6", "--temperature", "0", "--stats"],
        input="The quick\nbrown fox\n", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == _expected_chat(chat_dir, ["The quick", "brown fox"], 6)
    assert result.stderr.count("first token:") == 2


def test_generate_with_chat_template(chat_dir, capsys):
    assert main([str(chat_dir), "--prompt", "Hello there", "--chat", "--max-tokens", "8",
                 "--temperature", "0", "--device", "cpu_numpy"]) == 0
    out = capsys.readouterr().out
    assert out == _expected_chat(chat_dir, ["Hello there"], 8)


def test_chat_needs_a_template(model_dir, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert needle_main(["chat", str(model_dir), "--device", "cpu_numpy"]) == 1
    assert "no chat template" in capsys.readouterr().err
