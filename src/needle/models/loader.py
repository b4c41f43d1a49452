"""``load_pretrained``: a local Hugging Face model directory -> a needle ``CausalLM``.

Order matters for the user's time: the config and every tensor header are checked first
(a wrong or truncated file fails at once, naming the file and tensor), then the memory the
model will need is compared with what the device has free, and only then are weights read,
converted to the requested dtype on the host and copied to the device one tensor at a time.
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass
from pathlib import Path

from .. import backend_ndarray as nd
from ..backend_ndarray import Device, dtypes
from ..backends.api import has
from ..errors import DTypeError, ModelFormatError, ShapeError
from . import memory
from .causal_lm import CausalLM
from .checkpoint import Checkpoint
from .config import ModelConfig, read_json_object
from .generation_config import GenerationConfig
from .quantized import QuantConfig, is_quantized, quantized_estimate, read_packed
from .tokenizer import load_tokenizer

MODEL_DTYPES = ("float32", "float16", "bfloat16")
# dtypes of the kernels inference uses besides the model's: token ids, positions and argmax
# indices (the backend knows which of its kernels those need)
INFERENCE_DTYPES = ("int32", "int64")
DEFAULT_MAX_SEQ_LEN = 4096


@dataclass(frozen=True)
class LoadStats:
    """What loading the weights cost: bytes read from the files, and wall time from the
    first read to the last copy on the device finished."""

    bytes_read: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds else 0.0


def load_pretrained(path: str | Path, device: Device | str | None = None,
                    dtype: str | None = None, max_seq_len: int | None = None,
                    adapter: str | Path | None = None) -> CausalLM:
    """Load a checkpoint of a supported family (``ARCHITECTURES``) from the directory ``path``
    (Hugging Face safetensors, plain or quantized by ``needle quantize``) or a ``.gguf`` file
    (``models/gguf.py``).

    ``device``: a Device or a name ('cuda', 'cpu', 'auto'); default the best enabled one.
    ``dtype``: float32, float16 or bfloat16; default the checkpoint's own.
    ``max_seq_len``: prompt plus generated tokens the KV cache holds; default the model's
    context length, at most 4096. ``adapter``: a LoRA adapter directory (PEFT's format, as
    ``needle finetune --lora-rank`` or PEFT's ``save_pretrained`` writes it), merged into the
    weights as they load (``lora_format.adapter_deltas``). The model carries ``.tokenizer``
    (with its chat template) when the directory has a ``tokenizer.json`` and the
    ``tokenizers`` package is installed, else None, and ``.generation_config`` from
    generation_config.json.
    """
    path = Path(path)
    if path.suffix.lower() == ".gguf" and path.is_file():
        if adapter is not None:
            raise ModelFormatError("a LoRA adapter merges into a safetensors checkpoint's "
                                   "weights, not a GGUF file's; load the model's safetensors "
                                   "directory with the adapter")
        from .gguf import load_gguf

        return load_gguf(path, device, dtype, max_seq_len, _resolve)
    if not path.is_dir():
        raise ModelFormatError(f"{path} is not a directory; pass the folder holding "
                               "config.json and the safetensors weights (or a .gguf file)")
    cfg = ModelConfig.from_file(path / "config.json")
    qcfg = QuantConfig.read(read_json_object(path, "config.json"), str(path / "config.json"))
    generation = GenerationConfig.read(path, cfg.eos_token_ids)
    device = resolve_device(device)
    dtype = _dtype(dtype or cfg.dtype)
    max_seq_len = _max_seq_len(cfg, max_seq_len)
    checkpoint = Checkpoint(path)
    deltas = _adapter(adapter, cfg, qcfg)
    for name, shape in cfg.tensor_shapes().items():
        if qcfg is not None and is_quantized(checkpoint, name):
            read_packed(checkpoint, name, shape, qcfg)  # checks the packed tensors' headers
        else:
            checkpoint.info(name, shape)
    need = memory.estimate(cfg, dtype, max_seq_len)
    if qcfg is not None:  # packed weights: their own bytes, plus a prefill's dequantized matrix
        need = quantized_estimate(need, cfg, dtype, {
            n: qcfg.spec(s[1]) for n, s in cfg.tensor_shapes().items()
            if is_quantized(checkpoint, n)})
    memory.check_fits(need, device, max_seq_len, dtype)
    if has(device.backend, "precompile"):  # compile kernels while the weights load
        device.backend.precompile((dtype,) + INFERENCE_DTYPES)
    read = 0

    def weights(name: str, shape: tuple[int, ...]) -> nd.NDArray | nd.QuantizedMatrix:
        nonlocal read
        if qcfg is not None and is_quantized(checkpoint, name):
            q, s, b, spec = read_packed(checkpoint, name, shape, qcfg)
            read += q.nbytes + s.nbytes + (0 if b is None else b.nbytes)
            return nd.QuantizedMatrix.from_packed(q, s, b, spec, shape[1], device)
        host = checkpoint.read(name, shape)
        read += host.nbytes
        if name in deltas:  # W + s B A in float32, rounded once to the model's dtype
            host = host.astype("float32") + deltas.pop(name)
        return nd.array(host, dtype=dtype, device=device)

    model, seconds = build(cfg, weights, max_seq_len, device, dtype, checkpoint)
    model.load_stats = LoadStats(read, seconds)
    model.generation_config = generation
    model.tokenizer = load_tokenizer(path)
    return model


def build(cfg: ModelConfig, weights, max_seq_len: int, device: Device, dtype: str,
          checkpoint=None) -> tuple[CausalLM, float]:
    """The model from ``weights(name, shape)`` with its work finished on the device, and the
    seconds that took; ``checkpoint`` (when given) is closed whatever happens."""
    start = time.perf_counter()
    try:
        model = CausalLM(cfg, weights, max_seq_len, device, dtype)
        device.synchronize()
    finally:
        if checkpoint is not None:
            checkpoint.close()
    return model, time.perf_counter() - start


def _adapter(adapter, cfg: ModelConfig, qcfg) -> dict:
    """The LoRA adapter's weight updates by weight name (none without an adapter)."""
    if adapter is None:
        return {}
    if qcfg is not None:
        raise ModelFormatError("a LoRA adapter merges into dense weights, and this checkpoint "
                               "is quantized; load the original checkpoint with the adapter "
                               "(or quantize after merging: needle finetune --merge)")
    from .lora_format import adapter_deltas

    return adapter_deltas(adapter, cfg.tensor_shapes())


def _resolve(cfg: ModelConfig, device, dtype, max_seq_len):
    """load_pretrained's argument rules, for loaders of other formats (GGUF)."""
    return resolve_device(device), _dtype(dtype or cfg.dtype), _max_seq_len(cfg, max_seq_len)


def resolve_device(device) -> Device:
    if device is None:
        return nd.default_device()
    dev = nd.device_from_name(device) if isinstance(device, str) else device
    dev.backend  # noqa: B018 -- raises DeviceError saying why a disabled device cannot be used
    return dev


def _dtype(dtype) -> str:
    name = dtypes.canonical(dtype)
    if name not in MODEL_DTYPES:
        raise DTypeError(f"a model runs in {', '.join(MODEL_DTYPES)}, not {name}")
    return name


def _max_seq_len(cfg: ModelConfig, requested) -> int:
    """The KV cache's positions: at most what the model was trained for
    (max_position_embeddings); sliding windows shorter than it are served exactly."""
    if requested is None:
        return min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    if isinstance(requested, bool) or not isinstance(requested, numbers.Integral) \
            or requested < 1:
        raise ShapeError(f"max_seq_len must be a positive int, got {requested!r}")
    if requested > cfg.max_position_embeddings:
        raise ShapeError(f"max_seq_len {requested} exceeds the {cfg.max_position_embeddings} "
                         f"positions this {cfg.family} model was trained for "
                         "(max_position_embeddings in config.json); beyond them its rotary "
                         "positions are untrained, so needle does not go there")
    return int(requested)
