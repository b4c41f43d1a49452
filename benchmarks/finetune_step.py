"""A fine-tuning step of needle against PyTorch + PEFT in the same run.

    python -m benchmarks.finetune_step --device cuda               # TinyLlama-1.1B shapes
    python -m benchmarks.finetune_step --device cuda --head-dim 128   # 16 heads of 128
    python -m benchmarks.finetune_step --device cuda --gradient-checkpointing
    python -m benchmarks.finetune_step --device cpu --quick        # a tiny model: a smoke test

A Llama checkpoint of random weights is made by transformers and saved with
``save_pretrained`` in bf16 (what the Hub holds). Each framework then trains on the same
batches of random tokens (batch x seq, every next token labelled):

* **LoRA** (rank 16 on every projection of the layers, frozen weights in bf16, adapters in
  float32, products in bf16 under autocast): needle's ``finetune.CausalLM`` + ``add_lora``
  and AdamW; PyTorch's ``LlamaForCausalLM`` (sdpa attention) + PEFT's ``get_peft_model`` and
  ``torch.optim.AdamW``, under ``torch.autocast``.
* **full** (every weight in float32 with AdamW, products in bf16 under autocast), on
  ``--full-layers`` layers of the same widths (default all 22: ~18 GB of weights,
  gradients and optimizer state; fewer on a smaller GPU).

A step is forward, loss, backward, optimizer step; the time is the median over the timed
steps after warm-up ones, synchronized on the device. needle's step is ``needle
finetune``'s (``trainer.make_step``): recorded once and replayed (``ndl.compile``) on a GPU;
the eager step is timed beside it (``NEEDLE_FUSION=1``: the compiled step with its
elementwise chains fused, faster, at the recording's memory cost). Printed: ms a step,
tokens a second, needle's time over PyTorch's (eager, as PEFT users run it), and the peak
device memory in use (needle's allocator; torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                 num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                 max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0)
SHAPES_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=256, rms_norm_eps=1e-5)


def make_checkpoint(directory: Path, shapes: dict) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shapes, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)


def _collect() -> None:
    """Free the previous run's model before the next measures its peak."""
    import gc

    gc.collect()


def _median_ms(step, sync, warmup: int, steps: int) -> float:
    times = []
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        step(i)
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def needle_step_ms(directory: Path, batches, lora: bool, device: str, warmup: int,
                   steps: int, compiled: bool,
                   checkpointing: bool = False) -> tuple[float, float, float]:
    """(median ms a step, last loss, peak GiB in use) of ``needle finetune``'s step
    (``make_step``)."""
    import needle as ndl
    from needle import backend_ndarray as nd
    from needle.finetune import CausalLM, LoraConfig, add_lora
    from needle.finetune.model import next_token_targets
    from needle.finetune.trainer import make_step

    dev = nd.device_from_name(device)
    allocator = getattr(dev.backend, "allocator", None)  # GPUs: peak bytes in use
    _collect()
    if allocator is not None:
        dev.backend.empty_cache()
        allocator.reset_peak()
    mixed = dev.name.startswith("cuda")
    dtype = "bfloat16" if lora and mixed else "float32"
    model = CausalLM.from_pretrained(directory, device=dev, dtype=dtype)
    if lora:
        add_lora(model, LoraConfig(r=16, alpha=32))
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = ndl.optim.AdamW(model.trainable_parameters(), lr=1e-4, weight_decay=0.0)
    train = make_step(model, opt, None, 0.0, mixed, compiled,
                      fuse=os.environ.get("NEEDLE_FUSION") == "1")
    last = [0.0]

    def step(i):
        ids = batches[i % len(batches)]
        last[0] = float(train(model.ids_tensor(ids), *next_token_targets(ids, dev)).numpy())

    ms = _median_ms(step, dev.synchronize, warmup, steps)
    peak = allocator.stats().peak / 2**30 if allocator is not None else float("nan")
    loss = last[0]
    return ms, loss, peak


def torch_step_ms(directory: Path, batches, lora: bool, device: str, warmup: int,
                  steps: int, checkpointing: bool = False) -> tuple[float, float, float]:
    """(median ms a step, last loss, peak GiB allocated)."""
    import torch
    import transformers

    dev = torch.device("cuda" if device.startswith("cuda") else "cpu")
    mixed = dev.type == "cuda"
    _collect()
    if mixed:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    dtype = torch.bfloat16 if lora and mixed else torch.float32
    model = transformers.LlamaForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation="sdpa").to(dev)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    if checkpointing:  # transformers' own, non-reentrant (what TRL and PEFT guides use)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            model.enable_input_require_grads()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            weight_decay=0.0)
    last = [0.0]

    def step(i):
        ids = torch.as_tensor(batches[i % len(batches)], device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=mixed):
            loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        last[0] = float(loss.detach())

    sync = torch.cuda.synchronize if mixed else (lambda: None)
    ms = _median_ms(step, sync, warmup, steps)
    peak = torch.cuda.max_memory_allocated() / 2**30 if mixed else float("nan")
    loss = last[0]
    return ms, loss, peak


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="a tiny model (a smoke test)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--full-layers", type=int, default=22,
                   help="layers of the model the full fine-tune trains (1.1B widths)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--only", choices=("lora", "full"), default=None)
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="both frameworks recompute each layer in the backward pass")
    p.add_argument("--head-dim", type=int, choices=(64, 128), default=64,
                   help="128: 16 query heads over 4 KV heads at the same widths (the head size "
                        "of Llama-3.2-3B, Qwen3, Mistral)")
    args = p.parse_args(argv)
    shapes = dict(SHAPES_TINY if args.quick else SHAPES_1B)
    if args.head_dim == 128 and not args.quick:
        shapes.update(num_attention_heads=16, num_key_value_heads=4)
    seq = min(args.seq, shapes["max_position_embeddings"])
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, shapes["vocab_size"], (args.batch, seq)) for _ in range(4)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("lora", "full"):
            if args.only and mode != args.only:
                continue
            model_shapes = dict(shapes)
            if mode == "full" and not args.quick:
                model_shapes["num_hidden_layers"] = args.full_layers
            directory = Path(tmp) / mode
            make_checkpoint(directory, model_shapes)
            lora = mode == "lora"
            ckpt = args.gradient_checkpointing
            eager, _, eager_peak = needle_step_ms(directory, batches, lora, args.device,
                                                  args.warmup, args.steps, compiled=False,
                                                  checkpointing=ckpt)
            ours, our_loss, our_peak = needle_step_ms(directory, batches, lora, args.device,
                                                      args.warmup, args.steps,
                                                      compiled=not args.quick,
                                                      checkpointing=ckpt)
            theirs, their_loss, their_peak = torch_step_ms(directory, batches, lora,
                                                           args.device, args.warmup,
                                                           args.steps, checkpointing=ckpt)
            rows.append((mode, model_shapes["num_hidden_layers"], eager, ours, theirs,
                         our_loss, their_loss, eager_peak, our_peak, their_peak))
    tokens = args.batch * seq
    print(f"\nfine-tuning step, batch {args.batch} x {seq} tokens, {args.device} "
          f"({'tiny' if args.quick else '1.1B widths'}, head size "
          f"{shapes['hidden_size'] // shapes['num_attention_heads']}"
          f"{', gradient checkpointing' if args.gradient_checkpointing else ''})")
    print(f"{'mode':<6} {'layers':>6} {'eager ms':>9} {'needle ms':>10} {'torch ms':>9} "
          f"{'needle tok/s':>13} {'torch tok/s':>12} {'needle/torch time':>18} "
          f"{'loss n / t':>16}  {'peak GiB eager / needle / torch':>31}")
    for mode, layers, eager, ours, theirs, ol, tl, ep, op, tp in rows:
        print(f"{mode:<6} {layers:>6} {eager:>9.1f} {ours:>10.1f} {theirs:>9.1f} "
              f"{tokens / ours * 1e3:>13.0f} {tokens / theirs * 1e3:>12.0f} "
              f"{ours / theirs:>17.2f}x {ol:>7.3f} / {tl:<7.3f}  "
              f"{ep:>9.1f} / {op:>6.1f} / {tp:>5.1f}")


if __name__ == "__main__":
    main()
