"""``load_pretrained``: a local Hugging Face model directory -> a needle LlamaForCausalLM.

Order matters for the user's time: the config and every tensor header are checked first
(a wrong or truncated file fails at once, naming the file and tensor), then the memory the
model will need is compared with what the device has free, and only then are weights read,
converted to the requested dtype on the host and copied to the device one tensor at a time.
"""

from __future__ import annotations

import numbers
from pathlib import Path

from .. import backend_ndarray as nd
from ..backend_ndarray import Device, dtypes
from ..errors import DTypeError, ModelFormatError, ShapeError
from . import memory
from .checkpoint import Checkpoint
from .config import LlamaConfig
from .llama import LlamaForCausalLM
from .tokenizer import TOKENIZER_FILE, Tokenizer

MODEL_DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_MAX_SEQ_LEN = 4096


def load_pretrained(path: str | Path, device: Device | str | None = None,
                    dtype: str | None = None, max_seq_len: int | None = None) -> LlamaForCausalLM:
    """Load a Llama, Mistral or Qwen2 checkpoint from the directory ``path``.

    ``device``: a Device or a name ('cuda', 'cpu', 'auto'); default the best enabled one.
    ``dtype``: float32, float16 or bfloat16; default the checkpoint's own.
    ``max_seq_len``: prompt plus generated tokens the KV cache holds; default the model's
    context length, at most 4096. The model carries ``.tokenizer`` when the directory has a
    ``tokenizer.json`` and the ``tokenizers`` package is installed, else None.
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelFormatError(f"{path} is not a directory; pass the folder holding "
                               "config.json and the safetensors weights")
    cfg = LlamaConfig.from_file(path / "config.json")
    device = _device(device)
    dtype = _dtype(dtype or cfg.dtype)
    max_seq_len = _max_seq_len(cfg, max_seq_len)
    checkpoint = Checkpoint(path)
    shapes = cfg.tensor_shapes()
    for name, shape in shapes.items():
        checkpoint.info(name, shape)
    memory.check_fits(memory.estimate(cfg, dtype, max_seq_len), device, max_seq_len, dtype)

    def weights(name: str, shape: tuple[int, ...]) -> nd.NDArray:
        host = checkpoint.read(name, shape)
        return nd.array(host, dtype=dtype, device=device)

    try:
        model = LlamaForCausalLM(cfg, weights, max_seq_len, device, dtype)
    finally:
        checkpoint.close()
    if (path / TOKENIZER_FILE).is_file():
        try:
            model.tokenizer = Tokenizer.from_file(path / TOKENIZER_FILE)
        except ModelFormatError as e:
            if "needs the 'tokenizers' package" not in str(e):
                raise
    return model


def _device(device) -> Device:
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


def _max_seq_len(cfg: LlamaConfig, requested) -> int:
    if requested is None:
        length = min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        return min(length, cfg.sliding_window) if cfg.sliding_window else length
    if not isinstance(requested, numbers.Integral) or requested < 1:
        raise ShapeError(f"max_seq_len must be a positive int, got {requested!r}")
    if cfg.sliding_window and requested > cfg.sliding_window:
        raise ModelFormatError(f"this {cfg.architecture} attends within a sliding window of "
                               f"{cfg.sliding_window} positions, which needle does not "
                               f"implement; full attention is identical up to that length, so "
                               f"use max_seq_len <= {cfg.sliding_window}")
    return int(requested)
