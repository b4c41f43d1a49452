"""``needle perplexity``: a model's perplexity on a text file, against transformers' own
sliding-window recipe on the same checkpoint (a tiny Llama written by ``save_pretrained``
with a tokenizer trained here)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from needle.cli import main

from .hf_models import build_with_tokenizer

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it "
        "was the age of foolishness, it was the epoch of belief, it was the epoch of "
        "incredulity, it was the season of Light, it was the season of Darkness.\n") * 3


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ppl_model")
    reference = build_with_tokenizer(directory, max_position_embeddings=256).eval()
    text = directory / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    return directory, reference, text


def _transformers_perplexity(reference, ids: list[int], context: int, stride: int) -> float:
    """transformers' documented recipe ("Perplexity of fixed-length models"), each window's
    mean loss weighted by the tokens it scored."""
    x = torch.tensor([ids])
    nll, counted, prev_end = 0.0, 0, 0
    for begin in range(0, x.size(1), stride):
        end = min(begin + context, x.size(1))
        target = x[:, begin:end].clone()
        target[:, :-(end - prev_end)] = -100
        with torch.no_grad():
            loss = reference(x[:, begin:end], labels=target).loss
        # the model shifts the labels by one: the loss is the mean over target[:, 1:]'s
        valid = int((target[:, 1:] != -100).sum())
        nll += float(loss) * valid
        counted += valid
        prev_end = end
        if end == x.size(1):
            break
    return math.exp(nll / counted), counted


@pytest.mark.parametrize("context,stride", [(64, 64), (64, 16), (256, None)])
def test_perplexity_equals_transformers_sliding_windows(scored, capsys, context, stride):
    directory, reference, text = scored
    args = ["perplexity", str(directory), str(text), "--device", "cpu", "--dtype", "float32",
            "--json", "--quiet", "--context", str(context)]
    if stride is not None:
        args += ["--stride", str(stride)]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)
    from needle.models.tokenizer import Tokenizer

    ids = Tokenizer.from_directory(directory).encode(TEXT)  # the ids needle scored
    want, counted = _transformers_perplexity(reference, ids, context, stride or context)
    assert got["tokens_scored"] == counted
    assert got["perplexity"] == pytest.approx(want, rel=1e-4)
    assert (got["windows"] > 1) == (len(ids) > context)


def test_perplexity_refuses_what_it_cannot_score(scored, capsys, tmp_path):
    directory, _, text = scored
    one = tmp_path / "one.txt"
    one.write_text("", encoding="utf-8")
    cases = [([str(text), "--stride", "80", "--context", "64"], "stride must be in"),
             ([str(tmp_path / "missing.txt")], "is not a file"),
             ([str(one)], "at least 2 tokens"),
             ([str(text), "--context", "300"], "exceeds the model's max_position_embeddings")]
    for extra, message in cases:
        assert main(["perplexity", str(directory), *extra, "--device", "cpu", "--quiet"]) == 1
        assert message in capsys.readouterr().err, extra


def test_a_quantized_copy_is_scored_beside_its_source(scored, capsys, tmp_path):
    """The workflow the command is for: ``needle quantize``, then both perplexities on the
    same text (int8 per channel of a random model: within 1% of the source's)."""
    directory, _, text = scored
    out = tmp_path / "int8"
    assert main(["quantize", str(directory), str(out), "--bits", "8", "--quiet"]) == 0
    capsys.readouterr()
    results = []
    for model in (directory, out):
        assert main(["perplexity", str(model), str(text), "--device", "cpu", "--dtype",
                     "float32", "--json", "--quiet"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[0]["tokens_scored"] == results[1]["tokens_scored"]
    assert results[1]["perplexity"] == pytest.approx(results[0]["perplexity"], rel=1e-2)
    assert results[1]["perplexity"] != results[0]["perplexity"]


def test_perplexity_on_every_device(scored, capsys, device):
    """The command on each device (cuda, metal, numpy reference) gives transformers'
    figure: float32 within 1e-3, and bfloat16 (the dtype a Hub checkpoint is read in)
    within 3% where the device has it."""
    directory, reference, text = scored
    from needle.models.tokenizer import Tokenizer

    from ..conftest import supports

    ids = Tokenizer.from_directory(directory).encode(TEXT)
    want, _ = _transformers_perplexity(reference, ids, 64, 32)
    for dtype, rel in (("float32", 1e-3), ("bfloat16", 3e-2)):
        if not supports(device, dtype):
            continue
        args = ["perplexity", str(directory), str(text), "--device", device.name, "--dtype",
                dtype, "--json", "--quiet", "--context", "64", "--stride", "32"]
        assert main(args) == 0, capsys.readouterr().err
        got = json.loads(capsys.readouterr().out)
        assert got["perplexity"] == pytest.approx(want, rel=rel), dtype
