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


def _trained(tmp_path_factory, name: str, build):
    """A tiny Llama trained once a session (``tool_model``) in its own directory."""
    directory = tmp_path_factory.mktemp(name)
    build(directory)
    return directory


def _loaded(directory):
    from needle.models import load_pretrained

    return load_pretrained(directory, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tool_dir(tmp_path_factory):
    """The model that learned a tool conversation (``tool_model.build``)."""
    from . import tool_model

    return _trained(tmp_path_factory, "tool_model", tool_model.build)


@pytest.fixture(scope="session")
def tool_llm(tool_dir):
    return _loaded(tool_dir)


@pytest.fixture(scope="session")
def thinker_dir(tmp_path_factory):
    """The same conversation thought through first (``tool_model.build_thinker``)."""
    from . import tool_model

    return _trained(tmp_path_factory, "thinker", tool_model.build_thinker)


@pytest.fixture(scope="session")
def thinker(thinker_dir):
    return _loaded(thinker_dir)
