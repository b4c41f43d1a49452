"""needle's Llama-family models against Hugging Face transformers on tiny random checkpoints:
logits within 1e-4 (float32) and 32 greedy tokens identical, on every enabled device."""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.errors import GenerationError
from needle.models import Sampler, load_pretrained

from .hf_models import build, reference_logits

PROMPT = [1, 17, 99, 3, 250, 42, 7, 128]


def rel_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def test_logits_match(checkpoints, variant, device):
    directory, hf = checkpoints(variant)
    model = load_pretrained(directory, device=device, dtype="float32")
    ids = np.random.default_rng(1).integers(0, 256, (2, 11))
    logits = model(ids).numpy()
    assert logits.shape == (2, 11, 256)
    assert rel_error(logits, reference_logits(hf, ids).numpy()) < 1e-4


def test_greedy_tokens_match(checkpoints, greedy_reference, variant, device):
    directory, _ = checkpoints(variant)
    model = load_pretrained(directory, device=device, dtype="float32")
    tokens = model.generate(PROMPT, max_new_tokens=32, stop=())
    assert tokens == greedy_reference(variant, PROMPT, 32)


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("name", ["qwen2", "gemma2", "qwen3", "gemma3"])
def test_cached_decode_matches_full_forward(checkpoints, device, name):
    """Prefill + per-token decode steps (the captured path on GPUs) give the logits of a
    full forward pass at every position: fused attention (qwen2), soft-capped windowed
    attention (gemma2), per-head q/k norms (qwen3), two rotary
    tables and windowed layers beside a global one (gemma3)."""
    directory, _ = checkpoints(name)
    model = load_pretrained(directory, device=device, dtype="float32", max_seq_len=40)
    seq = PROMPT + [5, 6, 7, 200, 201, 33]
    full = model(np.array([seq])).numpy()[0]
    decoder = model.decoder()
    steps = [decoder.prefill(PROMPT).numpy()[0]]
    for token in seq[len(PROMPT):]:
        steps.append(decoder.step(token).numpy()[0])
    assert rel_error(np.stack(steps), full[len(PROMPT) - 1:]) < 1e-4
    # where the backend records work (CUDA graphs, Metal), steps after the first replay one
    assert decoder.captured == hasattr(device.backend, "capture")
    # rewinding forgets the newest positions; a new prefill starts from a clean cache
    decoder.rewind(len(PROMPT) + 2)
    redo = [decoder.step(t).numpy()[0] for t in seq[len(PROMPT) + 2:]]
    assert rel_error(np.stack(redo), full[len(PROMPT) + 2:]) < 1e-4
    again = [decoder.prefill(PROMPT[:3]).numpy()[0], decoder.step(PROMPT[3]).numpy()[0]]
    assert rel_error(np.stack(again), full[2:4]) < 1e-4


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral_window"])
def test_five_operation_decode_matches_composed(checkpoints, device, name, monkeypatch):
    """The decode step as five fused operations per layer (rmsnorm_matvec, attention_decode,
    matvec_add, rmsnorm_matvec with SwiGLU, matvec_add; qwen2 adds its QKV bias, qwen3 its
    heads' norms as a sixth, qk_rmsnorm; mistral's window binds in attention_decode) gives
    the composed step's logits and the full forward pass's, in float32 and bfloat16."""
    seq = PROMPT + [5, 6, 7, 200]
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 3e-2)):
        logits = {}
        for choice in ("1", "0"):
            monkeypatch.setenv("NEEDLE_FUSED_DECODE", choice)
            directory, _ = checkpoints(name)
            model = load_pretrained(directory, device=device, dtype=dtype, max_seq_len=32)
            assert all(model.transformer.five_ops) == (choice == "1")
            decoder = model.decoder()
            steps = [decoder.prefill(PROMPT).numpy()[0]]
            steps += [decoder.step(t).numpy()[0] for t in seq[len(PROMPT):]]
            logits[choice] = np.stack(steps).astype(np.float64)
            full = model(np.array([seq])).numpy()[0][len(PROMPT) - 1:].astype(np.float64)
        assert rel_error(logits["1"], logits["0"]) < tol, dtype
        assert rel_error(logits["1"], full) < tol, dtype


@pytest.mark.parametrize("name", ["llama", "llama3_rope_tied"])
def test_folded_norms_match_the_checkpoint_weights(checkpoints, device, name):
    """Where the backend runs a norm inside the next projection (folded_norm_matvec), the
    loaded model holds each layer's QKV and gate/up weights times the preceding norm's
    scale (the checkpoint's tensors as transformers wrote them), unit norms in their place,
    and the head folded with the final norm unless it is the embedding (tied). Elsewhere
    nothing is folded. Logits stay those of transformers (test_logits_match)."""
    from needle.backends.api import has

    directory, hf = checkpoints(name)
    model = load_pretrained(directory, device=device, dtype="float32")
    w, folds = model.weights, has(device.backend, "folded_norm_matvec")
    state = {k: v.detach().double().numpy() for k, v in hf.state_dict().items()}
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}."
        attn = state[p + "input_layernorm.weight"]
        mlp = state[p + "post_attention_layernorm.weight"]
        qkv = np.concatenate([state[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"])
        gate_up = np.concatenate([state[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up")])
        assert layer.norms_folded == folds
        if folds:
            attn_scale, mlp_scale, attn, mlp = attn, mlp, np.ones_like(attn), np.ones_like(mlp)
            qkv, gate_up = qkv * attn_scale, gate_up * mlp_scale
        np.testing.assert_allclose(layer.attn_norm.numpy(), attn, rtol=1e-7)
        np.testing.assert_allclose(layer.mlp_norm.numpy(), mlp, rtol=1e-7)
        np.testing.assert_allclose(layer.qkv.weight.numpy(), qkv, rtol=1e-6)
        np.testing.assert_allclose(layer.gate_up.weight.numpy(), gate_up, rtol=1e-6)
    tied = w.lm_head.weight is w.embed
    assert tied == (name == "llama3_rope_tied")
    assert w.head_folded == (folds and not tied)
    np.testing.assert_allclose(w.embed.numpy(), state["model.embed_tokens.weight"], rtol=1e-7)
    if w.head_folded:
        np.testing.assert_allclose(w.lm_head.weight.numpy(), state["lm_head.weight"]
                                   * state["model.norm.weight"], rtol=1e-6)
        np.testing.assert_allclose(w.final_norm.numpy(), 1.0)


@pytest.mark.parametrize("name", ["llama", "mistral_window", "gemma2"])
def test_a_reused_or_rewound_decoder_decodes_as_a_fresh_one(checkpoints, device, name):
    """A short prompt after a long sequence, and a rewound one, decode as in a fresh
    decoder: a step reads no cache row past its own, so the rows a longer sequence left
    need no clearing (Gemma 2's soft-capped layers too); on GPUs the prompts are padded
    (captured prefills)."""
    from needle.models.decoder import Decoder

    directory, _ = checkpoints(name)
    model = load_pretrained(directory, device=device, dtype="float32", max_seq_len=48)
    decoder = model.decoder()
    long = PROMPT + [5, 6, 7, 8, 9, 10]
    decoder.prefill(long)
    for t in (11, 12, 13):
        decoder.step(t)
    decoder.prefill(PROMPT)
    got = [decoder.step(t).numpy() for t in (5, 6, 7)]
    fresh = Decoder(model)
    fresh.prefill(PROMPT)
    want = [fresh.step(t).numpy() for t in (5, 6, 7)]
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-6, atol=1e-6)
    decoder.rewind(len(PROMPT) + 1)
    again = [decoder.step(t).numpy() for t in (6, 7)]
    np.testing.assert_allclose(np.stack(again), np.stack(want[1:]), rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_greedy_step_on_the_device(checkpoints, device):
    """``Decoder.greedy_step`` (argmax, next token and position kept on the device, captured
    on GPUs) picks what the host sampler picks from ``step``'s logits, also when the caller
    passes a token of its own or rewinds between steps."""
    directory, _ = checkpoints("llama")
    model = load_pretrained(directory, device=device, dtype="float32", max_seq_len=48)
    decoder = model.decoder()
    greedy = Sampler()
    token = greedy(decoder.prefill(PROMPT))
    expected, steps = [], []
    for _ in range(8):
        expected.append(token)
        token = greedy(decoder.step(token).numpy())
    decoder.prefill(PROMPT)
    token = expected[0]
    for _ in range(8):
        steps.append(token)
        token = decoder.greedy_step(token)
        np.testing.assert_allclose(decoder.last_logits.numpy().reshape(-1).argmax(), token)
    assert steps == expected
    assert decoder._greedy is not None or not hasattr(device.backend, "capture")
    # a token the device did not choose, then a rewind: both set the state from the host
    decoder.rewind(len(PROMPT) + 3)
    mine = decoder.greedy_step(7)
    decoder.rewind(len(PROMPT) + 3)
    assert mine == greedy(decoder.step(7).numpy())


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_greedy_stream_matches_greedy_steps_and_undoes_the_step_ahead(checkpoints, device):
    """``Decoder.greedy_stream`` (one step queued ahead of the host's read) yields what
    ``greedy_step`` returns one call at a time; stopping early leaves the decoder as if only
    the tokens taken had been stepped; running out of room raises after the last token."""
    directory, _ = checkpoints("llama")
    model = load_pretrained(directory, device=device, dtype="float32", max_seq_len=24)
    decoder = model.decoder()
    first = Sampler()(decoder.prefill(PROMPT))
    room = 24 - len(PROMPT)
    expected, token = [], first
    for _ in range(room):
        token = decoder.greedy_step(token)
        expected.append(token)
    decoder.prefill(PROMPT)
    assert list(decoder.greedy_stream(first, 12)) == expected[:12]
    assert decoder.length == len(PROMPT) + 12
    assert decoder.last_logits.numpy().reshape(-1).argmax() == expected[11]
    # stop after 5 tokens: the step queued ahead is undone, plain steps carry on from there
    decoder.prefill(PROMPT)
    steps = decoder.greedy_stream(first, 12)
    taken = [next(steps) for _ in range(5)]
    steps.close()
    assert taken == expected[:5]
    assert decoder.length == len(PROMPT) + 5
    assert decoder.greedy_step(taken[-1]) == expected[5]
    # a second stream continues the sequence
    assert list(decoder.greedy_stream(expected[5], 3)) == expected[6:9]
    # 24 positions: 16 steps fit after the 8-token prompt, then the cache is full
    decoder.prefill(PROMPT)
    got = []
    with pytest.raises(GenerationError, match="full"):
        for t in decoder.greedy_stream(first, room + 3):
            got.append(t)
    assert got == expected[:room] and decoder.length == 24
    assert list(decoder.greedy_stream(first, 0)) == []


def test_numpy_later_reads_the_value_at_the_call(device):
    """``NDArray.numpy_later`` returns the array as it was when called, even if work queued
    afterwards changes it before the result is asked for."""
    x = nd.array(np.arange(6, dtype=np.int32).reshape(2, 3), device=device)
    first = x.numpy_later()
    column = x[:, 1].numpy_later()  # strided: compacted on the device first
    x[...] = 7
    later = x.numpy_later()
    np.testing.assert_array_equal(first(), np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(column(), [1, 4])
    np.testing.assert_array_equal(later(), np.full((2, 3), 7))
    assert first().dtype == np.int32 and column().shape == (2,)


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.05), ("float16", 0.01)])
def test_half_precision(checkpoints, device, dtype, tol):
    directory, hf = checkpoints("llama")
    model = load_pretrained(directory, device=device, dtype=dtype)
    assert model.weights.layers[0].qkv.weight.dtype == dtype
    ids = np.array([PROMPT])
    assert rel_error(model(ids).numpy(), reference_logits(hf, ids).numpy()) < tol
    assert len(model.generate(PROMPT, max_new_tokens=4, stop=())) == 4


def test_sharded_checkpoint(tmp_path, checkpoints):
    _, hf = checkpoints("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model = load_pretrained(tmp_path, device="cpu_numpy")
    ids = np.array([PROMPT])
    assert rel_error(model(ids).numpy(), reference_logits(hf, ids).numpy()) < 1e-4


def test_llama_with_biases(tmp_path):
    """Llama's attention_bias (q, k, v and o) and mlp_bias switches."""
    hf = build("llama", tmp_path, attention_bias=True, mlp_bias=True)
    model = load_pretrained(tmp_path, device="cpu_numpy")
    ids = np.array([PROMPT])
    assert model.weights.layers[0].o.bias is not None
    assert rel_error(model(ids).numpy(), reference_logits(hf, ids).numpy()) < 1e-4


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.05), ("float16", 0.01)])
def test_half_precision_decode_matches_forward(checkpoints, device, dtype, tol):
    """The half-precision decode step (on CUDA: a half-precision KV cache written in place,
    q·Kᵀ over the transposed cache, the skinny p·V product) agrees with the forward pass."""
    directory, _ = checkpoints("llama")
    model = load_pretrained(directory, device=device, dtype=dtype, max_seq_len=40)
    seq = PROMPT + [5, 6, 7, 200, 201, 33]
    full = model(np.array([seq])).numpy()[0].astype(np.float64)
    decoder = model.decoder()
    steps = [decoder.prefill(PROMPT).numpy()[0]]
    for token in seq[len(PROMPT):]:
        steps.append(decoder.step(token).numpy()[0])
    assert rel_error(np.stack(steps).astype(np.float64), full[len(PROMPT) - 1:]) < tol
