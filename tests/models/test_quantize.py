"""`needle quantize` and quantized checkpoints: the output loads with load_pretrained on every
device and its logits are those of transformers' model holding the dequantized weights; it
generates; wrong quantization configs and damaged packed tensors are clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from needle import cli
from needle.backends.api import has
from needle.errors import ModelFormatError
from needle.models import load_pretrained
from needle.models.quantized import quantize_checkpoint
from needle.quant.format import dequantize
from tests.models.hf_models import build, torch

FORMATS = [(8, None, True), (4, 32, True), (4, 64, False)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    return directory, build("llama", directory)


def _dequantized_reference(model, out_dir):
    """transformers' model with every quantized Linear weight replaced by the value the
    packed arrays stand for (docs/quantization.md), read back from the written file."""
    from safetensors.numpy import load_file

    tensors = load_file(out_dir / "model.safetensors")
    q = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = name.removesuffix(".weight")
            if f"{base}.qweight" in tensors:
                k = p.shape[1]
                w = dequantize(tensors[f"{base}.qweight"], tensors[f"{base}.scales"],
                               tensors.get(f"{base}.offsets"), q["bits"],
                               q["group_size"] or k, k)
                p.copy_(torch.from_numpy(w))
    return model


@pytest.mark.parametrize("bits,group,symmetric", FORMATS)
def test_quantized_checkpoint_loads_and_generates(source, tmp_path, device, bits, group,
                                                  symmetric):
    src, hf = source
    out = quantize_checkpoint(src, tmp_path / "q", bits, group, symmetric, progress=False)
    raw = json.loads((out / "config.json").read_text())
    assert raw["quantization_config"]["bits"] == bits
    model = load_pretrained(out, device=device, dtype="float32")
    ref = _dequantized_reference(type(hf)(hf.config).eval(), out)
    ref.load_state_dict({**hf.state_dict(), **{k: v for k, v in ref.state_dict().items()
                                              if "proj" in k}})
    ids = [[1, 5, 9, 200, 3, 17, 42]]
    got = model(ids).numpy()
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    # the packed projections are what the model holds, at their packed size
    layer = model.weights.layers[0]
    assert type(layer.qkv.weight).__name__ == "QuantizedMatrix"
    assert layer.qkv.weight.nbytes < 64 * (64 + 2 * 32) * 4 * bits / 32 * 1.6
    new = model.generate(ids[0], 6, temperature=0)
    with torch.no_grad():
        expect = ref.generate(torch.tensor(ids), max_new_tokens=6, do_sample=False)
    assert new == expect[0, len(ids[0]):].tolist()[:len(new)]


def test_quantized_model_runs_in_bfloat16(source, tmp_path):
    src, _ = source
    out = quantize_checkpoint(src, tmp_path / "q", 4, 32, True, progress=False)
    exact = load_pretrained(out, device="cpu", dtype="float32")
    model = load_pretrained(out, device="cpu", dtype="bfloat16")
    assert model.weights.embed.dtype == "bfloat16"
    ids = [[1, 5, 9, 200, 3]]
    a = model(ids).numpy().astype(np.float32)
    b = exact(ids).numpy()
    assert np.abs(a - b).max() < 0.05 * np.abs(b).max()  # bf16 activations' rounding only


def test_cli_quantize_writes_a_loadable_directory(source, tmp_path, capsys):
    src, _ = source
    out = tmp_path / "q8"
    assert cli.main(["quantize", str(src), str(out), "--bits", "8"]) == 0
    err = capsys.readouterr().err
    assert "quantizing" in err and "int8, per-channel" in err  # tqdm's bar, then the summary
    model = load_pretrained(out, device="cpu_numpy")
    assert model.weights.layers[1].down.weight.spec.bits == 8
    assert cli.main(["quantize", str(out), str(tmp_path / "again"), "--bits", "4"]) == 1
    assert "already quantized" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["quantize", str(src), str(tmp_path / "x"), "--bits", "8", "--asymmetric"])


def test_foreign_or_damaged_quantization_is_a_clear_error(source, tmp_path):
    src, _ = source
    out = quantize_checkpoint(src, tmp_path / "q", 4, 32, True, progress=False)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="quant_method 'gptq'"):
        load_pretrained(out, device="cpu_numpy")
    config["quantization_config"] = {"quant_method": "needle", "bits": 4, "group_size": 64,
                                     "symmetric": True}
    (out / "config.json").write_text(json.dumps(config))  # the files hold groups of 32
    with pytest.raises(ModelFormatError, match=r"scales' is F32 \(64, 2\).*implies F32 \(64, 1\)"):
        load_pretrained(out, device="cpu_numpy")


def test_memory_estimate_counts_the_packed_bytes(source):
    from needle.models import memory
    from needle.models.config import ModelConfig
    from needle.models.quantized import quantizable, quantized_estimate
    from needle.quant.format import QuantSpec

    src, _ = source
    cfg = ModelConfig.from_file(src)
    dense = memory.estimate(cfg, "bfloat16", 64)
    names = quantizable(cfg)
    packed = quantized_estimate(dense, cfg, "bfloat16", {n: QuantSpec(4, 32) for n in names})
    shapes = cfg.tensor_shapes()
    saved = sum(int(np.prod(shapes[n])) * 2 - QuantSpec(4, 32).packed_nbytes(*shapes[n])
                for n in names)
    assert packed.weights == dense.weights - saved and saved > 0
    assert packed.workspace == dense.workspace + 2 * cfg.intermediate_size * cfg.hidden_size * 2


def test_needle_generate_and_chat_run_a_quantized_directory(tmp_path, capsys, monkeypatch):
    import io

    from needle.chat_cli import main as chat_main
    from tests.models.bpe import train
    from tests.models.hf_models import CHATML
    from tests.models.test_generate_cli import _expected_chat

    src = tmp_path / "src"
    tok = train(300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    build("llama", src, vocab_size=302, eos_token_id=tok.token_to_id("<|im_end|>"))
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": CHATML}))
    out_dir = tmp_path / "int4"
    assert cli.main(["quantize", str(src), str(out_dir), "--bits", "4", "--group-size", "32",
                     "--quiet"]) == 0
    assert (out_dir / "tokenizer.json").is_file() and (out_dir / "tokenizer_config.json").is_file()
    capsys.readouterr()
    assert cli.main(["generate", str(out_dir), "--prompt", "The quick", "--max-tokens", "5",
                     "--device", "cpu_numpy", "--temperature", "0"]) == 0
    model = load_pretrained(out_dir, device="cpu_numpy")
    ids = model.tokenizer.encode("The quick")
    assert capsys.readouterr().out == \
        "The quick" + model.tokenizer.decode(model.generate(ids, 5, temperature=0)) + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n"))
    assert chat_main([str(out_dir), "--device", "cpu_numpy", "--max-tokens", "6",
                      "--temperature", "0"]) == 0
    assert capsys.readouterr().out == _expected_chat(out_dir, ["Hello there"], 6)


@pytest.mark.parametrize("bits,group,symmetric", FORMATS)
def test_quantized_decode_as_five_operations_matches_composed(source, tmp_path, device, bits,
                                                             group, symmetric, monkeypatch):
    """Packed layers run the five fused operations where the backend fuses packed weights
    (``fused_quant_matvec``: the reference and CUDA; by default there) and the composed step
    elsewhere; the decoder's logits agree with each other and with the full forward pass."""
    src, _ = source
    out = quantize_checkpoint(src, tmp_path / "q", bits, group, symmetric, progress=False)
    prompt, seq = [1, 5, 9, 200], [1, 5, 9, 200, 3, 17, 42]
    logits = {}
    for choice in ("1", "0", "auto"):  # auto: five operations where packed ones are fused
        monkeypatch.setenv("NEEDLE_FUSED_DECODE", choice)
        model = load_pretrained(out, device=device, dtype="float32", max_seq_len=32)
        fused = choice != "0" and has(device.backend, "fused_quant_matvec")
        assert all(model.transformer.five_ops) == fused
        decoder = model.decoder()
        steps = [decoder.prefill(prompt).numpy()[0]]
        steps += [decoder.step(t).numpy()[0] for t in seq[len(prompt):]]
        logits[choice] = np.stack(steps).astype(np.float64)
        full = model(np.array([seq])).numpy()[0][len(prompt) - 1:].astype(np.float64)
        assert np.abs(logits[choice] - full).max() < 1e-4 * np.abs(full).max(), choice
    assert np.abs(logits["1"] - logits["0"]).max() < 1e-4 * np.abs(logits["0"]).max()
