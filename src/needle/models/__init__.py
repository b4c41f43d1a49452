"""Decoder-only language models from Hugging Face checkpoints: Llama 2/3/3.1/3.2, Mistral,
Qwen2/2.5, Qwen3, Gemma 2 and Phi-3 (``architectures.py``).

>>> from needle.models import load_pretrained
>>> model = load_pretrained("path/to/model", dtype="bfloat16")
>>> ids = model.tokenizer.encode("The capital of France is")
>>> print(model.tokenizer.decode(model.generate(ids, max_new_tokens=20)))
"""

from .architectures import ARCHITECTURES, Architecture
from .cache import KVCache
from .causal_lm import CausalLM, LlamaForCausalLM
from .config import LlamaConfig, ModelConfig, RopeConfig
from .generate import GenerationStats
from .generation_config import GenerationConfig
from .loader import load_pretrained
from .memory import MemoryEstimate
from .sampling import Sampler, SamplingParams
from .tokenizer import Tokenizer

__all__ = ["ARCHITECTURES", "Architecture", "CausalLM", "GenerationConfig", "GenerationStats",
           "KVCache", "LlamaConfig", "LlamaForCausalLM", "MemoryEstimate", "ModelConfig",
           "RopeConfig", "Sampler", "SamplingParams", "Tokenizer", "load_pretrained"]
