"""The trainable CausalLM against transformers on checkpoints its save_pretrained writes:
logits, the labelled loss and every parameter's gradient, for every family and device; and
a trained model saved back, read by transformers and by load_pretrained."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

import needle as ndl
from needle.errors import ArgumentError, ModelFormatError, ShapeError
from needle.finetune import CausalLM, save_pretrained
from needle.models import load_pretrained
from needle.models.quantized import quantize_checkpoint
from tests.models.hf_models import build


def rel_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def batch(seed: int = 0, shape=(2, 12)):
    ids = np.random.default_rng(seed).integers(3, 256, shape)
    labels = ids.copy()
    labels[0, :4] = -100  # a prompt that carries no loss
    return ids, labels


def reference_loss_and_grads(hf, ids, labels):
    hf.zero_grad()
    out = hf(torch.as_tensor(ids), labels=torch.as_tensor(labels))
    out.loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in hf.named_parameters() if p.grad is not None}
    return out.logits.detach().numpy(), float(out.loss.detach()), grads


def test_logits_loss_and_gradients_match_transformers(checkpoints, variant, device):
    directory, hf = checkpoints(variant)
    model = CausalLM.from_pretrained(directory, device=device)
    ids, labels = batch()
    ref_logits, ref_loss, ref_grads = reference_loss_and_grads(hf, ids, labels)
    assert rel_error(model(ids).numpy(), ref_logits) < 1e-4
    loss = model.loss(ids, labels)
    assert abs(float(loss.numpy()) - ref_loss) < 1e-5 * ref_loss
    loss.backward()
    names = dict(model.named_parameters())
    # every checkpoint tensor is a parameter under its checkpoint name, and gets a gradient
    assert set(names) == set(ref_grads)
    for name, param in names.items():
        assert rel_error(param.grad.numpy(), ref_grads[name]) < 1e-4, name


def test_bf16_checkpoint_and_autocast(tmp_path):
    """A bf16 file (the Hub's dtype) read as float32 master weights gives transformers'
    float32 reading of it; under autocast the loss is bf16-close."""
    hf = build("qwen3", tmp_path, dtype="bfloat16")
    model = CausalLM.from_pretrained(tmp_path, device=ndl.cpu())
    ids, labels = batch(1)
    ref_logits, ref_loss, _ = reference_loss_and_grads(hf, ids, labels)
    assert rel_error(model(ids).numpy(), ref_logits) < 1e-4
    with ndl.autocast("bfloat16"):
        low = float(model.loss(ids, labels).numpy())
    assert abs(low - ref_loss) < 3e-2 * ref_loss


CUDA = ndl.cuda(0)


@pytest.mark.skipif(not CUDA.enabled(), reason=f"cuda disabled: {CUDA.reason}")
@pytest.mark.parametrize("variant,overrides", [
    # head size 64, 4 query heads over 2; transformers' usual initializer scale (TINY's 0.2
    # at this width makes scores so large that bf16 alone moves the gradients by >10%)
    ("llama", dict(hidden_size=256, initializer_range=0.02)),
    ("qwen3", dict(head_dim=128)),     # head size 128
], ids=["llama_d64", "qwen3_d128"])
def test_cuda_autocast_gradients_take_the_tensor_core_attention(tmp_path, variant,
                                                                overrides):
    """Under bf16 autocast on CUDA, head sizes 64 and 128 take attention's gradient from the
    tensor-core kernels (attention_tc_bwd.cu): every parameter's gradient is bf16-close to
    transformers' float32 one, and close to needle's own composed gradient."""
    hf = build(variant, tmp_path, **overrides)
    ids, labels = batch(2, shape=(2, 96))
    _, ref_loss, ref_grads = reference_loss_and_grads(hf, ids, labels)
    d = overrides.get("head_dim", 64)

    def grads(fused: bool):
        model = CausalLM.from_pretrained(tmp_path, device=CUDA)
        with CUDA.backend.tuned(attention_backward=fused), CUDA.backend.profile() as prof:
            with ndl.autocast("bfloat16"):
                loss = model.loss(ids, labels)
            loss.backward()
            found = {n: p.grad.numpy() for n, p in model.named_parameters()}
        return float(loss.numpy()), found, set(prof.totals)

    loss, fused, kernels = grads(True)
    assert {f"attention_tc{d}_train_bf16", f"attention_tc{d}_bwd_dq_bf16",
            f"attention_tc{d}_bwd_dkv_bf16"} <= kernels
    assert abs(loss - ref_loss) < 3e-2 * ref_loss
    _, composed, kernels = grads(False)
    assert not any(k.startswith("attention_tc") and "_bwd_" in k for k in kernels)
    for name, want in ref_grads.items():
        off, apart = rel_error(fused[name], want), rel_error(fused[name], composed[name])
        assert off < 0.1 and apart < 0.05, f"{name}: {off:.3f} off transformers' float32 " \
                                           f"gradient, {apart:.3f} off the composed one"


@pytest.mark.parametrize("name", ["llama", "phi3", "gemma3", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trained_model_saved_back_reads_in_transformers_and_needle(checkpoints, name, dtype,
                                                                   tmp_path):
    directory, _ = checkpoints(name)
    model = CausalLM.from_pretrained(directory, device=ndl.cpu())
    opt = ndl.optim.AdamW(model.parameters(), lr=1e-2)
    ids, labels = batch(2)
    first = None
    for _ in range(4):
        loss = model.loss(ids, labels)
        first = first if first is not None else float(loss.numpy())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(model.loss(ids, labels).numpy()) < first  # it trained
    out = save_pretrained(model, tmp_path / "tuned", dtype=dtype, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == dtype
    ours = model(ids).numpy()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(ids)).logits.numpy()
    loaded = load_pretrained(out, device=ndl.cpu(), dtype="float32")(ids).numpy()
    bound = 1e-4 if dtype == "float32" else 5e-2  # bf16: the weights rounded once
    assert rel_error(theirs, ours) < bound
    assert rel_error(loaded, theirs) < 1e-4  # both read the same file


def test_vision_language_checkpoint_saves_as_its_text_model(tmp_path):
    from tests.models.hf_models import build_gemma3_vision

    build_gemma3_vision(tmp_path / "vl", dtype="float32")
    model = CausalLM.from_pretrained(tmp_path / "vl", device=ndl.cpu())
    out = save_pretrained(model, tmp_path / "text", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    ids, _ = batch(3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        assert rel_error(model(ids).numpy(), hf(torch.as_tensor(ids)).logits.numpy()) < 1e-4


def test_saving_over_the_source_is_refused(checkpoints):
    directory, _ = checkpoints("llama")
    model = CausalLM.from_pretrained(directory, device=ndl.cpu())
    with pytest.raises(ArgumentError, match="loaded from"):
        save_pretrained(model, directory, progress=False)


def test_bad_inputs_are_clear_errors(checkpoints, tmp_path):
    directory, _ = checkpoints("llama")
    model = CausalLM.from_pretrained(directory, device=ndl.cpu())
    ids, labels = batch()
    with pytest.raises(ShapeError, match=r"\[0, 256\)"):
        model(ids + 300)
    with pytest.raises(ShapeError, match="integers"):
        model(ids.astype(np.float32))
    with pytest.raises(ShapeError, match="label -5 is neither"):
        model.loss(ids, np.where(labels == -100, -5, labels))
    with pytest.raises(ShapeError, match="do not match"):
        model.loss(ids, labels[:, :5])
    with pytest.raises(ArgumentError, match="no position carries a label"):
        model.loss(ids, np.full_like(labels, -100))
    with pytest.raises(ArgumentError, match="float32, float16, bfloat16"):
        CausalLM.from_pretrained(directory, device=ndl.cpu(), dtype="int8")
    with pytest.raises(ArgumentError, match="not a model directory"):
        CausalLM.from_pretrained(tmp_path / "missing")
    quantize_checkpoint(directory, tmp_path / "q", 8, None, progress=False)
    with pytest.raises(ArgumentError, match="quantized"):
        CausalLM.from_pretrained(tmp_path / "q")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "config.json").write_bytes((directory / "config.json").read_bytes())
    data = (directory / "model.safetensors").read_bytes()
    (tmp_path / "cut" / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelFormatError, match="truncated"):
        CausalLM.from_pretrained(tmp_path / "cut")
