"""Attention at the head sizes of real models on every enabled device.

Llama-3-8B and Mistral-7B use head_dim 128, whose fused attention tiles do not fit in Metal's
32 KiB of threadgroup memory; the GPU backend then composes attention from matmul, softmax
and a causal mask. Both paths must agree with the reference.
"""

import numpy as np
import pytest

import needle.backend_ndarray as nd
from tests.conftest import assert_close

CASES = [  # batch, q_heads, kv_heads, q_len, capacity, kv_len, head_dim, causal
    (1, 4, 2, 3, 10, 7, 128, True),
    (2, 2, 1, 5, 5, 5, 96, False),
    (1, 8, 2, 1, 16, 9, 128, True),   # a decode step over a partly filled cache
    (1, 2, 2, 4, 8, 6, 256, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hd{c[6]}-q{c[3]}-kv{c[5]}")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_attention_large_head_dims(device, case, dtype):
    b, hq, hkv, sq, cap, kv_len, d, causal = case
    rng = np.random.default_rng(hash(case) % 2**32)
    q, k, v = (rng.standard_normal(s) for s in ((b, hq, sq, d), (b, hkv, cap, d), (b, hkv, cap, d)))
    outs = [nd.attention(nd.array(q, device=dev, dtype=dtype), nd.array(k, device=dev, dtype=dtype),
                         nd.array(v, device=dev, dtype=dtype), causal=causal, kv_len=kv_len).numpy()
            for dev in (device, nd.cpu_numpy())]
    assert_close(outs[0], outs[1], dtype, kind="reduction")
