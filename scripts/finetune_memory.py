"""Peak device memory of one LoRA training step (forward, loss, backward) beyond the
model's weights, with each adapted projection as one graph node (``lora_projection``) and
composed from ops, and with activation checkpointing:

    python scripts/finetune_memory.py cuda
    PYTHONPATH=. python scripts/finetune_memory.py metal-emulated   # the Metal emulator

A Llama of hidden size 128 (4 x 128 tokens, rank 8 on every projection) written by
transformers' ``save_pretrained``; the peak is the device allocator's."""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

import numpy as np


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    if name == "metal-emulated":
        import tests.metal_emulator as emulator

        emulator.install()
        name = "metal"
    from tests.models.hf_models import build

    import needle as ndl
    import needle.finetune.model as model_module
    from needle.finetune import CausalLM, LoraConfig, add_lora

    dev = ndl.backend_ndarray.device_from_name(name)
    allocator = dev.backend.allocator
    ids = np.random.default_rng(0).integers(3, 256, (4, 128))
    real = model_module.lora_projection
    with tempfile.TemporaryDirectory() as d:
        build("llama", Path(d), hidden_size=128, intermediate_size=384, num_attention_heads=4,
              num_key_value_heads=2)
        for label, fused, checkpointing in (("one node", True, False),
                                            ("composed", False, False),
                                            ("one node + checkpointing", True, True)):
            model_module.lora_projection = real if fused else (lambda *args: None)
            model = CausalLM.from_pretrained(d, device=dev)
            add_lora(model, LoraConfig(r=8, alpha=16))
            if checkpointing:
                model.gradient_checkpointing_enable()
            gc.collect()
            dev.synchronize()
            allocator.reset_peak()
            base = allocator.stats().in_use
            model.loss(ids, ids).backward()
            dev.synchronize()
            print(f"{label:<26} {(allocator.stats().peak - base) / 2**20:7.1f} MiB")
            del model
    model_module.lora_projection = real


if __name__ == "__main__":
    main()
