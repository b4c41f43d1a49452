"""A model's generation defaults, from its ``generation_config.json``.

Checkpoints ship how their authors meant them to be sampled: Llama 3 Instruct, for one,
stops at either of ``[128001, 128009]`` and samples with temperature 0.6 and top-p 0.9.
needle stops at the union of config.json's and generation_config.json's end-of-sequence
ids, and each sampling setting the caller leaves as None takes the file's value, with
transformers' meaning: without ``do_sample: true`` the file asks for greedy decoding, and
its temperature and filters are then ignored. (transformers also fills in top_k = 50 when a
file that samples names no top_k; needle does not add filters the file does not name.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import GenerationError, ModelFormatError
from .config import read_json_object, token_ids
from .sampling import SamplingParams

FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def read(cls, directory: Path, eos_token_ids: tuple[int, ...]) -> GenerationConfig:
        """The directory's generation_config.json (if any) over config.json's eos ids."""
        base = cls(eos_token_ids=eos_token_ids)
        path = Path(directory) / FILE
        if not path.is_file():
            return base
        raw = read_json_object(path, FILE)
        source = str(path)
        eos = token_ids(raw.get("eos_token_id"), source, "eos_token_id")
        merged = tuple(dict.fromkeys(eos_token_ids + eos))
        values = {}
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float),
                           ("min_p", float), ("repetition_penalty", float)):
            value = raw.get(name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ModelFormatError(f"{source}: {name} must be a number, got {value!r}")
                values[name] = kind(value)
        do_sample = raw.get("do_sample", False)
        if not isinstance(do_sample, bool):
            raise ModelFormatError(f"{source}: do_sample must be true or false")
        config = replace(base, eos_token_ids=merged, do_sample=do_sample, **values)
        try:
            config.sampling()  # refuse values no sampler accepts now, naming the file
        except GenerationError as e:
            raise ModelFormatError(f"{source}: {e}") from None
        return config

    def sampling(self, temperature=None, top_k=None, top_p=None, min_p=None,
                 repetition_penalty=None, seed=None) -> SamplingParams:
        """The caller's settings, each None replaced by this file's (see the module notes)."""
        sample = self.do_sample and (self.temperature is None or self.temperature > 0)

        def pick(given, own):
            return given if given is not None else (own if sample else None)

        if temperature is None:
            temperature = (self.temperature if self.temperature is not None else 1.0) \
                if sample else 0.0
        penalty = (repetition_penalty if repetition_penalty is not None
                   else self.repetition_penalty)
        return SamplingParams(float(temperature), pick(top_k, self.top_k),
                              pick(top_p, self.top_p), pick(min_p, self.min_p), penalty, seed)
