"""``needle generate`` end to end on a tiny checkpoint with a tokenizer trained here."""

from __future__ import annotations

import pytest

from needle.cli import main as needle_main
from needle.errors import ModelFormatError
from needle.generate_cli import main
from needle.models import load_pretrained

from .bpe import train
from .hf_models import build


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cli_model")
    build("llama", directory, vocab_size=300)
    train(300).save(str(directory / "tokenizer.json"))
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
