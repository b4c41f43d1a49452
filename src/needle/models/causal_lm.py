"""``CausalLM``: a decoder-only language model of any supported family, ready to generate.

It holds what ``load_pretrained`` made — the config, the weights on the device, the rotary
tables, the tokenizer and the generation defaults — and offers the passes (``forward`` for
every position's logits, ``prefill`` and ``decode_step`` for generation) and generation
itself (``generate``, ``stream``; sampling and the loop live in ``generate.py``, the KV cache
and the captured decode step in ``decoder.py``).
"""

from __future__ import annotations

import numpy as np

from .. import backend_ndarray as nd
from ..autograd import Tensor
from ..backend_ndarray import NDArray
from ..errors import GenerationError, IndexOutOfRangeError, ShapeError
from .cache import DecodeState, KVCache, RotaryTables
from .config import ModelConfig
from .generation_config import GenerationConfig
from .transformer import Transformer
from .weights import WeightSource, load_weights


class CausalLM:
    """A language model: token ids in, next-token logits out.

    ``weights(name, shape)`` supplies each checkpoint tensor on the target device and dtype
    (``load_pretrained`` reads them from safetensors files). ``max_seq_len`` bounds prompt
    plus generated tokens; it sizes the rotary tables and the KV cache.
    """

    def __init__(self, cfg: ModelConfig, weights: WeightSource, max_seq_len: int, device,
                 dtype: str):
        self.config, self.max_seq_len, self.device, self.dtype = cfg, max_seq_len, device, dtype
        self.weights = load_weights(cfg, weights)
        self.rope = RotaryTables(cfg, max_seq_len, device, dtype)
        self.transformer = Transformer(cfg, self.weights, self.rope)
        self.tokenizer = None  # set by load_pretrained when the model ships a tokenizer
        self.generation_config = GenerationConfig(eos_token_ids=cfg.eos_token_ids)
        self.load_stats = None  # set by load_pretrained: bytes, seconds, GB/s
        self._decoder = None

    # --- passes ----------------------------------------------------------------------------
    def _ids(self, ids) -> NDArray:
        """Token ids as a (batch, seq) int32 array on the device, checked on the host."""
        return nd.array(self.host_ids(ids), device=self.device)

    def host_ids(self, ids) -> np.ndarray:
        """Token ids as a (batch, seq) int32 numpy array, checked: ints, a sequence within
        max_seq_len, every id in the vocabulary."""
        if isinstance(ids, Tensor):
            ids = ids.realize_cached_data()
        host = np.asarray(ids.numpy() if isinstance(ids, NDArray) else ids)
        if host.ndim == 1:
            host = host[None, :]
        if host.ndim != 2 or host.shape[1] == 0 or host.dtype.kind not in "iu":
            raise ShapeError(f"token ids must be a non-empty (batch, seq) array of ints, got "
                             f"shape {host.shape} of {host.dtype}")
        if host.shape[1] > self.max_seq_len:
            raise ShapeError(f"{host.shape[1]} tokens exceed max_seq_len {self.max_seq_len}; "
                             "load the model with a larger max_seq_len")
        if host.min() < 0 or host.max() >= self.config.vocab_size:
            bad = int(host.min() if host.min() < 0 else host.max())
            raise IndexOutOfRangeError(f"token id {bad} is outside the vocabulary "
                                       f"(0..{self.config.vocab_size - 1})")
        return host.astype(np.int32)

    def forward(self, ids) -> NDArray:
        """Logits (batch, seq, vocab) for token ids (batch, seq), each position seeing only
        the positions before it."""
        return self.transformer.forward(self._ids(ids))

    __call__ = forward

    def prefill(self, ids, cache: KVCache) -> NDArray:
        """Run the prompt ``ids`` (1, seq) from position 0, filling ``cache``; the logits of
        its last position, shape (1, vocab)."""
        return self.transformer.forward(self._ids(ids), cache, last_only=True)

    def decode_step(self, state: DecodeState, cache: KVCache) -> NDArray:
        """Logits (1, vocab) for ``state.token`` at ``state.position``, extending ``cache``."""
        return self.transformer.decode_step(state, cache)

    # --- generation ------------------------------------------------------------------------
    def decoder(self):
        """The model's Decoder (KV cache and, on GPUs, the captured decode step), made once
        and reused by every generation."""
        if self._decoder is None:
            from .decoder import Decoder

            self._decoder = Decoder(self)
        return self._decoder

    def generate(self, prompt_ids, max_new_tokens: int | None = None, temperature=None,
                 top_k=None, top_p=None, seed: int | None = None, stop=None, callback=None,
                 stats=None, min_p=None, repetition_penalty=None) -> list[int]:
        """New token ids after ``prompt_ids``; see ``needle.models.generate.generate``.
        Sampling settings left as None take the model's generation_config.json values.
        A list of prompts (each token ids or text) is decoded as one batch by the serving
        engine (``needle.serve.generate_batch``) and gives a list of token-id lists."""
        from .generate import generate

        if _is_batch(prompt_ids):
            from ..serve import generate_batch

            if callback is not None or stats is not None:
                raise GenerationError("callback and stats apply to one prompt; stream a "
                                      "batch with needle.serve.Engine instead")
            return generate_batch(self, prompt_ids, max_new_tokens, temperature, top_k,
                                  top_p, seed, stop, min_p, repetition_penalty)

        return generate(self, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed,
                        stop, callback, stats, min_p=min_p,
                        repetition_penalty=repetition_penalty)

    def stream(self, prompt_ids, max_new_tokens: int | None = None, temperature=None,
               top_k=None, top_p=None, seed: int | None = None, stop=None, stats=None,
               min_p=None, repetition_penalty=None):
        """An iterator over the new token ids, each yielded as soon as it is chosen."""
        from .generate import stream

        return stream(self, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, stop,
                      stats, min_p=min_p, repetition_penalty=repetition_penalty)


def _is_batch(prompts) -> bool:
    """A list or tuple of prompts (texts, or sequences of ids), not one prompt of ids."""
    return (isinstance(prompts, (list, tuple)) and len(prompts) > 0
            and all(isinstance(p, str) or (hasattr(p, "__len__") and not np.isscalar(p))
                    for p in prompts))


LlamaForCausalLM = CausalLM  # the name of earlier releases, when it ran Llama alone
