"""GGUF files (llama.cpp's format) of Llama, Qwen2, Qwen3 and Gemma 3 models, read with the
``gguf`` package.

``load_pretrained("model.gguf")`` comes here. Tensors are read by name and type:

* F32, F16, BF16: dense, converted to the model's dtype as safetensors weights are;
* Q8_0, Q4_0, Q4_K, Q5_K, Q6_K: repacked at load, exactly, into needle's int8/int4 formats
  (``needle.quant.gguf_repack``, docs/quantization.md) and run by the quantized kernels;
  a projection fused from parts of different types (q/k/v, gate/up) is rewritten exactly in
  one format that holds them all. Norm vectors in a block format are dequantized (tiny).
  The token embedding in a block format is dequantized to the model dtype (it is read one
  row per token); the output head stays packed.

The config comes from the ``{arch}.*`` metadata, the tokenizer from ``tokenizer.ggml.*``
(``gguf_tokenizer.py``), the chat template from ``tokenizer.chat_template``. Other types,
unknown architectures and truncated files are ``ModelFormatError`` naming tensor and type.

What llama.cpp's converter (convert_hf_to_gguf.py) changed is undone here: the rows of q and
k interleaved for the "llama" architecture's rotary layout (the others keep Hugging Face's
half-split one), and Gemma's norm weights stored as 1 + w. What GGUF does not record is
what llama.cpp assumes: Gemma 3's sliding layers rotate with base 10,000, five in six
layers slide (unless ``attention.sliding_window_pattern`` says otherwise), and queries are
scaled by head_dim ** -0.5 (hidden / heads for its 62-layer 27B model).
"""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import ModelFormatError
from ..quant.format import QuantSpec, dequantize
from ..quant.gguf_repack import REPACK, to_common
from .config import ModelConfig

DENSE = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
SUPPORTED = tuple(DENSE) + tuple(REPACK)
# general.architecture -> the Hugging Face class it is read as
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
PERMUTED = ("llama",)  # architectures whose q/k rows the converter interleaved
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's norms on both sides of each block: llama's ffn_norm is its pre-MLP norm there
_SANDWICH = {**_LAYER, "ffn_norm": "pre_feedforward_layernorm",
             "post_attention_norm": "post_attention_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# the needle format each block type becomes (a fused projection of mixed types may widen)
REPACKED_SPEC = {"Q8_0": QuantSpec(8, 32), "Q4_0": QuantSpec(4, 32),
                 "Q4_K": QuantSpec(4, 32, True), "Q5_K": QuantSpec(8, 32, True),
                 "Q6_K": QuantSpec(8, 16)}
FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         ("mlp.gate_proj", "mlp.up_proj"))


def is_gguf(path) -> bool:
    return Path(path).suffix.lower() == ".gguf" and Path(path).is_file()


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor name (None: not a weight needle reads)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    layer = _SANDWICH if arch == "gemma3" else _LAYER
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in layer:
        return f"model.layers.{m.group(1)}.{layer[m.group(2)]}.{m.group(3)}"
    return None


class GGUFFile:
    """The metadata and tensors of one GGUF file, by Hugging Face name."""

    def __init__(self, path: str | Path):
        try:
            from gguf import GGUFReader
        except ImportError:
            raise ModelFormatError("reading GGUF files needs the 'gguf' package: pip install "
                                   "gguf (or needle[gguf])") from None
        self.path = Path(path)
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # noqa: BLE001 -- gguf raises ValueError, struct.error, ...
            raise ModelFormatError(f"{self.path} is not a readable GGUF file (truncated or "
                                   f"damaged?): {type(e).__name__}: {e}") from None
        self.tensors = {}
        arch = self.architecture
        for t in self.reader.tensors:
            name = hf_name(t.name, arch)
            kind = t.tensor_type.name
            if name is None:
                continue
            if kind not in SUPPORTED:
                raise ModelFormatError(f"{self.path}: tensor {t.name!r} has GGUF type {kind}, "
                                       f"which needle does not read (it reads "
                                       f"{', '.join(SUPPORTED)})")
            expected = _nbytes(kind, [int(d) for d in t.shape])
            if t.data.nbytes != expected or int(t.n_bytes) != expected:
                raise ModelFormatError(f"{self.path}: tensor {t.name!r} ({kind}) needs "
                                       f"{expected} bytes but the file holds {t.data.nbytes}; "
                                       "the file is truncated or damaged")
            self.tensors[name] = t
        end = max((int(t.data_offset) + int(t.n_bytes) for t in self.reader.tensors), default=0)
        if end > self.path.stat().st_size:
            raise ModelFormatError(f"{self.path} is truncated: its tensors end at byte {end}, "
                                   f"the file has {self.path.stat().st_size}")

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    @property
    def architecture(self) -> str:
        return str(self.field("general.architecture", ""))

    def config(self) -> ModelConfig:
        """The model's config, as a Hugging Face config.json would give it."""
        arch = self.architecture
        if arch not in ARCHITECTURES:
            raise ModelFormatError(f"{self.path}: GGUF architecture {arch!r} is not supported "
                                   f"(needle reads {', '.join(ARCHITECTURES)} GGUF files)")
        scaling = self.field(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none", "linear") \
                or "rope_freqs.weight" in {t.name for t in self.reader.tensors}:
            raise ModelFormatError(f"{self.path}: RoPE scaling {scaling or 'rope_freqs'} in a "
                                   "GGUF file is not read yet (linear is); use the model's "
                                   "safetensors checkpoint")
        heads = int(self.field(f"{arch}.attention.head_count"))
        tokens = self.field("tokenizer.ggml.tokens")
        embed = self.tensors.get("model.embed_tokens.weight")
        vocab = int(embed.shape[1]) if embed is not None else len(tokens or ())
        raw = {"architectures": [ARCHITECTURES[arch]],
               "hidden_size": int(self.field(f"{arch}.embedding_length")),
               "intermediate_size": int(self.field(f"{arch}.feed_forward_length")),
               "num_hidden_layers": int(self.field(f"{arch}.block_count")),
               "num_attention_heads": heads,
               "num_key_value_heads": int(self.field(f"{arch}.attention.head_count_kv", heads)),
               "rms_norm_eps": float(self.field(f"{arch}.attention.layer_norm_rms_epsilon",
                                                1e-5)),
               "rope_theta": float(self.field(f"{arch}.rope.freq_base", 10000.0)),
               "max_position_embeddings": int(self.field(f"{arch}.context_length", 2048)),
               "vocab_size": vocab,
               "tie_word_embeddings": "lm_head.weight" not in self.tensors,
               "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
               "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
               "torch_dtype": "bfloat16"}
        key_length = self.field(f"{arch}.attention.key_length")
        if key_length is not None:
            raw["head_dim"] = int(key_length)
        if scaling == "linear":
            factor = self.field(f"{arch}.rope.scaling.factor")
            if not isinstance(factor, (int, float)) or factor <= 0:
                raise ModelFormatError(f"{self.path}: linear RoPE scaling needs a positive "
                                       f"{arch}.rope.scaling.factor, got {factor!r}")
            raw["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
        if arch == "gemma3":
            raw.update(self._gemma3(raw))
        return ModelConfig.from_dict({k: v for k, v in raw.items() if v is not None},
                                     source=str(self.path))

    def _gemma3(self, raw: dict) -> dict:
        """Gemma 3's entries beyond the common ones, as llama.cpp reads or assumes them."""
        head_dim = raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
        layers = raw["num_hidden_layers"]
        more = {"sliding_window": self.field("gemma3.attention.sliding_window"),
                # llama.cpp's rule: its 27B model (62 layers) scales by hidden / heads
                "query_pre_attn_scalar": (raw["hidden_size"] // raw["num_attention_heads"]
                                          if layers == 62 else head_dim)}
        pattern = self.field("gemma3.attention.sliding_window_pattern")
        if isinstance(pattern, list) and len(pattern) == layers:  # a flag a layer
            more["layer_types"] = ["sliding_attention" if p else "full_attention"
                                   for p in pattern]
        elif pattern is not None:
            more["sliding_window_pattern"] = int(pattern)
        return {k: v for k, v in more.items() if v is not None}

    def kind(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def dense(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A tensor as a float array of ``shape`` (block types dequantized: norms, embedding)."""
        t, kind = self.tensors[name], self.kind(name)
        self._check_shape(name, shape)
        if kind in DENSE:
            return np.asarray(t.data).view(DENSE[kind]).reshape(shape)
        q, s, b, spec = self.packed(name, shape)
        return dequantize(q, s, b, spec.bits, spec.group_size, shape[-1]).reshape(shape)

    def packed(self, name: str, shape: tuple[int, int]):
        """A block-format matrix repacked: (qweight, scales, offsets, QuantSpec)."""
        t, kind = self.tensors[name], self.kind(name)
        self._check_shape(name, shape)
        rows = int(np.prod(shape[:-1]))
        return REPACK[kind](np.asarray(t.data).reshape(rows, -1), shape[-1])

    def _check_shape(self, name: str, shape) -> None:
        t = self.tensors[name]
        got = tuple(int(d) for d in reversed([int(d) for d in t.shape]))
        if int(np.prod(got)) != int(np.prod(shape)) or got[-1] != shape[-1]:
            raise ModelFormatError(f"{self.path}: tensor {t.name!r} has shape {got}, but the "
                                   f"metadata implies {tuple(shape)}")


def _nbytes(kind: str, ggml_shape: list[int]) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return int(np.prod(ggml_shape)) // block * size


def _unpermute_rows(n_rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (convert_hf_to_gguf's ``permute``:
    each head's rotary halves interleaved), as transformers' GGUF loader undoes it."""
    d = n_rows // heads // 2
    return np.arange(n_rows).reshape(heads, d, 2).swapaxes(1, 2).reshape(-1)


class GGUFWeights:
    """The ``WeightSource`` of a GGUF model: dense NDArrays or QuantizedMatrix by HF name."""

    def __init__(self, file: GGUFFile, cfg: ModelConfig, device, dtype: str):
        self.file, self.cfg, self.device, self.dtype = file, cfg, device, dtype
        self.permuted = file.architecture in PERMUTED  # q/k rows interleaved by the converter
        self.bytes_read = 0
        self._fused: dict[str, tuple] = {}

    def __call__(self, name: str, shape):
        from .. import backend_ndarray as nd

        if name not in self.file.tensors:
            raise ModelFormatError(f"{self.file.path} has no tensor for {name!r}")
        kind = self.file.kind(name)
        self.bytes_read += int(self.file.tensors[name].n_bytes)
        if kind in DENSE or len(shape) != 2 or name == "model.embed_tokens.weight":
            host = self._rows(name, self.file.dense(name, shape))
            if name.endswith("norm.weight") and self.cfg.arch.norm_offset:
                # stored as offset + w (convert_hf_to_gguf's norm shift); the loader adds
                # the offset to what the checkpoint stores
                host = host.astype(np.float32) - np.float32(self.cfg.arch.norm_offset)
            return nd.array(np.ascontiguousarray(host), device=self.device, dtype=self.dtype)
        q, s, b, spec = self._packed(name, shape)
        return nd.QuantizedMatrix.from_packed(q, s, b, spec, shape[1], self.device)

    def _packed(self, name: str, shape):
        """The repacked matrix, in the common format of the projection it is fused into."""
        group = next((g for g in FUSED if any(name.endswith(f"{p}.weight") for p in g)), None)
        if group is None:
            return self._permuted(name, self.file.packed(name, shape))
        prefix = name[:name.rindex("self_attn." if "self_attn." in name else "mlp.")]
        names = [f"{prefix}{p}.weight" for p in group]
        if name not in self._fused:
            kinds = {self.file.kind(n) for n in names}
            if kinds & set(DENSE) and len(kinds) > 1:
                raise ModelFormatError(f"{self.file.path}: {', '.join(names)} mix dense and "
                                       f"block types ({', '.join(sorted(kinds))}); needle fuses "
                                       "them into one projection and cannot")
            shapes = self.cfg.tensor_shapes()
            parts = [self._permuted(n, self.file.packed(n, shapes[n])) for n in names]
            self._fused.update(zip(names, to_common(parts)))
        return self._fused.pop(name)

    def _permuted(self, name: str, packed):
        q, s, b, spec = packed
        order = self._row_order(name, q.shape[0])
        if order is None:
            return packed
        return q[order], s[order], None if b is None else b[order], spec

    def _rows(self, name: str, dense: np.ndarray) -> np.ndarray:
        order = self._row_order(name, dense.shape[0]) if dense.ndim == 2 else None
        return dense if order is None else dense[order]

    def _row_order(self, name: str, rows: int):
        if not self.permuted:
            return None
        if name.endswith("self_attn.q_proj.weight"):
            return _unpermute_rows(rows, self.cfg.num_heads)
        if name.endswith("self_attn.k_proj.weight"):
            return _unpermute_rows(rows, self.cfg.num_kv_heads)
        return None


def load_gguf(path, device, dtype, max_seq_len, resolve):
    """The CausalLM of a GGUF file; ``resolve(cfg, device, dtype, max_seq_len)`` applies
    load_pretrained's argument rules and returns them checked."""

    from ..backends.api import has
    from . import memory
    from .generation_config import GenerationConfig
    from .gguf_tokenizer import gguf_tokenizer
    from .loader import INFERENCE_DTYPES, LoadStats, build
    from .quantized import quantized_estimate

    file = GGUFFile(path)
    cfg = file.config()
    device, dtype, max_seq_len = resolve(cfg, device, dtype, max_seq_len)
    packed = {n: REPACKED_SPEC[file.kind(n)] for n, s in cfg.tensor_shapes().items()
              if n in file.tensors and file.kind(n) in REPACK and len(s) == 2
              and n != "model.embed_tokens.weight"}
    memory.check_fits(quantized_estimate(memory.estimate(cfg, dtype, max_seq_len), cfg, dtype,
                                         packed), device, max_seq_len, dtype)
    if has(device.backend, "precompile"):  # compile kernels while the weights load
        device.backend.precompile((dtype,) + INFERENCE_DTYPES)
    source = GGUFWeights(file, cfg, device, dtype)
    model, seconds = build(cfg, source, max_seq_len, device, dtype)
    model.load_stats = LoadStats(source.bytes_read, seconds)
    model.generation_config = GenerationConfig(eos_token_ids=cfg.eos_token_ids)
    model.tokenizer = gguf_tokenizer(file)
    return model

