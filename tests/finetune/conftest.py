"""Fixtures: the tiny transformers checkpoints of tests/models (one per family), built once a
session, and a tiny chat model with a trained BPE tokenizer."""

from __future__ import annotations

import pytest

from tests.models.conftest import VARIANT_NAMES, checkpoints  # noqa: F401 (fixtures)


@pytest.fixture(params=VARIANT_NAMES)
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    """(directory, transformers model): a tiny Llama with a ChatML template, float32."""
    from tests.models.hf_models import build_with_tokenizer

    directory = tmp_path_factory.mktemp("chat_model")
    return directory, build_with_tokenizer(directory, chat=True)
