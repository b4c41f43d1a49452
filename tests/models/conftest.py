"""Fixtures: tiny Hugging Face checkpoints saved once per session, with their reference."""

from __future__ import annotations

import pytest

from .hf_models import VARIANTS, build


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """variant -> (directory, transformers model), built on first use."""
    made: dict[str, tuple] = {}

    def get(variant: str):
        if variant not in made:
            directory = tmp_path_factory.mktemp(variant)
            made[variant] = (directory, build(variant, directory))
        return made[variant]

    return get


@pytest.fixture(params=sorted(VARIANTS))
def variant(request) -> str:
    return request.param
