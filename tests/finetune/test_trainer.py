"""``needle finetune`` end to end on a tiny chat model (transformers' save_pretrained, a BPE
tokenizer trained here, a ChatML template): the model learns answers it did not give, and
says them through ``needle generate --adapter`` / ``load_pretrained``; the outputs load in
PEFT and transformers; a run saves as it goes and when interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
import transformers

import needle as ndl
from needle.cli import main as needle
from needle.errors import ArgumentError
from needle.finetune import FinetuneSettings, finetune
from needle.models import load_pretrained

PAIRS = [("ping", "pong pong"), ("colour of the sky?", "blue, mostly"),
         ("two and two", "four"), ("say hi", "hello there")]


def write_chat_data(path, repeat: int = 1) -> None:
    with open(path, "w") as f:
        for _ in range(repeat):
            for question, answer in PAIRS:
                f.write(json.dumps({"messages": [
                    {"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer}]}) + "\n")


def answer(model, question: str) -> str:
    tok = model.tokenizer
    ids = tok.apply_chat_template([{"role": "system", "content": "Answer briefly."},
                                   {"role": "user", "content": question}],
                                  add_generation_prompt=True, return_dict=False)
    out = model.generate(ids, max_new_tokens=12, temperature=0)
    return tok.decode(out)


def test_lora_run_learns_the_answers(chat_model, tmp_path, capsys):
    directory, _ = chat_model
    data = tmp_path / "chat.jsonl"
    write_chat_data(data)
    base = load_pretrained(directory, device=ndl.cpu(), dtype="float32")
    assert all(answer(base, q) != a for q, a in PAIRS)  # nothing known before
    out = tmp_path / "adapter"
    assert needle(["finetune", str(directory), str(data), str(out), "--lora-rank", "16",
                   "--epochs", "60", "--lr", "1e-2", "--device", "cpu", "--quiet"]) == 0
    assert "loss" in capsys.readouterr().err
    log = json.loads((out / "finetune.json").read_text())
    assert log["finished"] and log["steps"] == 60
    assert log["losses"][-1] < 0.1 * log["losses"][0]
    tuned = load_pretrained(directory, device=ndl.cpu(), dtype="float32", adapter=out)
    assert [answer(tuned, q) for q, _ in PAIRS] == [a for _, a in PAIRS]
    # the command line says it too
    capsys.readouterr()
    assert needle(["generate", str(directory), "--adapter", str(out), "--chat", "--system",
                   "Answer briefly.", "--prompt", "ping", "--temperature", "0",
                   "--max-tokens", "16", "--device", "cpu"]) == 0
    assert "pong pong" in capsys.readouterr().out
    # and PEFT, on transformers' model, agrees with needle's merged one
    from peft import PeftModel

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager")
    peft = PeftModel.from_pretrained(hf, out).eval()
    ids = np.array([tuned.tokenizer.encode("ping pong colour")])
    with torch.no_grad():
        expected = peft(torch.as_tensor(ids)).logits.numpy()
    assert np.abs(tuned(ids).numpy() - expected).max() < 1e-4 * np.abs(expected).max()


def test_full_run_writes_a_checkpoint_transformers_reads(chat_model, tmp_path):
    directory, _ = chat_model
    data = tmp_path / "chat.jsonl"
    write_chat_data(data)
    out = tmp_path / "tuned"
    held_out = tmp_path / "held_out.json"  # a JSON list, in the prompt/completion form
    held_out.write_text(json.dumps([{"prompt": "ping", "completion": "pong pong"}]))
    result = finetune(directory, data, out, FinetuneSettings(epochs=30, lr=3e-3),
                      device="cpu", progress=False, eval_data=held_out)
    assert result.steps == 30 and result.losses[-1] < 0.2 * result.losses[0]
    # measured before training and after each epoch, and logged
    assert len(result.eval_losses) == 31 and result.eval_losses[-1] < result.eval_losses[0]
    log = json.loads((out / "finetune.json").read_text())
    assert [e["epoch"] for e in log["eval"]] == list(range(31))
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    tuned = load_pretrained(out, device=ndl.cpu(), dtype="float32")
    assert answer(tuned, "ping") == "pong pong"
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    ids = np.array([tuned.tokenizer.encode("two and two")])
    with torch.no_grad():
        expected = hf(torch.as_tensor(ids)).logits.numpy()
    assert np.abs(tuned(ids).numpy() - expected).max() < 1e-4 * np.abs(expected).max()


def test_merged_lora_and_every_device(chat_model, tmp_path, device):
    """A LoRA run on each device (bf16 products and frozen bf16 weights on CUDA) lowers the
    loss; where the device records work (CUDA graphs, Metal) the step is recorded and
    replayed, never falling back to eager; --merge writes a checkpoint."""
    directory, _ = chat_model
    data = tmp_path / "chat.jsonl"
    write_chat_data(data)
    settings = FinetuneSettings(epochs=20, lr=1e-2, lora_rank=8, merge=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = finetune(directory, data, tmp_path / "merged", settings, device=device,
                          progress=False)
    if hasattr(device.backend, "capture"):
        assert not [w for w in caught if issubclass(w.category, ndl.CompileFallbackWarning)]
    assert result.losses[-1] < 0.5 * result.losses[0]
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = load_pretrained(tmp_path / "merged", device=ndl.cpu(), dtype="float32")
    assert merged(np.array([[1, 2, 3]])).numpy().shape == (1, 3, 302)


def test_saves_as_it_goes_and_when_interrupted(chat_model, tmp_path):
    directory, _ = chat_model
    data = tmp_path / "chat.jsonl"
    write_chat_data(data, repeat=4)
    out = tmp_path / "run"
    finetune(directory, data, out, FinetuneSettings(epochs=1, batch_size=2, lora_rank=2,
                                                    save_every=3), device="cpu",
             progress=False)
    assert json.loads((out / "finetune.json").read_text())["steps"] == 8
    # a long run stopped with Ctrl-C (SIGINT) leaves the adapter as it stood, loadable
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "needle.cli", "finetune", str(directory),
                             str(data), str(stopped), "--lora-rank", "2", "--epochs", "10000",
                             "--batch-size", "2", "--save-every", "1", "--device", "cpu",
                             "--quiet"], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (stopped / "adapter_config.json").exists() and proc.poll() is None:
            assert time.time() < deadline, "the run never started"
            time.sleep(0.2)
        time.sleep(1.0)  # a few more steps
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "interrupted after" in err
    log = json.loads((stopped / "finetune.json").read_text())
    assert not log["finished"] and log["steps"] >= 1
    load_pretrained(directory, device=ndl.cpu(), adapter=stopped)


def test_settings_are_checked():
    with pytest.raises(ArgumentError, match="merge applies to a LoRA run"):
        FinetuneSettings(merge=True)
    with pytest.raises(ArgumentError, match="warmup_ratio"):
        FinetuneSettings(warmup_ratio=1.0)
    with pytest.raises(ArgumentError):
        FinetuneSettings(epochs=0)


def _stop_at(step: int):
    def on_step(done: int, loss: float) -> None:
        if done == step:
            raise KeyboardInterrupt  # what Ctrl-C raises between two steps
    return on_step


@pytest.mark.parametrize("lora", [True, False])
def test_resumed_run_ends_where_an_uninterrupted_one_ends(chat_model, tmp_path, lora):
    """Stopped after 5 of 12 steps and resumed, a run writes the same weights, losses and
    held-out losses as one that never stopped (the CPUs: the same bits)."""
    directory, _ = chat_model
    data, held_out = tmp_path / "chat.jsonl", tmp_path / "held_out.jsonl"
    write_chat_data(data, repeat=2)
    held_out.write_text(json.dumps({"prompt": "ping", "completion": "pong pong"}) + "\n")
    settings = FinetuneSettings(epochs=3, batch_size=2, lr=1e-2,
                                lora_rank=4 if lora else None)
    whole = finetune(directory, data, tmp_path / "whole", settings, device="cpu",
                     progress=False, eval_data=held_out)
    parts = tmp_path / "parts"
    with pytest.raises(KeyboardInterrupt):
        finetune(directory, data, parts, settings, device="cpu", progress=False,
                 eval_data=held_out, on_step=_stop_at(5))
    log = json.loads((parts / "finetune.json").read_text())
    assert log["steps"] == 5 and not log["finished"]
    assert (parts / "trainer_state.safetensors").is_file()
    with pytest.raises(ArgumentError, match="unfinished run"):  # not overwritten by mistake
        finetune(directory, data, parts, settings, device="cpu", progress=False)
    resumed = finetune(directory, data, parts, settings, device="cpu", progress=False,
                       eval_data=held_out, resume=True)
    assert resumed.steps == whole.steps == 12
    assert resumed.losses == whole.losses and resumed.eval_losses == whole.eval_losses
    assert not (parts / "trainer_state.safetensors").exists()  # finished: no state kept
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    assert (parts / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()


@pytest.mark.parametrize("lora", [True, False])
def test_gradient_checkpointing_trains_the_same_weights(chat_model, tmp_path, lora):
    """--gradient-checkpointing recomputes each layer in the backward pass: the same losses
    and the same weights file, bit for bit on the CPUs (LoRA with dropout too: its masks
    are drawn again from the same generator state)."""
    directory, _ = chat_model
    data = tmp_path / "chat.jsonl"
    write_chat_data(data)
    options = dict(epochs=2, batch_size=2, lr=1e-2, lora_rank=4 if lora else None,
                   lora_dropout=0.1 if lora else 0.0)
    plain = finetune(directory, data, tmp_path / "plain", FinetuneSettings(**options),
                     device="cpu", progress=False)
    args = [str(directory), str(data), str(tmp_path / "ckpt"), "--epochs", "2",
            "--batch-size", "2", "--lr", "1e-2", "--device", "cpu", "--quiet",
            "--gradient-checkpointing"]
    if lora:
        args += ["--lora-rank", "4", "--lora-dropout", "0.1"]
    assert needle(["finetune", *args]) == 0
    log = json.loads((tmp_path / "ckpt" / "finetune.json").read_text())
    assert log["settings"]["gradient_checkpointing"] is True
    assert log["losses"] == plain.losses
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    assert (tmp_path / "ckpt" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()


def test_gradient_accumulation_learns_what_one_larger_batch_learns(chat_model, tmp_path):
    """Two batches of 2 accumulated before each update learn what one batch of 4 learns:
    the same losses and weights (float rounding apart; AdamW magnifies it where a gradient
    is near zero); the CLI's flag reaches the run."""
    from safetensors.numpy import load_file

    directory, _ = chat_model
    data = tmp_path / "chat.jsonl"
    write_chat_data(data, repeat=2)  # 8 examples: 2 steps an epoch either way
    common = dict(epochs=2, lr=1e-2, lora_rank=4)
    big = finetune(directory, data, tmp_path / "big", FinetuneSettings(**common, batch_size=4),
                   device="cpu", progress=False)
    accum = finetune(directory, data, tmp_path / "accum",
                     FinetuneSettings(**common, batch_size=2, gradient_accumulation_steps=2),
                     device="cpu", progress=False)
    assert accum.steps == big.steps == 4 and accum.tokens == big.tokens
    # a step's loss is the mean over all 4 examples' labels, not a sum of two means
    np.testing.assert_allclose(accum.losses, big.losses, rtol=1e-5)
    weights = [load_file(tmp_path / name / "adapter_model.safetensors")
               for name in ("big", "accum")]
    assert weights[0].keys() == weights[1].keys()
    for key, want in weights[0].items():
        np.testing.assert_allclose(weights[1][key], want, rtol=1e-4,
                                   atol=1e-3 * np.abs(want).max())
    args = [str(directory), str(data), str(tmp_path / "cli"), "--batch-size", "2",
            "--gradient-accumulation-steps", "3", "--lora-rank", "4", "--device", "cpu",
            "--quiet"]
    assert needle(["finetune", *args]) == 0
    log = json.loads((tmp_path / "cli" / "finetune.json").read_text())
    assert log["settings"]["gradient_accumulation_steps"] == 3
    assert log["steps"] == 2  # 4 batches of 2: a step of 3, then one of the last batch


RECORDING = [d for d in ndl.backend_ndarray.all_devices() if d.kind in ("cuda", "metal")]


@pytest.mark.parametrize("gpu", RECORDING, ids=[d.name for d in RECORDING])
def test_accumulating_step_is_recorded_and_replayed(chat_model, tmp_path, gpu):
    """Where steps are recorded (CUDA graphs, Metal), a step of several batches records
    once per shape and replays without falling back to eager: its losses are the eager
    run's. On CUDA the products are bfloat16 (autocast) and a recorded step's batches are
    padded to a multiple of 64 positions (eager ones are not), so products of other shapes
    round otherwise: 1.8e-4 apart before the first update, 1.8e-3 after five (H200)."""
    if not gpu.enabled():
        pytest.skip(f"{gpu.name} disabled: {gpu.reason}")
    directory, _ = chat_model
    data = tmp_path / "chat.jsonl"
    write_chat_data(data, repeat=2)
    options = dict(epochs=3, lr=1e-2, lora_rank=4, batch_size=2, gradient_accumulation_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorded = finetune(directory, data, tmp_path / "recorded",
                            FinetuneSettings(**options), device=gpu, progress=False)
    assert not [w for w in caught if issubclass(w.category, ndl.CompileFallbackWarning)]
    eager = finetune(directory, data, tmp_path / "eager",
                     FinetuneSettings(**options, compile=False), device=gpu, progress=False)
    assert recorded.steps == eager.steps == 6
    bf16 = gpu.kind == "cuda"
    np.testing.assert_allclose(recorded.losses[0], eager.losses[0], rtol=1e-3 if bf16 else 1e-4)
    np.testing.assert_allclose(recorded.losses, eager.losses, rtol=1e-2 if bf16 else 1e-4)


def test_resume_refuses_another_run(chat_model, tmp_path):
    directory, _ = chat_model
    data = tmp_path / "chat.jsonl"
    write_chat_data(data, repeat=2)
    settings = FinetuneSettings(epochs=2, batch_size=2, lora_rank=2)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        finetune(directory, data, out, settings, device="cpu", progress=False,
                 on_step=_stop_at(2))
    with pytest.raises(ArgumentError, match="lr: 0.0002, now 0.001"):
        finetune(directory, data, out, FinetuneSettings(epochs=2, batch_size=2, lora_rank=2,
                                                        lr=1e-3),
                 device="cpu", progress=False, resume=True)
    other = tmp_path / "other.jsonl"
    write_chat_data(other, repeat=3)
    with pytest.raises(ArgumentError, match="data file differs"):
        finetune(directory, other, out, settings, device="cpu", progress=False, resume=True)
    finetune(directory, data, out, settings, device="cpu", progress=False, resume=True)
    with pytest.raises(ArgumentError, match="finished"):
        finetune(directory, data, out, settings, device="cpu", progress=False, resume=True)
    with pytest.raises(ArgumentError, match="nothing to resume"):
        finetune(directory, data, tmp_path / "empty", settings, device="cpu", progress=False,
                 resume=True)
