"""``nd.sample`` (capability ``sampling``): the reference's filters against transformers'
logits processors, its draws against the distribution, and every backend that declares the
capability against the reference, token for token."""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backends.numpy_ref import sampling as ref
from needle.errors import DeviceError, DTypeError, ShapeError

from ..conftest import check_unsupported_dtype, devices_with


@pytest.mark.parametrize("top_k,top_p,min_p,penalty", [
    (0, 1.0, 0.0, 1.0), (5, 1.0, 0.0, 1.0), (0, 0.7, 0.0, 1.0), (20, 0.5, 0.0, 1.0),
    (0, 1.0, 0.1, 1.0), (30, 0.9, 0.05, 1.3), (0, 1.0, 0.0, 0.7)])
def test_filters_match_transformers_processors(top_k, top_p, min_p, penalty):
    """Repetition penalty, temperature, top-k, top-p and min-p, in transformers' order and
    with its meaning: the same distribution as its logits processors."""
    import torch
    from transformers.generation import logits_process as lp
    logits = np.random.default_rng(0).standard_normal(100) * 3
    seen_ids = [3, 17, 17, 42, 99]
    temperature = 0.7
    scores = torch.tensor(logits[None], dtype=torch.float64)
    procs = [lp.RepetitionPenaltyLogitsProcessor(penalty)] if penalty != 1 else []
    procs += [lp.TemperatureLogitsWarper(temperature)]
    procs += [lp.TopKLogitsWarper(top_k)] if top_k else []
    procs += [lp.TopPLogitsWarper(top_p)] if top_p < 1 else []
    procs += [lp.MinPLogitsWarper(min_p)] if min_p else []
    for proc in procs:
        scores = proc(torch.tensor([seen_ids]), scores)
    expected = torch.softmax(scores, -1)[0].numpy()
    seen = np.zeros(100, bool)
    seen[seen_ids] = True
    actual = ref.probabilities(ref.penalize(logits, seen, penalty), temperature, top_k, top_p,
                               min_p)
    np.testing.assert_allclose(actual, expected, rtol=1e-9, atol=1e-12)


def test_ties_at_a_cut_are_kept_together():
    """Value cut-offs: tokens tied with the last one kept are kept too."""
    z = np.array([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    assert (ref.probabilities(z, 1.0, 2, 1.0, 0.0) > 0).tolist() == [True] * 4 + [False] * 2
    p = ref.probabilities(z, 1.0, 0, 0.3, 0.0)
    assert (p > 0).tolist() == [True, False, False, False, False, False]
    p = ref.probabilities(z, 1.0, 0, 0.5, 0.0)
    assert (p > 0).tolist() == [True] * 4 + [False] * 2


def test_uniform_is_a_fixed_function_of_seed_and_position():
    """The draw's counter-based hash, which every backend must reproduce bit for bit:
    pinned values, and a uniform spread."""
    assert [ref.uniform(0, p) for p in range(3)] == [ref.uniform(0, p) for p in range(3)]
    assert ref.uniform(-1, 5) == ref.uniform(0xFFFFFFFF, 5)  # the seed's 32 bits
    values = np.array([ref.uniform(7, p) for p in range(20000)])
    assert values.min() >= 0 and values.max() < 1
    assert abs(values.mean() - 0.5) < 0.01 and abs(values.var() - 1 / 12) < 0.003
    assert len({ref.uniform(s, 5) for s in range(1000)}) > 990


def test_draws_follow_the_distribution():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    draws = [ref.draw(p, ref.uniform(0, position)) for position in range(4000)]
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 4000, p, atol=0.03)


def _case(rng, rows, vocab, dtype, settings):
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    if dtype != "float32":
        logits = logits.astype(nd.dtypes.to_numpy_dtype(dtype)).astype(np.float32)
    params = np.array([settings] * rows, np.float32)
    seeds = rng.integers(-2**31, 2**31, rows).astype(np.int32)
    positions = rng.integers(0, 100000, rows).astype(np.int32)
    seen = rng.random((rows, vocab)) < 0.05
    return logits, params, seeds, positions, seen


def _reference(logits, params, seeds, positions, seen, dtype):
    dev = nd.cpu_numpy()
    seen = nd.array(seen, device=dev, dtype="bool")
    out = nd.sample(nd.array(logits, device=dev, dtype=dtype), nd.array(params, device=dev),
                    nd.array(seeds, device=dev), nd.array(positions, device=dev), seen)
    return out.numpy(), seen.numpy()


SETTINGS = {"greedy": (0, 0, 1, 0, 1), "plain": (1.0, 0, 1, 0, 1), "top_k": (0.8, 7, 1, 0, 1),
            "top_p": (0.8, 0, 0.9, 0, 1), "min_p": (1.2, 0, 1, 0.05, 1),
            "all": (0.7, 40, 0.95, 0.01, 1.3), "penalty_greedy": (0, 0, 1, 0, 1.5),
            "cold": (0.05, 0, 0.5, 0, 1)}


# the backends that sample on the device (capability "sampling"); the others sample on the host
ON_DEVICE = pytest.mark.parametrize("device", devices_with("sampling"), indirect=True,
                                    ids=lambda d: d.name)


@ON_DEVICE
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", list(SETTINGS))
@pytest.mark.parametrize("vocab", [7, 1001, 32000])
def test_devices_match_the_reference(device, dtype, case, vocab):
    """Every backend with the capability picks the reference's tokens and marks them seen
    (float32 rounding may move a boundary: at most 1 row in 64 may differ)."""
    if check_unsupported_dtype(device, dtype):
        return
    rng = np.random.default_rng(vocab)
    rows = 64
    logits, params, seeds, positions, seen = _case(rng, rows, vocab, dtype, SETTINGS[case])
    want, want_seen = _reference(logits, params, seeds, positions, seen, dtype)
    seen_dev = nd.array(seen, device=device, dtype="bool")
    got = nd.sample(nd.array(logits, device=device, dtype=dtype),
                    nd.array(params, device=device), nd.array(seeds, device=device),
                    nd.array(positions, device=device), seen_dev).numpy()
    assert ((got >= 0) & (got < vocab)).all()
    assert (got != want).sum() <= 1, (got, want)
    np.testing.assert_array_equal(seen_dev.numpy()[got == want], want_seen[got == want])


@ON_DEVICE
@pytest.mark.parametrize("case", ["top_k", "top_p", "all"])
def test_a_cut_inside_a_crowd_of_equal_logits(device, case):
    """31,900 of a 32k row tie at the largest value (one bin of every radix digit, so the
    selects' passes see them all, and each weighs exactly 2^24 in fixed point) and the rest
    lie below: the cut falls inside the crowd, which is kept whole, and the device's tokens
    are the reference's."""
    rng = np.random.default_rng(3)
    args = list(_case(rng, 16, 32000, "float32", SETTINGS[case]))
    args[0][:, :100] = np.minimum(args[0][:, :100], 2.0)
    args[0][:, 100:] = 3.0
    want, _ = _reference(*args, "float32")
    assert (want >= 100).all()
    dev = [nd.array(a, device=device, dtype="bool" if a.dtype == bool else None) for a in args]
    assert nd.sample(*dev).numpy().tolist() == want.tolist()


@ON_DEVICE
def test_large_vocabulary(device):
    """Llama 3's 128256-token vocabulary, one row."""
    rng = np.random.default_rng(1)
    args = _case(rng, 2, 128256, "float32", SETTINGS["all"])
    want, _ = _reference(*args, "float32")
    dev = [nd.array(a, device=device, dtype="bool" if a.dtype == bool else None) for a in args]
    assert nd.sample(*dev).numpy().tolist() == want.tolist()


def test_bad_inputs():
    dev = nd.cpu_numpy()
    logits = nd.zeros((2, 10), device=dev)
    good = dict(params=nd.zeros((2, 5), device=dev), seeds=nd.zeros((2,), "int32", dev),
                positions=nd.zeros((2,), "int32", dev), seen=nd.zeros((2, 10), "bool", dev))
    with pytest.raises(ShapeError, match="floating-point logits of shape"):
        nd.sample(nd.zeros((10,), device=dev), **good)
    with pytest.raises(DTypeError, match="seeds must be a compact int32 array"):
        nd.sample(logits, **{**good, "seeds": nd.zeros((2,), "int64", dev)})
    with pytest.raises(DTypeError, match="seen must be a compact bool array"):
        nd.sample(logits, **{**good, "seen": nd.zeros((2, 9), "bool", dev)})
    if nd.cpu().enabled():
        with pytest.raises(DeviceError, match="cannot sample on the device"):
            cpu = nd.cpu()
            nd.sample(nd.zeros((2, 10), device=cpu),
                      **{k: v.to(cpu) for k, v in good.items()})
