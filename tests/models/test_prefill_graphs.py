"""Captured prefills (``needle/models/prefill_graphs.py``): prompts padded to their length's
bucket and replayed from a recorded graph give the logits and decode steps of the eager
prefill, on the transformers-written checkpoints of ``hf_models.py``."""

from __future__ import annotations

import numpy as np
import pytest

from needle.models import load_pretrained
from needle.models.decoder import Decoder
from needle.models.prefill_graphs import MAX_TOKENS, MIN_BUCKET, bucket_of

from ..conftest import devices_with

RECORDING = pytest.mark.parametrize("device", devices_with("graphs"), indirect=True,
                                    ids=lambda d: d.name)
RNG = np.random.default_rng(0)


def test_buckets_pad_under_an_eighth():
    assert [bucket_of(n, 10**6) for n in (1, 63, 64, 65, 200, 2048, 2049)] == \
        [64, 64, 64, 128, 256, 2048, 2304]
    assert bucket_of(5, 48) == 48  # never past the cache
    for n in range(1, 9000, 7):
        rows = bucket_of(n, 10**6)
        assert n <= rows and rows % MIN_BUCKET == 0
        assert rows - n < max(MIN_BUCKET, n / 8)


def test_a_bad_graph_count_is_a_clear_error(monkeypatch):
    from needle.errors import ArgumentError
    from needle.models.prefill_graphs import _limit_from_env

    monkeypatch.setenv("NEEDLE_PREFILL_GRAPHS", "many")
    with pytest.raises(ArgumentError, match="NEEDLE_PREFILL_GRAPHS must be a whole number"):
        _limit_from_env()
    monkeypatch.setenv("NEEDLE_PREFILL_GRAPHS", "2")
    assert _limit_from_env() == 2


def _models(checkpoints, device, monkeypatch, name="llama", max_seq_len=128):
    """(the model, a decoder that prefills eagerly); the model's own decoder captures."""
    directory, _ = checkpoints(name)
    model = load_pretrained(directory, device=device, dtype="float32", max_seq_len=max_seq_len)
    monkeypatch.setenv("NEEDLE_PREFILL_GRAPHS", "0")
    eager = Decoder(model)
    monkeypatch.delenv("NEEDLE_PREFILL_GRAPHS")
    return model, eager


def _prompt(n: int) -> list[int]:
    return [int(t) for t in RNG.integers(1, 256, n)]


@RECORDING
def test_replayed_prefills_match_eager(checkpoints, device, monkeypatch):
    """Prompts of several lengths in one bucket: the first runs eagerly (padded), the second
    is captured, the rest replay; each gives the eager prefill's logits, the decode steps
    after it match, and the logits returned stay valid after the next prefill."""
    model, eager = _models(checkpoints, device, monkeypatch)
    decoder = model.decoder()
    assert decoder.prefills.applies(5) and not eager.prefills.applies(5)
    kept = []
    for n in (5, 9, 37, 64, 2, 30):
        prompt = _prompt(n)
        got, want = decoder.prefill(prompt), eager.prefill(prompt)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
        kept.append((got, want.numpy()))
        steps = [(decoder.step(t).numpy(), eager.step(t).numpy()) for t in (3, 4)]
        for a, b in steps:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        assert decoder.length == eager.length == n + 2
    assert decoder.prefills.captured == [64]
    for got, want in kept:  # copies, not the graph's output buffer
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    # the graph's working memory (blocks its capture freed and reused) is not the cache's:
    # emptying the cache leaves the replay right
    device.backend.empty_cache()
    prompt = _prompt(20)
    np.testing.assert_allclose(decoder.prefill(prompt).numpy(), eager.prefill(prompt).numpy(),
                               rtol=1e-5, atol=1e-5)


@RECORDING
def test_graphs_closed_by_another_part_are_recorded_again(checkpoints, device, monkeypatch):
    """A recorded prefill or decode step that something else closed (leaving a process
    group closes the graphs that recorded its collectives) is recorded again at its next
    use, with the eager results, instead of failing."""
    model, eager = _models(checkpoints, device, monkeypatch)
    decoder = model.decoder()
    for n in (5, 9):  # the bucket's prefill eager, then captured
        decoder.prefill(_prompt(n))
        eager.prefill(_prompt(n))
        for t in (3, 4, 5):  # the step eager, captured, replayed
            decoder.step(t)
            eager.step(t)
    graphs = [decoder.prefills._buckets[64].graph] + [g for g, _ in decoder._recorded.values()]
    assert len(graphs) == 2 and all(g is not None for g in graphs)
    for graph in graphs:
        graph.close(because="closed by the test")
    prompt = _prompt(11)
    np.testing.assert_allclose(decoder.prefill(prompt).numpy(), eager.prefill(prompt).numpy(),
                               rtol=1e-5, atol=1e-5)
    for t in (6, 7):
        np.testing.assert_allclose(decoder.step(t).numpy(), eager.step(t).numpy(),
                                   rtol=1e-5, atol=1e-5)
    assert decoder.prefills.captured == [64] and not decoder.prefills._buckets[64].graph.closed
    assert [g.closed for g, _ in decoder._recorded.values()] == [False]


@RECORDING
def test_at_most_limit_graphs_are_kept(checkpoints, device, monkeypatch):
    """With NEEDLE_PREFILL_GRAPHS=1, a second bucket's capture gives the first one's graph
    back (least recently used first); the results stay those of the eager prefill."""
    model, eager = _models(checkpoints, device, monkeypatch)
    monkeypatch.setenv("NEEDLE_PREFILL_GRAPHS", "1")
    decoder = Decoder(model)
    for n, captured in ((10, []), (12, [64]), (70, [64]), (80, [128]), (11, [128]),
                        (13, [64])):
        prompt = _prompt(n)
        np.testing.assert_allclose(decoder.prefill(prompt).numpy(),
                                   eager.prefill(prompt).numpy(), rtol=1e-5, atol=1e-5)
        assert decoder.prefills.captured == captured, n


@RECORDING
def test_long_prompts_run_eagerly_windows_and_soft_caps_are_captured(checkpoints, device,
                                                                   monkeypatch):
    """Prompts past MAX_TOKENS prefill as they are; a sliding window (Mistral's) and Gemma
    2's soft-capped windowed layers, both inside the fused kernel, are captured and replay
    the eager prefill's logits."""
    model, _ = _models(checkpoints, device, monkeypatch)
    decoder = model.decoder()
    assert decoder.prefills.rows(MAX_TOKENS + 1) == MAX_TOKENS + 1
    assert decoder.prefills.rows(3) == 64
    for name in ("mistral_window", "gemma2"):
        captured, eager = _models(checkpoints, device, monkeypatch, name=name)
        decoder = captured.decoder()
        prompt = _prompt(9)
        for _ in range(3):
            np.testing.assert_allclose(decoder.prefill(prompt).numpy(),
                                       eager.prefill(prompt).numpy(), rtol=1e-5, atol=1e-5)
        assert decoder.prefills.applies(9) and decoder.prefills.captured == [64], name
