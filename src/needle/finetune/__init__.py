"""Fine-tuning Hugging Face checkpoints with needle's autograd: every weight, or LoRA adapters.

``CausalLM.from_pretrained(dir)`` is the checkpoint as a trainable Module (``model.py``);
``add_lora`` / ``save_adapter`` / ``load_adapter`` / ``merge_lora`` handle adapters in PEFT's
format (``lora.py``); ``save_pretrained`` writes a checkpoint transformers and
``load_pretrained`` read (``save.py``); ``finetune`` (and ``needle finetune``) runs the whole
loop on a JSONL / JSON data file (``trainer.py``, ``data.py``). docs/finetuning.md.
"""

from ..models.lora_format import LoraConfig
from .data import IGNORE, Example, batches, read_examples
from .lora import adapters, add_lora, load_adapter, merge_lora, save_adapter
from .model import CausalLM
from .save import save_pretrained
from .trainer import FinetuneResult, FinetuneSettings, finetune

__all__ = ["IGNORE", "CausalLM", "Example", "FinetuneResult", "FinetuneSettings", "LoraConfig",
           "adapters", "add_lora", "batches", "finetune", "load_adapter", "merge_lora",
           "read_examples", "save_adapter", "save_pretrained"]
