"""Fine-tuning Hugging Face checkpoints with needle's autograd: every weight, or LoRA adapters.

    from needle.finetune import CausalLM, add_lora, save_adapter, finetune

``CausalLM.from_pretrained(dir)`` is the checkpoint as a trainable Module (``model.py``);
``add_lora`` / ``save_adapter`` / ``load_adapter`` / ``merge_lora`` handle adapters in PEFT's
format (``lora.py``); ``save_pretrained`` writes a checkpoint transformers and
``load_pretrained`` read (``save.py``); ``finetune`` (and ``needle finetune``) runs the whole
loop on a JSONL / JSON data file (``trainer.py``, ``data.py``). docs/finetuning.md.

Imports are lazy so that ``import needle.finetune.data`` alone stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CausalLM": "model", "IGNORE": "model", "add_lora": "lora", "adapters": "lora",
    "load_adapter": "lora", "merge_lora": "lora", "save_adapter": "lora",
    "save_pretrained": "save", "finetune": "trainer", "FinetuneSettings": "trainer",
    "FinetuneResult": "trainer", "read_examples": "data", "batches": "data",
}
__all__ = [*_EXPORTS, "LoraConfig"]


def __getattr__(name: str):
    if name == "LoraConfig":
        from ..models.lora_format import LoraConfig

        return LoraConfig
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'needle.finetune' has no attribute {name!r}")
