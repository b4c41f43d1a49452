"""Training LoRA adapters on a ``CausalLM``: attach, save (PEFT's format), load, merge.

``add_lora`` freezes the model and gives each target projection a ``LoRA``: A (r, in)
uniform in +-1/sqrt(in) and B (out, r) zero, as PEFT starts them, so an untrained adapter
changes nothing. ``save_adapter`` writes what ``PeftModel.from_pretrained`` loads;
``load_adapter`` attaches an adapter PEFT (or needle) wrote. The format itself lives in
``models/lora_format.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .. import backend_ndarray as nd
from .. import init, ops
from ..amp import autocast_dtype
from ..autograd import Tensor
from ..errors import ArgumentError
from ..models.lora_format import (
    CONFIG_FILE,
    KEY_PREFIX,
    WEIGHTS_FILE,
    LoraConfig,
    check_adapter,
    read_adapter,
)
from ..models.safetensors_io import write_json, write_safetensors
from ..nn import Dropout, Module, Parameter
from .model import CausalLM, Linear


class LoRA(Module):
    """The low-rank update of one projection: s * (dropout(x) A^T) B^T."""

    def __init__(self, in_features: int, out_features: int, r: int, scale: float,
                 dropout: float, device, dtype: str = "float32"):
        super().__init__()
        bound = 1 / math.sqrt(in_features)  # PEFT's kaiming_uniform(a=sqrt(5))
        self.lora_A = Parameter(init.rand(r, in_features, low=-bound, high=bound,
                                          device=device, dtype=dtype))
        self.lora_B = Parameter(init.zeros(out_features, r, device=device, dtype=dtype))
        self.scale = scale
        self.dropout = Dropout(dropout) if dropout else None

    def forward(self, x: Tensor) -> Tensor:
        if self.dropout is not None:
            x = self.dropout(x)
        if x.dtype == self.lora_A.dtype or autocast_dtype() is not None:
            return self._update(x)
        # frozen bf16 weights without autocast: the update in float32, then back
        return ops.cast(self._update(ops.cast(x, self.lora_A.dtype)), x.dtype)

    def _update(self, x: Tensor) -> Tensor:
        return ((x @ ops.transpose(self.lora_A)) @ ops.transpose(self.lora_B)) * self.scale

    def merged(self, weight) -> np.ndarray:
        """W + s B A in float32 on the host: ``weight`` (out, in) with this update merged."""
        a = self.lora_A.numpy().astype(np.float32)
        b = self.lora_B.numpy().astype(np.float32)
        return weight.numpy().astype(np.float32) + (b @ a) * np.float32(self.scale)


def add_lora(model: CausalLM, config: LoraConfig | None = None) -> list[str]:
    """Freeze every weight of ``model`` and attach a fresh adapter (float32) to each target
    projection; returns their module names. Train ``model.trainable_parameters()``."""
    config = config or LoraConfig()
    if adapters(model):
        raise ArgumentError("this model already has LoRA adapters; merge them first "
                            "(merge_lora) or start from a fresh model")
    targets = config.targets([n for n, m in model.named_modules() if isinstance(m, Linear)])
    for p in model.parameters():
        p.requires_grad = False
    modules = dict(model.named_modules())
    for name in targets:
        linear = modules[name]
        out_features, in_features = linear.weight.shape
        r, alpha = config.rank_and_alpha(name)
        linear.lora = LoRA(in_features, out_features, r, config.scale(r, alpha),
                           config.dropout, linear.weight.device)
    model.lora_config = config
    return targets


def adapters(model: CausalLM) -> dict[str, LoRA]:
    """Module name -> its LoRA, for every adapted projection."""
    return {n: m.lora for n, m in model.named_modules()
            if isinstance(m, Linear) and m.lora is not None}


def save_adapter(model: CausalLM, directory: str | Path) -> Path:
    """Write ``model``'s adapters as PEFT does (config and float32 weights), atomically."""
    found = adapters(model)
    if not found:
        raise ArgumentError("this model has no LoRA adapters to save (add_lora first)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plan = []
    for name, lora in found.items():
        for part in ("lora_A", "lora_B"):
            host = getattr(lora, part).numpy().astype(np.float32)
            plan.append((f"{KEY_PREFIX}{name}.{part}.weight", "F32", host.shape,
                         lambda h=host: h))
    write_safetensors(directory / WEIGHTS_FILE, plan)
    config = model.lora_config.to_json(str(model.source) if model.source else None)
    write_json(directory / CONFIG_FILE, config)
    return directory


def load_adapter(model: CausalLM, directory: str | Path) -> list[str]:
    """Attach the PEFT LoRA adapter in ``directory`` to ``model`` (its weights frozen, the
    adapter trainable); returns the adapted module names."""
    config, weights = read_adapter(directory)
    modules = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    check_adapter(weights, {f"{n}.weight": m.weight.shape for n, m in modules.items()},
                  directory)
    if adapters(model):
        raise ArgumentError("this model already has LoRA adapters; merge them first")
    for p in model.parameters():
        p.requires_grad = False
    for name, (a, b) in weights.items():
        linear = modules[name]
        r, alpha = a.shape[0], config.rank_and_alpha(name)[1]
        lora = LoRA(a.shape[1], b.shape[0], r, config.scale(r, alpha), config.dropout,
                    linear.weight.device)
        lora.lora_A.data = Tensor(a, device=linear.weight.device, dtype="float32")
        lora.lora_B.data = Tensor(b, device=linear.weight.device, dtype="float32")
        linear.lora = lora
    model.lora_config = config
    return sorted(weights)


def merge_lora(model: CausalLM) -> None:
    """Fold every adapter into its projection's weight (W += s B A, rounded once to the
    weight's dtype) and remove it; the weights stay frozen or trainable as they were."""
    modules = dict(model.named_modules())
    for name, lora in adapters(model).items():
        linear = modules[name]
        w = linear.weight
        merged = lora.merged(w)
        linear.weight.data = Tensor(nd.array(merged, dtype=w.dtype, device=w.device),
                                    requires_grad=False)
        linear.lora = None


