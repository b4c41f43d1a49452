"""Llama-family language models (Llama 2/3, Mistral, Qwen2) from Hugging Face checkpoints.

>>> from needle.models import load_pretrained
>>> model = load_pretrained("path/to/model", dtype="bfloat16")
>>> ids = model.tokenizer.encode("The capital of France is")
>>> print(model.tokenizer.decode(model.generate(ids, max_new_tokens=20)))
"""

from .config import LlamaConfig, RopeConfig
from .generate import GenerationStats, Sampler
from .llama import KVCache, LlamaForCausalLM
from .loader import load_pretrained
from .memory import MemoryEstimate
from .tokenizer import Tokenizer

__all__ = ["GenerationStats", "KVCache", "LlamaConfig", "LlamaForCausalLM", "MemoryEstimate",
           "RopeConfig", "Sampler", "Tokenizer", "load_pretrained"]
