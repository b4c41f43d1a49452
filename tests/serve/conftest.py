"""A tiny Llama checkpoint written by transformers' save_pretrained, with a BPE tokenizer
trained here and a ChatML template (nothing is downloaded)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from ..models.hf_models import build_with_tokenizer

    directory = tmp_path_factory.mktemp("serve_model")
    build_with_tokenizer(directory, chat=True, max_position_embeddings=256)
    return directory


@pytest.fixture(scope="session")
def model(model_dir):
    from needle.models import load_pretrained

    return load_pretrained(model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def scored_dir(tmp_path_factory):
    """A tiny Llama (no chat template) and transformers' float32 reading of it."""
    from ..models.hf_models import build_with_tokenizer

    directory = tmp_path_factory.mktemp("scored_model")
    reference = build_with_tokenizer(directory, max_position_embeddings=256)
    return directory, reference.eval()


@pytest.fixture(scope="session")
def scored(scored_dir):
    from needle.models import load_pretrained

    return load_pretrained(scored_dir[0], device="cpu", dtype="float32")
