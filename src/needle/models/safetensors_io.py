"""Writing safetensors files the way Hugging Face tools read them, one tensor at a time.

``needle.save`` writes needle's own state files (with a tree of names in the metadata);
checkpoints that transformers, PEFT and ``load_pretrained`` must read carry only
``{"format": "pt"}`` and are written here: ``needle quantize``'s packed copies, fine-tuned
checkpoints and LoRA adapters, and the JSON files beside them. A file appears whole or not
at all (written beside the target, then renamed over it; the weights flushed to disk
first).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..errors import ModelFormatError

SIZES = {"I32": 4, "F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I8": 1, "U8": 1,
         "BOOL": 1, "I16": 2, "U16": 2, "U32": 4, "U64": 8}

# (name, dtype code, shape, a function that produces the array when its turn comes)
PlanEntry = tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]


def write_json(path: Path, value) -> None:
    """A JSON file beside such a checkpoint (config.json, adapter_config.json, a run's log),
    replaced whole or not at all."""
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def write_safetensors(path: Path, plan: Sequence[PlanEntry], bar=None) -> None:
    """A safetensors file of ``plan``'s tensors, in order, only one in memory at a time;
    ``bar`` (a tqdm) advances a tensor at a time."""
    header, offset = {}, 0
    for name, code, shape, _ in plan:
        if code not in SIZES:
            raise ModelFormatError(f"cannot write tensor {name!r} of dtype {code}")
        nbytes = math.prod(shape) * SIZES[code]
        header[name] = {"dtype": code, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            for name, _, shape, produce in plan:
                data = produce()
                if tuple(data.shape) != tuple(shape):
                    raise ModelFormatError(f"tensor {name!r}: produced {data.shape}, planned "
                                           f"{shape}")
                f.write(np.ascontiguousarray(data).view(np.uint8).data)
                if bar is not None:
                    bar.update(1)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
