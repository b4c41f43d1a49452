"""Decode steps recorded one a band of positions (``Decoder.bands``, from
``nd.attention_decode_bands``): a recorded step's attention kernel is chosen when it is
recorded, so where the backend's choice depends on the positions read, each band records
its own step. The numbers are transformers' in every band."""

from __future__ import annotations

import numpy as np
import pytest

from needle.models import load_pretrained
from needle.models.decoder import Decoder

from ..conftest import devices_with
from .hf_models import build, reference_logits
from .test_llama_vs_hf import PROMPT, rel_error

BANDED = pytest.mark.parametrize("device", devices_with("decode_bands"), indirect=True,
                                 ids=lambda d: d.name)


def test_each_step_runs_in_its_band(checkpoints, device):
    """A decoder told of bands (12, 20, capacity) gives each step its band's bound, records
    a step a band where the backend records work, and chooses the tokens of one band."""
    directory, _ = checkpoints("llama")
    model = load_pretrained(directory, device=device, dtype="float32", max_seq_len=48)
    one, banded = Decoder(model), Decoder(model)
    assert one.bands[-1] == 48
    one.bands, banded.bands = (48,), (12, 20, 48)
    token = int(one.prefill(PROMPT).numpy().argmax())
    expected = [token] + list(one.greedy_stream(token, 20))
    banded.prefill(PROMPT)
    got, bounds = [token], []
    for _ in range(20):
        got.append(banded.greedy_step(got[-1]))
        bounds.append(banded.state.max_positions)
    assert got == expected
    lengths = range(len(PROMPT) + 1, len(PROMPT) + 21)
    assert bounds == [12 if n <= 12 else 20 if n <= 20 else 48 for n in lengths]
    if hasattr(device.backend, "capture"):
        assert {band for kind, band in banded._recorded if kind == "greedy"} == {0, 1, 2}


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """A tiny Llama of 64-wide heads (those the CUDA cluster kernels take) written by
    transformers in bfloat16, with room for 4,096 positions (the loader's default)."""
    directory = tmp_path_factory.mktemp("llama_d64")
    # two 64-wide query heads on one KV head; weights smaller than the other tests' (0.1,
    # not 0.2) keep bf16's rounding ~1% of the logits (~10% with four heads at 0.2)
    hf = build("llama", directory, dtype="bfloat16", hidden_size=128, intermediate_size=256,
               num_attention_heads=2, num_key_value_heads=1, initializer_range=0.1,
               max_position_embeddings=4096)
    return directory, hf


@BANDED
def test_a_step_a_band_decodes_like_transformers(device, long_llama):
    """Across the first band's bound (2,048 positions on an sm_90 GPU): prefill, then steps
    on both sides, each band eager once, then recorded and replayed; every step's logits
    are transformers' for the whole sequence, and a greedy stream across the bound chooses
    tokens that transformers ranks first (within bf16's rounding)."""
    directory, hf = long_llama
    model = load_pretrained(directory, device=device, dtype="bfloat16", max_seq_len=4096)
    decoder = model.decoder()
    if len(decoder.bands) < 2:
        pytest.skip(f"one band on {device.name} (needs the sm_90 cluster decode kernels; "
                    "NEEDLE_DECODE_BANDS=0 or NEEDLE_DECODE_CLUSTER=0 turn them off)")
    bound = decoder.bands[0]
    seq = np.random.default_rng(3).integers(3, 256, bound + 6).tolist()
    start = bound - 6
    steps = [decoder.prefill(seq[:start]).numpy()[0]]
    steps += [decoder.step(t).numpy()[0] for t in seq[start:-1]]
    want = reference_logits(hf, [seq[:-1]])[0, start - 1:].numpy()
    assert rel_error(np.stack(steps).astype(np.float64), want) < 3e-2
    if hasattr(device.backend, "capture"):
        assert set(decoder._recorded) == {("step", 0), ("step", 1)}

    prompt = seq[:bound - 4]
    token = int(decoder.prefill(prompt).numpy().argmax())
    chosen = [token] + list(decoder.greedy_stream(token, 8))
    assert decoder.length == bound + 4  # the stream crossed the bound
    logits = reference_logits(hf, [prompt + chosen[:-1]])[0, len(prompt) - 1:].numpy()
    top = logits.max(axis=1)
    margin = 3e-2 * np.abs(logits).max()
    assert all(logits[i, t] >= top[i] - margin for i, t in enumerate(chosen)), chosen
