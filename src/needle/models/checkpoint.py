"""Read the tensors of a Hugging Face model directory by name, lazily and without copies.

A directory holds either ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. Headers are parsed up front (so shapes and sizes are
known before anything is loaded and a truncated or inconsistent file is reported at once,
naming the file and the tensor); tensor data is memory-mapped and read only when asked for.
The format is parsed here rather than through the ``safetensors`` package because numpy has
no bfloat16 of its own (``ml_dtypes`` supplies it) and because errors must name the tensor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import ModelFormatError
from ..serialization import read_header

# Every element type a safetensors header can name, with its size in bytes, so that any
# file's layout can be checked; only the floating ones can be model weights.
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
             "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
             "I64": 8, "U64": 8, "F64": 8}
WEIGHT_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
                 "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64)}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype, shape and its byte range in the file."""

    file: Path
    dtype_code: str  # as the header names it: BF16, F16, F32, I8, F8_E4M3, ...
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def dtype(self) -> np.dtype | None:
        """The numpy dtype of a weight tensor; None for types needle cannot load as weights."""
        return WEIGHT_DTYPES.get(self.dtype_code)


class Checkpoint:
    """The tensors of one model directory, by name."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: dict[Path, np.memmap] = {}
        index = self.directory / INDEX_FILE
        if index.is_file():
            self.source = index
            for file, names in _read_index(index).items():
                found = _read_header(file)
                for name in names:
                    if name not in found:
                        raise ModelFormatError(f"{file} has no tensor {name!r}, though "
                                               f"{index.name} says it does")
                self.tensors.update(found)
        elif (self.directory / SINGLE_FILE).is_file():
            self.source = self.directory / SINGLE_FILE
            self.tensors = _read_header(self.source)
        elif not self.directory.is_dir():
            raise ModelFormatError(f"{self.directory} is not a directory; pass the folder that "
                                   "holds config.json and model.safetensors")
        else:
            raise ModelFormatError(f"{self.directory} holds neither {SINGLE_FILE} nor "
                                   f"{INDEX_FILE}; only safetensors checkpoints are read "
                                   "(never pickle .bin files)")
        # a vision-language checkpoint's language model under text-model names (alias -> name)
        self.aliases = _text_model_names(self.tensors)

    @classmethod
    def from_file(cls, file: str | Path) -> Checkpoint:
        """The tensors of one safetensors file (a LoRA adapter's, say) by name."""
        file = Path(file)
        if not file.is_file():
            raise ModelFormatError(f"{file} does not exist")
        self = cls.__new__(cls)
        self.directory, self.source, self._maps = file.parent, file, {}
        self.tensors, self.aliases = _read_header(file), {}
        return self

    def model_tensors(self) -> dict[str, TensorInfo]:
        """The tensors of the language model under the names its config implies: every
        tensor, or a vision-language checkpoint's language-model tensors (no vision tower)."""
        if not self.aliases:
            return self.tensors
        return {alias: self.tensors[name] for alias, name in self.aliases.items()}

    def __contains__(self, name: str) -> bool:
        return self.aliases.get(name, name) in self.tensors

    def info(self, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
        """The tensor's TensorInfo; ModelFormatError if it is missing or not of ``shape``."""
        info = self.tensors.get(self.aliases.get(name, name))
        if info is None:
            raise ModelFormatError(f"{self.source} has no tensor {name!r}; the checkpoint does "
                                   "not match its config.json")
        if shape is not None and info.shape != tuple(shape):
            raise ModelFormatError(f"{info.file}: tensor {name!r} has shape {info.shape}, but "
                                   f"config.json implies {tuple(shape)}")
        if info.dtype is None:
            raise ModelFormatError(
                f"{info.file}: tensor {name!r} has dtype {info.dtype_code}; needle loads "
                f"weights stored as {', '.join(WEIGHT_DTYPES)} (integer, FP8 and quantized "
                "layouts such as GPTQ, AWQ or bitsandbytes are not read: use the model's "
                "bf16/fp16/fp32 checkpoint, or a GGUF file)")
        return info

    def read(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor as a read-only numpy array mapped from its file (no copy yet)."""
        info = self.info(name, shape)
        data = self._maps.get(info.file)
        if data is None:
            data = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        raw = data[info.start:info.start + info.nbytes]
        return raw.view(info.dtype).reshape(info.shape)

    def close(self) -> None:
        """Drop the file mappings (arrays returned by ``read`` must not be used after)."""
        self._maps.clear()


# where a vision-language checkpoint keeps its language model's tensors (transformers'
# saved layout, and its in-memory layout of 5.x), as the prefixes that stand for "model."
# and "lm_head."
_TEXT_MODEL_PREFIXES = (("language_model.model.", "language_model.lm_head."),
                        ("model.language_model.", "lm_head."))


def _text_model_names(tensors: dict[str, TensorInfo]) -> dict[str, str]:
    """For a vision-language checkpoint, the names a text model's checkpoint gives its
    language model's tensors (``model.*``, ``lm_head.*``) -> the names stored, so that a
    Gemma3ForConditionalGeneration directory loads as its Gemma3ForCausalLM; empty when the
    checkpoint has text-model names already."""
    if "model.embed_tokens.weight" in tensors:
        return {}
    for body, head in _TEXT_MODEL_PREFIXES:
        if f"{body}embed_tokens.weight" in tensors:
            aliases = {}
            for name in tensors:
                if name.startswith(body):
                    aliases["model." + name[len(body):]] = name
                elif name.startswith(head):
                    aliases["lm_head." + name[len(head):]] = name
            return aliases
    return {}


def _read_index(index: Path) -> dict[Path, list[str]]:
    """Shard file -> tensor names, from a sharded checkpoint's index."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelFormatError(f"{index} is not a valid safetensors index ({e}); it must be "
                               'JSON with a "weight_map" object of tensor name -> file') from None
    shards: dict[Path, list[str]] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file:
            raise ModelFormatError(f"{index}: tensor {name!r} maps to {file!r}, which is not a "
                                   "file name in the model directory")
        shards.setdefault(index.parent / file, []).append(name)
    for file, names in shards.items():
        if not file.is_file():
            raise ModelFormatError(f"{file} is missing; {index.name} places tensor {names[0]!r} "
                                   "in it")
    return shards


def _read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check it against the file: every tensor's byte range
    matches its dtype and shape, and the ranges tile the data section exactly (no gaps, no
    overlaps), as the safetensors format requires."""
    header, data_start, data_len = read_header(file)
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            code = entry["dtype"]
            shape = tuple(_dim(d) for d in entry["shape"])
            begin, end = (_dim(o) for o in entry["data_offsets"])
            if not isinstance(code, str):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise ModelFormatError(f"{file}: tensor {name!r} has a malformed header entry "
                                   f"{entry!r}") from None
        size = _ITEMSIZE.get(code)
        nbytes = end - begin
        if size is not None and nbytes != math.prod(shape) * size:
            raise ModelFormatError(f"{file}: tensor {name!r} of shape {shape} ({code}) needs "
                                   f"{math.prod(shape) * size} bytes but its offsets span "
                                   f"{nbytes}")
        out[name] = TensorInfo(file, code, shape, data_start + begin, nbytes)
    _check_tiling(file, out, data_start, data_len)
    return out


def _dim(value) -> int:
    """A non-negative integer from a header (a float such as 2.7, or -1, is an error)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(value)
    return value


def _check_tiling(file: Path, tensors: dict[str, TensorInfo], data_start: int,
                  data_len: int) -> None:
    position = data_start
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].start, item[1].nbytes)):
        if info.start != position:
            kind = "overlaps the tensor before it" if info.start < position else "leaves a gap"
            raise ModelFormatError(f"{file}: tensor {name!r} starts at byte "
                                   f"{info.start - data_start} of the data section and {kind} "
                                   f"(expected {position - data_start}); the file is corrupt")
        position += info.nbytes
        if position - data_start > data_len:
            raise ModelFormatError(f"{file} is truncated: tensor {name!r} needs bytes up to "
                                   f"{position - data_start} of the data section, which holds "
                                   f"only {data_len}")
    if position - data_start < data_len:
        raise ModelFormatError(f"{file}: {data_len - (position - data_start)} bytes after the "
                               "last tensor belong to none; the file is corrupt")
