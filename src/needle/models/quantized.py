"""Checkpoints with needle-quantized weights: reading them (``load_pretrained``) and writing
them (``needle quantize``).

A quantized checkpoint is a Hugging Face directory whose config.json carries

    "quantization_config": {"quant_method": "needle", "bits": 4, "group_size": 128,
                            "symmetric": false, "format_version": 1}

(``group_size`` null: one group per row, int8's per-output-channel scales) and whose
safetensors hold, for each quantized Linear weight ``X.weight`` (out, in), the packed arrays
``X.qweight`` (I32), ``X.scales`` (F32) and, unless symmetric, ``X.offsets`` (F32) of
docs/quantization.md; every other tensor is stored as in the source checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelFormatError, ShapeError
from ..quant.format import QuantSpec, quantize
from .checkpoint import Checkpoint, TensorInfo
from .config import ModelConfig, read_json_object
from .safetensors_io import write_safetensors

METHOD = "needle"
FORMAT_VERSION = 1
PACKED = {"qweight": ("I32", np.dtype(np.int32)), "scales": ("F32", np.dtype(np.float32)),
          "offsets": ("F32", np.dtype(np.float32))}
# files of a model directory that a quantized copy keeps as they are
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "chat_template.jinja", "tokenizer.model")


@dataclass(frozen=True)
class QuantConfig:
    """config.json's ``quantization_config`` for needle's format."""

    bits: int
    group_size: int | None  # None: one group per row
    symmetric: bool

    def spec(self, k: int) -> QuantSpec:
        return QuantSpec(self.bits, self.group_size or max(k, 1), not self.symmetric)

    def to_json(self) -> dict:
        return {"quant_method": METHOD, "bits": self.bits, "group_size": self.group_size,
                "symmetric": self.symmetric, "format_version": FORMAT_VERSION}

    @classmethod
    def read(cls, raw: dict, source: str) -> QuantConfig | None:
        """The config's quantization settings, None when it has none; other methods (GPTQ,
        AWQ, bitsandbytes...) are refused."""
        q = raw.get("quantization_config")
        if q is None:
            return None
        method = q.get("quant_method") if isinstance(q, dict) else None
        if method != METHOD:
            raise ModelFormatError(
                f"{source}: quantization_config has quant_method {method!r}; needle reads its "
                f"own ({METHOD!r}, written by `needle quantize`) and GGUF files, not GPTQ, AWQ "
                "or bitsandbytes checkpoints: quantize the model's bf16 checkpoint instead")
        bits, group, sym = q.get("bits"), q.get("group_size"), q.get("symmetric", True)
        if bits not in (8, 4) or not (group is None or (isinstance(group, int) and group > 0)) \
                or not isinstance(sym, bool):
            raise ModelFormatError(f"{source}: quantization_config {q} needs bits 8 or 4, a "
                                   "positive group_size (or null) and a boolean symmetric")
        if q.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
            raise ModelFormatError(f"{source}: quantization format_version "
                                   f"{q.get('format_version')} is not {FORMAT_VERSION}; "
                                   "upgrade needle")
        return cls(bits, group, sym)


def packed_shapes(name: str, shape: tuple[int, int], spec: QuantSpec) -> dict[str, tuple]:
    """The packed tensors (name -> shape) that stand for Linear weight ``name`` (X.weight)."""
    base = name.removesuffix(".weight")
    n, k = shape
    out = {f"{base}.qweight": (n, spec.words(k)), f"{base}.scales": (n, spec.groups(k))}
    if spec.has_offsets:
        out[f"{base}.offsets"] = (n, spec.groups(k))
    return out


def is_quantized(checkpoint: Checkpoint, name: str) -> bool:
    return name.endswith(".weight") and f"{name.removesuffix('.weight')}.qweight" in checkpoint


def read_packed(checkpoint: Checkpoint, name: str, shape, qcfg: QuantConfig):
    """(qweight, scales, offsets or None, spec) of quantized Linear weight ``name``, as numpy
    arrays mapped from the files (no copy); headers checked against the expected shapes."""
    if len(shape) != 2:
        raise ModelFormatError(f"{checkpoint.source}: {name} of shape {shape} is stored "
                               "quantized, but only 2-d Linear weights can be")
    spec = qcfg.spec(shape[1])
    arrays = []
    for packed, want in packed_shapes(name, shape, spec).items():
        arrays.append(_read(checkpoint, packed, want))
    if not spec.has_offsets:
        arrays.append(None)
    return (*arrays, spec)


def _read(checkpoint: Checkpoint, name: str, shape: tuple) -> np.ndarray:
    info: TensorInfo | None = checkpoint.tensors.get(name)
    kind = name.rsplit(".", 1)[1]
    code, dtype = PACKED[kind]
    if info is None:
        raise ModelFormatError(f"{checkpoint.source} has no tensor {name!r}, which its "
                               "quantization_config requires")
    if info.dtype_code != code or info.shape != tuple(shape):
        raise ModelFormatError(f"{info.file}: tensor {name!r} is {info.dtype_code} "
                               f"{info.shape}; the quantization_config implies {code} "
                               f"{tuple(shape)}")
    data = checkpoint._maps.get(info.file)
    if data is None:
        data = checkpoint._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
    return data[info.start:info.start + info.nbytes].view(dtype).reshape(shape)


def quantized_estimate(need, cfg: ModelConfig, dtype: str, packed: dict[str, QuantSpec]):
    """``need`` (a MemoryEstimate of the dense model) with the weights of the names in
    ``packed`` at their packed size, and the workspace grown by the largest fused matrix
    dequantized for a prefill product (gpu/quant.py)."""
    from dataclasses import replace

    from ..backend_ndarray.dtypes import ITEMSIZE

    shapes = cfg.tensor_shapes()
    weights = sum(packed[n].packed_nbytes(*s) if n in packed else math.prod(s) * ITEMSIZE[dtype]
                  for n, s in shapes.items())
    fused = 2 * cfg.intermediate_size * cfg.hidden_size * ITEMSIZE[dtype] if packed else 0
    return replace(need, weights=weights, workspace=need.workspace + fused)


# --- writing ------------------------------------------------------------------------------

def quantizable(cfg: ModelConfig, quantize_head: bool = False) -> set[str]:
    """The Linear weights ``needle quantize`` packs: every projection of every layer, and the
    output head when asked (and not tied to the embeddings)."""
    names = {n for n, s in cfg.tensor_shapes().items()
             if n.startswith("model.layers.") and n.endswith("_proj.weight") and len(s) == 2}
    if quantize_head and not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    return names


def quantize_checkpoint(source: str | Path, target: str | Path, bits: int,
                        group_size: int | None, symmetric: bool = True,
                        quantize_head: bool = False, progress: bool = True) -> Path:
    """Write a quantized copy of the model directory ``source`` into ``target``."""
    from tqdm import tqdm

    source, target = Path(source), Path(target)
    raw = read_json_object(source, "config.json")
    if raw.get("quantization_config") is not None:
        raise ModelFormatError(f"{source} is already quantized; quantize its original "
                               "checkpoint")
    cfg = ModelConfig.from_dict(raw, str(source / "config.json"))
    if bits == 8 and not symmetric:
        raise ShapeError("int8 is symmetric; drop --asymmetric or use --bits 4")
    qcfg = QuantConfig(bits, group_size, symmetric)
    checkpoint = Checkpoint(source)
    chosen = quantizable(cfg, quantize_head)
    plan = []  # (name, code, shape, producer) in file order
    for name, info in checkpoint.model_tensors().items():  # a vision tower is left out
        if name in chosen:
            plan += _quantized_entries(checkpoint, name, info, qcfg)
        else:
            plan.append((name, info.dtype_code, info.shape,
                         lambda n=name: np.ascontiguousarray(checkpoint.read(n))))
    target.mkdir(parents=True, exist_ok=True)
    try:
        write_safetensors(target / "model.safetensors", plan,
                           tqdm(total=len(plan), desc="quantizing", unit="tensor",
                                disable=not progress))
    finally:
        checkpoint.close()
    raw = dict(raw, quantization_config=qcfg.to_json())
    (target / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    for extra in COPIED:
        if (source / extra).is_file() and source.resolve() != target.resolve():
            shutil.copyfile(source / extra, target / extra)
    return target


def _quantized_entries(checkpoint, name, info, qcfg):
    """Plan entries of one quantized weight; its three arrays are computed once, on demand."""
    spec = qcfg.spec(info.shape[1])
    cache: dict[str, np.ndarray] = {}

    def part(kind: str) -> np.ndarray:
        if not cache:
            w = np.asarray(checkpoint.read(name), np.float32)
            q, s, b = quantize(w, qcfg.bits, qcfg.group_size, qcfg.symmetric)
            cache.update(qweight=q, scales=s, offsets=b)
        return cache.pop(kind)

    entries = []
    for packed, shape in packed_shapes(name, info.shape, spec).items():
        kind = packed.rsplit(".", 1)[1]
        entries.append((packed, PACKED[kind][0], shape, lambda k=kind: part(k)))
    return entries
