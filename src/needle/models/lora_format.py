"""LoRA adapters in PEFT's format: the config, reading an adapter, merging one into weights.

A LoRA adapter (Hu et al., 2021) adds a low-rank update to a frozen projection: y = x W^T +
s * (x A^T) B^T with A (r, in), B (out, r) and s = alpha / r (alpha / sqrt(r) with
rsLoRA). PEFT saves one as ``adapter_config.json`` and ``adapter_model.safetensors``, keys
``base_model.model.<module>.lora_A.weight``. This module reads and writes that format
without needing PEFT; ``needle.finetune.lora`` trains adapters, and ``load_pretrained(...,
adapter=...)`` merges one into the weights at load (``merge_into``). PEFT options that change
the computation beyond that (DoRA, bias training, modules_to_save, ...) are refused by name
rather than ignored.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ArgumentError, ModelFormatError
from .checkpoint import Checkpoint
from .config import read_json_object

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every projection but the output head
# PEFT options that would change what the adapter computes, with the value meaning "off"
_REFUSED = {"use_dora": False, "modules_to_save": None, "fan_in_fan_out": False,
            "lora_bias": False, "layer_replication": None, "trainable_token_indices": None,
            "target_parameters": None, "use_qalora": False, "alora_invocation_tokens": None}


@dataclass
class LoraConfig:
    """The adapter's shape: rank ``r``, ``alpha`` (scale alpha / r), ``dropout`` on the
    adapter's input while training, the projections it targets (names such as "q_proj",
    matched as a module name's last part; a string is a regular expression over the full
    module name; "all-linear" every projection of the layers), and PEFT's per-module
    ``rank_pattern`` / ``alpha_pattern`` and ``layers_to_transform``."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | str = ALL_LINEAR
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    layers_to_transform: list[int] | None = None

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ArgumentError(f"LoRA rank r must be a positive int, got {self.r!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ArgumentError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")

    def rank_and_alpha(self, module: str) -> tuple[int, float]:
        return (_pattern_value(self.rank_pattern, module, self.r),
                _pattern_value(self.alpha_pattern, module, self.alpha))

    def scale(self, r: int, alpha: float) -> float:
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, names: list[str]) -> list[str]:
        """Which of a model's projections (module names) this config adapts; an error if
        none."""
        chosen = [n for n in names if self._targets(n)]
        if not chosen:
            raise ArgumentError(f"LoRA target_modules {self.target_modules!r} match no "
                                f"projection of this model; its projections are named like "
                                f"{', '.join(sorted({n.rsplit('.', 1)[-1] for n in names}))}")
        return chosen

    def _targets(self, name: str) -> bool:
        if not name.startswith("model.layers."):
            return False  # the output head stays as it is (PEFT's all-linear does too)
        if self.layers_to_transform is not None:
            if int(name.split(".")[2]) not in self.layers_to_transform:
                return False
        t = self.target_modules
        if t == ALL_LINEAR:
            return True
        if isinstance(t, str):
            return re.fullmatch(t, name) is not None
        return any(name == x or name.endswith("." + x) for x in t)

    def to_json(self, base: str | None) -> dict:
        """PEFT's adapter_config.json for this adapter."""
        targets = self.target_modules
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.r,
                "lora_alpha": self.alpha, "lora_dropout": self.dropout,
                "target_modules": targets if isinstance(targets, str) else sorted(targets),
                "bias": "none", "use_rslora": self.use_rslora, "use_dora": False,
                "fan_in_fan_out": False, "init_lora_weights": True,
                "rank_pattern": dict(self.rank_pattern),
                "alpha_pattern": dict(self.alpha_pattern),
                "layers_to_transform": self.layers_to_transform, "layers_pattern": None,
                "modules_to_save": None, "base_model_name_or_path": base,
                "inference_mode": True}

    @classmethod
    def from_json(cls, raw: dict, source: str) -> LoraConfig:
        """Read PEFT's adapter_config.json, refusing what needle does not compute."""
        if raw.get("peft_type") != "LORA":
            raise ModelFormatError(f"{source}: peft_type {raw.get('peft_type')!r} is not "
                                   "LORA; needle reads LoRA adapters only")
        for key, off in _REFUSED.items():
            if raw.get(key, off) not in (off, [], {}):
                raise ModelFormatError(f"{source}: {key} = {raw[key]!r} is not supported "
                                       "(needle applies plain LoRA: A, B and a scale)")
        if raw.get("bias", "none") != "none":
            raise ModelFormatError(f"{source}: bias = {raw['bias']!r} is not supported; "
                                   "needle applies adapters with bias 'none'")
        layers = raw.get("layers_to_transform")
        if isinstance(layers, int):
            layers = [layers]
        try:
            return cls(r=raw["r"], alpha=float(raw.get("lora_alpha", 8)),
                       dropout=float(raw.get("lora_dropout") or 0.0),
                       target_modules=raw.get("target_modules") or ALL_LINEAR,
                       use_rslora=bool(raw.get("use_rslora", False)),
                       rank_pattern=dict(raw.get("rank_pattern") or {}),
                       alpha_pattern=dict(raw.get("alpha_pattern") or {}),
                       layers_to_transform=layers)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(f"{source} is not a valid LoRA adapter config ({e!r})"
                                   ) from None


def read_adapter(directory: str | Path) -> tuple[LoraConfig, dict[str, tuple[np.ndarray,
                                                                           np.ndarray]]]:
    """A PEFT LoRA adapter directory: its config and module name -> (A, B) float32."""
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ModelFormatError(f"{directory} has no {CONFIG_FILE}; pass a LoRA adapter "
                               "directory as PEFT's save_pretrained writes it")
    config = LoraConfig.from_json(read_json_object(config_path, CONFIG_FILE), str(config_path))
    if not (directory / WEIGHTS_FILE).is_file():
        raise ModelFormatError(f"{directory} has no {WEIGHTS_FILE} (needle reads safetensors "
                               "adapters, never pickled adapter_model.bin)")
    return config, _adapter_weights(directory / WEIGHTS_FILE)


def _adapter_weights(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    checkpoint = Checkpoint.from_file(path)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    try:
        for key in checkpoint.tensors:
            match = re.fullmatch(r"base_model\.model\.(.+)\.(lora_[AB])(?:\.default)?\.weight",
                                 key)
            if match is None:
                raise ModelFormatError(f"{path}: tensor {key!r} is not a LoRA A or B matrix "
                                       "(needle applies plain LoRA adapters)")
            module, part = match.groups()
            pairs.setdefault(module, {})[part] = np.array(checkpoint.read(key), np.float32)
    finally:
        checkpoint.close()
    out = {}
    for module, parts in pairs.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise ModelFormatError(f"{path}: {module} has {', '.join(parts)} but not both "
                                   "lora_A and lora_B")
        a, b = parts["lora_A"], parts["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ModelFormatError(f"{path}: {module}'s lora_A {a.shape} and lora_B "
                                   f"{b.shape} are not (r, in) and (out, r)")
        out[_text_model_name(module)] = (a, b)
    return out


def _text_model_name(module: str) -> str:
    """A vision-language model's language-model module under its text model's name."""
    for prefix in ("model.language_model.", "language_model.model."):
        if module.startswith(prefix):
            return "model." + module[len(prefix):]
    return module


def check_adapter(found: dict[str, tuple[np.ndarray, np.ndarray]],
                  shapes: dict[str, tuple[int, ...]], directory) -> None:
    """Refuse an adapter (module name -> (A, B)) that does not fit a model whose weights have
    ``shapes`` (HF name -> shape): one trained for another model."""
    for name, (a, b) in found.items():
        shape = shapes.get(f"{name}.weight")
        if shape is None:
            raise ModelFormatError(f"{directory}: the adapter adapts {name}, which this model "
                                   "does not have; it was trained for another model")
        if tuple(shape) != (b.shape[0], a.shape[1]):
            raise ModelFormatError(f"{directory}: {name}'s adapter maps {a.shape[1]} -> "
                                   f"{b.shape[0]} features but the weight is {tuple(shape)}; "
                                   "it was trained for another model")


def adapter_deltas(directory: str | Path, shapes: dict[str, tuple[int, ...]]
                   ) -> dict[str, np.ndarray]:
    """What merging the adapter in ``directory`` adds to a model's weights: checkpoint weight
    name -> s * B A (float32), checked against the model's tensor ``shapes`` (HF name ->
    shape) so that an adapter for another model is refused before any weight is read."""
    config, found = read_adapter(directory)
    check_adapter(found, shapes, directory)
    deltas = {}
    for name, (a, b) in found.items():
        r, alpha = a.shape[0], config.rank_and_alpha(name)[1]
        deltas[f"{name}.weight"] = (b @ a) * np.float32(config.scale(r, alpha))
    return deltas


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that matches the end
    of the module's name (as a regular expression), else the default."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
