"""LoRA adapters against PEFT: adapters trained here load in PEFT with the same logits, and
adapters PEFT writes (random B, rank and alpha patterns, rsLoRA, a layer subset) load here,
attached for training or merged at load by load_pretrained; what PEFT can express and needle
does not compute is refused by name."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import needle as ndl
from needle.errors import ArgumentError, ModelFormatError
from needle.finetune import (
    CausalLM,
    LoraConfig,
    adapters,
    add_lora,
    load_adapter,
    merge_lora,
    save_adapter,
)
from needle.models import load_pretrained

from .test_model import batch, rel_error


def peft_logits(hf, adapter_dir, ids) -> np.ndarray:
    from peft import PeftModel

    # a copy: PEFT freezes the model it wraps, and the session's reference is shared
    wrapped = PeftModel.from_pretrained(copy.deepcopy(hf), adapter_dir).eval()
    with torch.no_grad():
        return wrapped(torch.as_tensor(ids)).logits.numpy()


def train(model: CausalLM, steps: int = 3, lr: float = 1e-2) -> float:
    opt = ndl.optim.AdamW(model.trainable_parameters(), lr=lr)
    ids, labels = batch(5)
    for _ in range(steps):
        loss = model.loss(ids, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(model.loss(ids, labels).numpy())


@pytest.mark.parametrize("name", ["llama", "phi3", "qwen3", "gemma2"])
def test_adapter_trained_here_loads_in_peft(checkpoints, device, name, tmp_path):
    directory, hf = checkpoints(name)
    model = CausalLM.from_pretrained(directory, device=device)
    ids, labels = batch(4)
    before = model(ids).numpy()
    targets = add_lora(model, LoraConfig(r=4, alpha=8))
    assert np.array_equal(model(ids).numpy(), before)  # B = 0: an untrained adapter is a no-op
    assert all(".lora." in n for n, p in model.named_parameters() if p.requires_grad)
    start = float(model.loss(ids, labels).numpy())
    assert train(model) < start
    frozen = [p for n, p in model.named_parameters() if ".lora." not in n]
    assert all(p.grad is None for p in frozen)  # the weights were never differentiated
    save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert len(targets) == len(adapters(model))
    assert rel_error(model(ids).numpy(), peft_logits(hf, tmp_path, ids)) < 1e-4


def write_peft_adapter(hf, directory, **options) -> None:
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model

    torch.manual_seed(7)
    config = PeftConfig(task_type="CAUSAL_LM", init_lora_weights=False, **options)
    get_peft_model(copy.deepcopy(hf), config).save_pretrained(directory)


PEFT_OPTIONS = {
    "plain": dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    "patterns_rslora": dict(r=4, lora_alpha=8, target_modules="all-linear", use_rslora=True,
                            rank_pattern={"o_proj": 2}, alpha_pattern={"up_proj": 3}),
    "one_layer": dict(r=2, lora_alpha=4, layers_to_transform=[1],
                      target_modules=["k_proj", "gate_proj"]),
    "regex": dict(r=2, lora_alpha=4, target_modules=r".*\.1\.(self_attn|mlp)\.(k|up)_proj"),
}


@pytest.mark.parametrize("options", PEFT_OPTIONS)
def test_peft_adapter_loads_and_merges(checkpoints, options, tmp_path):
    directory, hf = checkpoints("llama")
    write_peft_adapter(hf, tmp_path, **PEFT_OPTIONS[options])
    ids, _ = batch(6)
    expected = peft_logits(hf, tmp_path, ids)
    model = CausalLM.from_pretrained(directory, device=ndl.cpu())
    load_adapter(model, tmp_path)
    assert rel_error(model(ids).numpy(), expected) < 1e-4
    merged = load_pretrained(directory, device=ndl.cpu(), dtype="float32", adapter=tmp_path)
    assert rel_error(merged(ids).numpy(), expected) < 1e-4
    merge_lora(model)  # folded into the weights: the same function, no adapters left
    assert not adapters(model)
    assert rel_error(model(ids).numpy(), expected) < 1e-4


def test_bf16_weights_with_float32_adapter(checkpoints):
    """Frozen bf16 weights (what a LoRA run keeps on a GPU) with float32 adapters run with
    and without autocast, near the float32 model."""
    directory, _ = checkpoints("qwen2")
    ids, labels = batch(8)
    reference = CausalLM.from_pretrained(directory, device=ndl.cpu())
    low = CausalLM.from_pretrained(directory, device=ndl.cpu(), dtype="bfloat16")
    add_lora(low, LoraConfig(r=2))
    expected = float(reference.loss(ids, labels).numpy())
    assert abs(float(low.loss(ids, labels).numpy()) - expected) < 3e-2 * expected
    with ndl.autocast("bfloat16"):
        loss = low.loss(ids, labels)
    loss.backward()
    assert all(p.grad is not None for p in low.trainable_parameters())


def test_adapter_errors(checkpoints, tmp_path):
    directory, hf = checkpoints("llama")
    model = CausalLM.from_pretrained(directory, device=ndl.cpu())
    with pytest.raises(ArgumentError, match="match no projection"):
        add_lora(model, LoraConfig(target_modules=["c_attn"]))
    with pytest.raises(ArgumentError, match="no LoRA adapters to save"):
        save_adapter(model, tmp_path / "none")
    add_lora(model, LoraConfig(r=2))
    with pytest.raises(ArgumentError, match="already has LoRA"):
        add_lora(model, LoraConfig(r=2))
    with pytest.raises(ArgumentError, match="rank r must be a positive int"):
        LoraConfig(r=0)
    with pytest.raises(ModelFormatError, match="adapter_config.json"):
        load_pretrained(directory, device=ndl.cpu(), adapter=tmp_path)
    # an adapter for a model of other sizes (qwen2 has one KV head, this llama two)
    other, other_hf = checkpoints("qwen2")
    write_peft_adapter(other_hf, tmp_path / "other", r=2, target_modules=["k_proj"])
    with pytest.raises(ModelFormatError, match="another model"):
        load_pretrained(directory, device=ndl.cpu(), adapter=tmp_path / "other")
    # PEFT options needle does not compute are refused by name
    write_peft_adapter(hf, tmp_path / "dora", r=2, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(ModelFormatError, match="use_dora"):
        load_pretrained(directory, device=ndl.cpu(), adapter=tmp_path / "dora")
    write_peft_adapter(hf, tmp_path / "bias", r=2, target_modules=["q_proj"], bias="all")
    with pytest.raises(ModelFormatError, match="bias"):
        load_pretrained(directory, device=ndl.cpu(), adapter=tmp_path / "bias")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "adapter_config.json").write_text(
        (tmp_path / "other" / "adapter_config.json").read_text())
    with pytest.raises(ModelFormatError, match="never pickled"):
        load_pretrained(directory, device=ndl.cpu(), adapter=tmp_path / "bin")


def _held_bytes(root) -> int:
    """Bytes of the distinct intermediate arrays the graph under ``root`` keeps for the
    backward pass (parameters and inputs not counted)."""
    seen, total, stack = set(), 0, [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op is not None and node.cached_data is not None:
            total += node.cached_data.nbytes
        stack.extend(node.inputs)
    return total


def _adapted_run(directory, device, fused: bool, monkeypatch, low: bool = False):
    """loss, every adapter's gradient and the bytes the graph holds, with the projections'
    adapters as one node (lora_projection) or composed."""
    import needle.finetune.model as model_module

    model = CausalLM.from_pretrained(directory, device=device,
                                     dtype="bfloat16" if low else "float32")
    ndl.manual_seed(0)  # the same A in both forms
    add_lora(model, LoraConfig(r=4, alpha=8))
    rng = np.random.default_rng(3)
    for lora in adapters(model).values():  # B random: the update is not zero
        lora.lora_B.data = ndl.Tensor(rng.standard_normal(lora.lora_B.shape).astype(
            np.float32) * 0.1, device=device, requires_grad=False)
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(model_module, "lora_projection", lambda *args: None)
        ids, labels = batch(9)
        with ndl.autocast("bfloat16", enabled=low):
            loss = model.loss(ids, labels)
        held = _held_bytes(loss)
        loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.requires_grad}
    return float(loss.numpy()), grads, held


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # qwen2: q, k and v have biases
def test_adapted_projections_are_one_graph_node(checkpoints, device, monkeypatch, name):
    """A projection with an adapter is one node (lora_projection.py): the composed form's
    loss and gradients, and the graph holds far fewer bytes for the backward pass (the base
    product, the update and the scaled update are not kept)."""
    directory, _ = checkpoints(name)
    loss, grads, held = _adapted_run(directory, device, True, monkeypatch)
    want_loss, want, want_held = _adapted_run(directory, device, False, monkeypatch)
    assert abs(loss - want_loss) < 1e-5 * want_loss
    assert grads.keys() == want.keys() and len(grads) == 2 * 7 * 2  # A, B; 7 a layer; 2 layers
    for name, g in grads.items():
        assert rel_error(g, want[name]) < 1e-4, name
    assert held < 0.8 * want_held, f"{held} bytes held, composed {want_held}"


def test_adapted_projections_under_autocast(checkpoints, monkeypatch):
    """Frozen bf16 weights, float32 adapters and bf16 products (a GPU LoRA run's setting, on
    the CPUs): the fused node gives the composed form's loss and gradients, bf16-close."""
    directory, _ = checkpoints("llama")
    loss, grads, held = _adapted_run(directory, ndl.cpu(), True, monkeypatch, low=True)
    want_loss, want, want_held = _adapted_run(directory, ndl.cpu(), False, monkeypatch,
                                              low=True)
    assert abs(loss - want_loss) < 1e-2 * want_loss
    for name, g in grads.items():
        assert rel_error(g, want[name]) < 3e-2, name
    assert held < 0.8 * want_held


def test_one_node_projection_gradients_of_every_input(device):
    """Every input of the one-node projection (x, weight, A, B, bias) takes the composed
    form's gradient, whichever of them a caller trains."""
    from needle import ops
    from needle.finetune.lora_projection import _LoraProjection

    rng = np.random.default_rng(4)

    def tensors():
        return [ndl.Tensor(rng.standard_normal(s).astype(np.float32), device=device)
                for s in ((2, 5, 8), (6, 8), (3, 8), (6, 3), (6,))]

    fused_in = tensors()
    composed_in = [ndl.Tensor(t.numpy(), device=device) for t in fused_in]
    w_out = ndl.Tensor(rng.standard_normal((2, 5, 6)).astype(np.float32), device=device,
                       requires_grad=False)
    (_LoraProjection(1.5)(*fused_in) * w_out).sum().backward()
    x, w, a, b, bias = composed_in
    y = (x @ ops.transpose(w) + bias) + ((x @ ops.transpose(a)) @ ops.transpose(b)) * 1.5
    (y * w_out).sum().backward()
    for got, want in zip(fused_in, composed_in):
        np.testing.assert_allclose(got.grad.numpy(), want.grad.numpy(), rtol=1e-5,
                                   atol=1e-5 * np.abs(want.grad.numpy()).max())
