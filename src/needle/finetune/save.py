"""A trained model written back as a Hugging Face checkpoint directory.

The directory is what ``save_pretrained`` writes (``config.json``, ``model.safetensors``,
and the source directory's tokenizer and generation files), so transformers,
``load_pretrained``, ``needle generate`` / ``chat`` / ``serve`` / ``quantize`` all read it.
Weights are written under the checkpoint's names in its dtype (or the one asked for), with
any LoRA adapters merged in: the file holds the model as it computes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from ..backend_ndarray import dtypes
from ..errors import ArgumentError
from ..models.config import read_json_object, text_model_config
from ..models.quantized import COPIED
from ..models.safetensors_io import write_json, write_safetensors
from .lora import adapters
from .model import TRAIN_DTYPES, CausalLM

_CODES = {"float32": ("F32", np.float32), "float16": ("F16", np.float16),
          "bfloat16": ("BF16", ml_dtypes.bfloat16)}


def save_pretrained(model: CausalLM, directory: str | Path, dtype: str | None = None,
                    progress: bool = True) -> Path:
    """Write ``model`` into ``directory`` as a Hugging Face checkpoint in ``dtype`` (default:
    the dtype of the checkpoint it was loaded from). The weights file is replaced whole or
    not at all; the source directory itself is refused (its weights would be overwritten)."""
    from tqdm import tqdm

    directory = Path(directory)
    source = model.source
    if source is not None and directory.resolve() == Path(source).resolve():
        raise ArgumentError(f"{directory} is the checkpoint this model was loaded from; save "
                            "into another directory (nothing of the original is overwritten)")
    dtype = dtypes.canonical(dtype or model.config.dtype)
    if dtype not in TRAIN_DTYPES:
        raise ArgumentError(f"save_pretrained writes {', '.join(TRAIN_DTYPES)}, not {dtype}")
    code, np_dtype = _CODES[dtype]
    deltas = {f"{name}.weight": lora for name, lora in adapters(model).items()}
    plan = []
    for name, param in model.named_parameters():
        if ".lora." in name:
            continue  # adapters go in through their projection's weight
        plan.append((name, code, tuple(param.shape),
                     lambda p=param, n=name: _host(p, deltas.get(n), np_dtype)))
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(directory / "model.safetensors", plan,
                      tqdm(total=len(plan), desc="saving", unit="tensor", disable=not progress))
    _write_config(model, directory, dtype)
    if source is not None:
        for extra in COPIED:
            if (Path(source) / extra).is_file():
                shutil.copyfile(Path(source) / extra, directory / extra)
    return directory


def _host(param, lora, np_dtype) -> np.ndarray:
    """The parameter's values as the file stores them (its adapter merged in float32)."""
    values = param.numpy() if lora is None else lora.merged(param)
    return values.astype(np_dtype)


def _write_config(model: CausalLM, directory: Path, dtype: str) -> None:
    """The source's config.json with the saved dtype (both spellings transformers uses);
    a model built without a source directory cannot be saved this way."""
    if model.source is None:
        raise ArgumentError("this model was not loaded from a checkpoint directory, so there "
                            "is no config.json to write beside its weights")
    source = Path(model.source) / "config.json"
    # a vision-language checkpoint's language model is saved as a text model (no vision tower)
    raw = text_model_config(read_json_object(source, "config.json"), str(source))
    raw["torch_dtype"] = dtype
    if "dtype" in raw:
        raw["dtype"] = dtype
    write_json(directory / "config.json", raw)
