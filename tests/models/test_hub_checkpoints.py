"""Checkpoints as the Hugging Face Hub ships them: written by transformers' ``save_pretrained``
in bfloat16, float16 and float32, sharded and unsharded, tied and untied. needle must load
each in its own dtype (the default) or converted, and, computing in float32, give the logits
and greedy tokens of transformers running the very same weights."""

from __future__ import annotations

import numpy as np
import pytest

from needle.models import load_pretrained

from .conftest import VARIANT_NAMES
from .hf_models import build, reference_greedy, reference_logits

PROMPT = [1, 17, 99, 3, 250, 42, 7, 128]
FILE_DTYPES = ("bfloat16", "float16", "float32")


@pytest.fixture(scope="module")
def hub_checkpoint(tmp_path_factory):
    """(variant, file dtype, sharded) -> (directory, float32 reference), made once."""
    made: dict[tuple, tuple] = {}

    def get(variant: str, dtype: str, sharded: bool):
        key = (variant, dtype, sharded)
        if key not in made:
            directory = tmp_path_factory.mktemp(f"{variant}-{dtype}")
            made[key] = directory, build(variant, directory, dtype=dtype,
                                         max_shard_size="60KB" if sharded else None)
        return made[key]

    return get


def rel_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("dtype", FILE_DTYPES)
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_float32_compute_matches_transformers(hub_checkpoint, variant, dtype):
    """Every architecture and file dtype, converted to float32 on load: transformers' logits
    within 1e-4 and its 16 greedy tokens exactly."""
    directory, reference = hub_checkpoint(variant, dtype, sharded=dtype == "bfloat16")
    assert (directory / "model.safetensors.index.json").is_file() == (dtype == "bfloat16")
    model = load_pretrained(directory, device="cpu", dtype="float32")
    ids = np.random.default_rng(3).integers(0, 256, (2, 9))
    assert rel_error(model(ids).numpy(), reference_logits(reference, ids).numpy()) < 1e-4
    tokens = model.generate(PROMPT, max_new_tokens=16, stop=())
    assert tokens == reference_greedy(reference, PROMPT, 16)


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_half_checkpoint_loads_in_its_own_dtype(hub_checkpoint, device, dtype):
    """By default a bf16 (fp16) file runs in bf16 (fp16) on every device: the weights are
    the file's numbers, and the logits follow transformers' float32 run of them within the
    dtype's rounding."""
    directory, reference = hub_checkpoint("llama3_rope_tied", dtype, sharded=True)
    model = load_pretrained(directory, device=device)
    assert model.dtype == dtype
    embed = model.weights.embed.numpy()
    expected = reference.model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(embed.astype(np.float32), expected)
    ids = np.array([PROMPT])
    tol = 0.05 if dtype == "bfloat16" else 0.01
    assert rel_error(model(ids).numpy(), reference_logits(reference, ids).numpy()) < tol
    assert len(model.generate(PROMPT, max_new_tokens=6, stop=())) == 6
