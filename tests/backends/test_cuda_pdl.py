"""Kernels captured in a graph read what the kernel before them wrote, weights included.

In a graph capture on sm_90+ each kernel is launched with programmatic dependent launch: it
may start before its predecessor ends, and its griddepcontrol.wait is what makes that
kernel's writes visible. A kernel that loads anything before the wait (the packed-weight
kernels once issued their first weight loads early) can read stale bytes when the
predecessor wrote them. Here a strided setitem kernel rewrites the packed weights and scales
right before each product, and every replay with new weights must equal the eager run.
The race is timing-dependent, so a regression may pass some runs; the test pins the
semantics on the paths the decode steps take (quant_decode.cu or, on sm_90, quant_stream.cu's
bulk copies for one row; quant_skinny.cu for a few)."""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd

DEV = nd.cuda(0)
RNG = np.random.default_rng(20)
gpu = pytest.mark.skipif(not DEV.enabled(), reason=f"cuda disabled: {DEV.reason}")
EPS = 1e-5


def _packed(n: int, k: int, bits: int, group: int | None):
    w = (RNG.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    return nd.QuantizedMatrix.quantize(w, bits, group, True, device=DEV)


def _rewrite(dst: nd.NDArray, src: nd.NDArray) -> None:
    """dst = src by two strided setitem kernels (odd rows last), not a copy node: the
    kernel right before the product is the one that wrote its operand."""
    dst[0::2] = src[0::2]
    dst[1::2] = src[1::2]


def _replays_equal_eager(step, sources, trials=4):
    with DEV.backend.capture() as graph:
        got = step()
    try:
        for trial in range(trials):
            for name, src in sources.items():
                values = src.numpy()
                if name == "scales":
                    fresh = np.abs(RNG.standard_normal(values.shape)).astype(np.float32) / 50
                else:  # any int32 words are valid packed values
                    fresh = RNG.integers(-2**31, 2**31, values.shape, dtype=np.int64)
                src[...] = nd.array(fresh.astype(values.dtype), device=DEV)
            graph.replay()
            want = step()
            np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=f"replay {trial}")
    finally:
        graph.close()


@gpu
@pytest.mark.parametrize("rows,stream", [(1, "off"), (1, "always"), (4, "off")])
@pytest.mark.parametrize("bits,group", [(8, None), (4, 128)])
@pytest.mark.parametrize("last", ["qweight", "scales"])
def test_a_product_reads_the_weights_its_predecessor_wrote(rows, stream, bits, group, last):
    n, k = 1024, 2048
    packed = _packed(n, k, bits, group)
    sources = {"qweight": _packed(n, k, bits, group).qweight,
               "scales": _packed(n, k, bits, group).scales}
    x = nd.array(RNG.standard_normal((rows, k)).astype(np.float32), device=DEV,
                 dtype="bfloat16")
    norm = nd.array(np.ones(k, np.float32), device=DEV, dtype="bfloat16")

    def step():
        for name in sorted(sources, key=lambda name: name == last):  # `last` written last
            _rewrite(getattr(packed, name), sources[name])
        if rows == 1:  # quant_decode.cu or quant_stream.cu: the decode step's norm + product
            with DEV.backend.tuned(quant_stream=stream):
                return nd.rmsnorm_matvec(x, norm, packed, EPS)
        return nd.quant_matmul(x, packed)  # quant_skinny.cu (the word form for int8)

    _replays_equal_eager(step, sources)
