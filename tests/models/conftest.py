"""Fixtures: tiny Hugging Face checkpoints saved once per session, with their reference.

transformers is imported only when a fixture needs it, so the tests that do not (tokenizer,
KV write) still run where it is not installed; the others skip.
"""

from __future__ import annotations

import pytest

VARIANT_NAMES = ("llama", "llama3_rope_tied", "mistral", "qwen2", "mistral_window", "qwen3",
                 "gemma2", "phi3", "gemma3")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """variant -> (directory, transformers model), built on first use."""
    from .hf_models import build

    made: dict[str, tuple] = {}

    def get(variant: str):
        if variant not in made:
            directory = tmp_path_factory.mktemp(variant)
            made[variant] = (directory, build(variant, directory))
        return made[variant]

    return get


@pytest.fixture(params=VARIANT_NAMES)
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def greedy_reference(checkpoints):
    """(variant, prompt, n) -> transformers' n greedy tokens, computed once per session."""
    from .hf_models import reference_greedy

    done: dict[tuple, list[int]] = {}

    def get(variant: str, prompt: list[int], n: int) -> list[int]:
        key = (variant, tuple(prompt), n)
        if key not in done:
            done[key] = reference_greedy(checkpoints(variant)[1], prompt, n)
        return done[key]

    return get
