"""Decode (and prefill) speed of quantized weights against bf16, in one run, on one device.

    python -m benchmarks.quant_decode [--device cuda] [--tokens 256] [--quick]
    python -m benchmarks.quant_decode --device cuda --kernels --no-decode [--shapes 8b]

The model is TinyLlama-1.1B-shaped (hidden 2048, 22 layers, 32 heads, 4 KV heads,
intermediate 5632, vocab 32000) with random weights; ``--quick`` uses a tiny one (a smoke
test on the CPU). Variants: bf16; int8 per channel; int4 groups of 128 and 64 (symmetric and
with offsets); and the formats GGUF files are repacked into at load (``needle.quant.gguf``):
Q8_0 -> int8 groups of 32, Q4_K -> int4 groups of 32 with offsets. Embeddings, norms and
the output head stay bf16 in every variant (as `needle quantize` leaves them).

Printed per variant: decode tokens/s (greedy, the captured decode step, one step queued
ahead), the speed-up over bf16, the bytes of weights one step reads (packed bytes: qweight,
scales, offsets, plus the bf16 head and norms), those bytes x tokens/s as a bandwidth, and
that bandwidth as a % of the device's copy bandwidth (bytes read + written per second of a
1 GiB device-to-device copy, measured in the same run); and prefill tokens/s for a
512-token prompt (``--prefill``) as generation runs it (the decoder's prefill: its bucket's
recorded graph replayed on GPUs; best of 5 after two warm calls).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .cases_array import LAYER_SHAPES

# a Llama-3-8B layer's matrices (n, k) for the kernel table: the same products with 2-5x the
# bytes of the 1.1B model's, so a launch's fixed cost is a smaller share of each
LAYER_SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                   "down": (4096, 14336)}

TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
# name -> (bits, group size (None: per channel), offsets) or None for bf16
VARIANTS = {
    "bf16": None,
    "int8": (8, None, False),
    "int4 g128": (4, 128, False),
    "int4 g64": (4, 64, False),
    "int4 g128 +off": (4, 128, True),
    "gguf Q8_0 (int8 g32)": (8, 32, False),
    "gguf Q4_K (int4 g32 +off)": (4, 32, True),
}


def _config(quick: bool):
    from needle.models import LlamaConfig

    raw = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
           **(TINY if quick else TINYLLAMA)}
    return LlamaConfig.from_dict(raw, source="benchmark config")


class _Source:
    """Random weights: bf16 tensors shared by every variant (made once on the host), packed
    ones drawn per variant (random words: every value of the format occurs)."""

    def __init__(self, cfg, device, fmt):
        self.cfg, self.device, self.fmt = cfg, device, fmt
        self.rng = np.random.default_rng(0)

    def __call__(self, name, shape):
        from needle import backend_ndarray as nd
        from needle.quant.format import QuantSpec

        if self.fmt is not None and name.startswith("model.layers.") and len(shape) == 2:
            bits, group, offsets = self.fmt
            n, k = shape
            spec = QuantSpec(bits, group or k, offsets)
            q = self.rng.integers(-2**31, 2**31 - 1, (n, spec.words(k)), dtype=np.int32)
            s = np.full((n, spec.groups(k)), 0.02 / (127 if bits == 8 else 7), np.float32)
            b = -8 * s if offsets else None
            return nd.QuantizedMatrix.from_packed(q, s, b, spec, k, self.device)
        return nd.array(_bf16(name, shape), device=self.device, dtype="bfloat16")


_HOST: dict[str, np.ndarray] = {}


def _bf16(name, shape):
    from needle.backend_ndarray.dtypes import to_numpy_dtype

    if name not in _HOST:
        rng = np.random.default_rng(abs(hash(name)) % 2**32)
        x = (1 + 0.1 * rng.random(shape, dtype=np.float32) if name.endswith("norm.weight")
             else (rng.random(shape, dtype=np.float32) * 2 - 1) * np.float32(0.035))
        _HOST[name] = x.astype(to_numpy_dtype("bfloat16"))
    return _HOST[name]


def _streamed_bytes(model) -> int:
    """Weight bytes a decode step reads: every weight array except the embedding table."""
    w = model.weights
    return sum(_nbytes(a) for a in w.arrays() if a is not w.embed)


def _nbytes(a) -> int:
    from needle.backend_ndarray.dtypes import ITEMSIZE

    return a.size * ITEMSIZE[a.dtype]


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a 1 GiB device copy (needle's own copy)."""
    from needle import backend_ndarray as nd

    n = (1 << 30) // 4 if device.kind != "cpu" else (1 << 26)
    a = nd.full((n,), 1.0, dtype="float32", device=device)
    b = nd.empty((n,), dtype="float32", device=device)
    for _ in range(2):
        b[...] = a
    device.synchronize()
    reps, start = 10, time.perf_counter()
    for _ in range(reps):
        b[...] = a
    device.synchronize()
    return 2 * n * 4 * reps / (time.perf_counter() - start)


def _measure(cfg, device, fmt, tokens: int, prefill: int):
    from needle.models import LlamaForCausalLM

    model = LlamaForCausalLM(cfg, _Source(cfg, device, fmt), max(prefill, 64 + tokens + 8),
                             device, "bfloat16")
    decoder = model.decoder()
    prompt = list(range(1, 65))
    decoder.prefill(prompt)
    for _ in decoder.greedy_stream(7, 16):  # compile, capture, warm
        pass
    decoder.prefill(prompt)
    device.synchronize()
    start = time.perf_counter()
    made = sum(1 for _ in decoder.greedy_stream(7, tokens))
    decode_s = time.perf_counter() - start
    # the prompt as `generate` runs it: the decoder's prefill, its bucket's recorded graph
    # replayed where the backend records work (the first call warms, the second records)
    ids = [int(i) for i in np.arange(prefill) % (cfg.vocab_size - 1) + 1]
    for _ in range(2):
        decoder.prefill(ids).numpy()
    prefill_s = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        decoder.prefill(ids).numpy()
        prefill_s = min(prefill_s, time.perf_counter() - start)
    streamed = _streamed_bytes(model)
    del decoder, model
    return made / decode_s, streamed, prefill / prefill_s


L2_SPILL = 160 << 20  # bytes of matrix copies a matvec timing cycles through (H100 L2: 50 MB)


def _timed(device, op, reps: int = 20, rounds: int = 5) -> float:
    """Seconds per op: ``reps`` calls captured once (where the backend can) and replayed."""
    from needle.backends.api import has

    backend = device.backend
    op()
    device.synchronize()
    if has(backend, "graphs"):
        with backend.capture() as graph:
            for _ in range(reps):
                op()
        run = graph.replay
    else:
        def run():
            for _ in range(reps):
                op()
    run()
    device.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        device.synchronize()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def _product(x, ws):
    """One product per call, cycling through the copies ``ws`` of the matrix (more bytes than
    the L2 cache holds, so every call reads device memory)."""
    from needle import backend_ndarray as nd

    turn = [0]

    def op():
        w = ws[turn[0] % len(ws)]
        turn[0] += 1
        return nd.quant_matmul(x, w) if isinstance(w, nd.QuantizedMatrix) else x @ w

    return op


def _fused(x, ws, total):
    """``nd.matvec_add`` (the decode step's projection + residual: one kernel where the
    backend fuses it) per call, cycling through the copies ``ws``."""
    from needle import backend_ndarray as nd

    turn = [0]

    def op():
        w = ws[turn[0] % len(ws)]
        turn[0] += 1
        return nd.matvec_add(x, w, total)

    return op


def kernel_table(device, copy: float, quick: bool, shapes: str = "1.1b",
                 only: list[str] | None = None) -> None:
    """Matrix-vector (decode), 8-row (a batched decode step) and 512-row (prefill) products of
    each layer shape: bf16 against each quantized format; GB/s counts the bytes of the
    weights as stored (packed). "fused us": the same product as the decode step runs it,
    ``matvec_add`` (into a residual). ``shapes``: "1.1b" (TinyLlama's layer) or "8b"
    (Llama-3-8B's); ``only``: the variants to time (bf16 always, the ratios' base)."""
    from needle import backend_ndarray as nd

    # one decoder layer's matrices (n, k): fused qkv, o, fused gate/up, down
    layer = LAYER_SHAPES_8B if shapes == "8b" else LAYER_SHAPES
    shapes = [(64, 256), (256, 64)] if quick else list(layer.values())
    rng = np.random.default_rng(0)
    print(f"\n{'shape (n, k)':<14} {'format':<27} {'matvec us':>9} {'GB/s':>6} {'% copy':>7} "
          f"{'x bf16':>7} {'fused us':>8} {'GB/s':>6} {'8-row us':>8} {'/ bf16':>7} "
          f"{'512-row us':>10} {'/ bf16':>7}")
    for n, k in shapes:
        xv = nd.array(rng.standard_normal((1, k)).astype(np.float32), device=device,
                      dtype="bfloat16")
        xm = nd.array(rng.standard_normal((512, k)).astype(np.float32), device=device,
                      dtype="bfloat16")
        x8 = nd.array(rng.standard_normal((8, k)).astype(np.float32), device=device,
                      dtype="bfloat16")  # a batched decode step of 8 sequences
        base = base_mm = base_8 = None
        for name, fmt in VARIANTS.items():
            if only and fmt is not None and name not in only:
                continue
            if fmt is None:
                nbytes = n * k * 2
                copies = max(1, -(-L2_SPILL // nbytes))
                w = [nd.array(_bf16(f"w{n}x{k}", (n, k)), device=device,
                              dtype="bfloat16").transpose() for _ in range(copies)]
            else:
                w = [_Source(None, device, fmt)(f"model.layers.0.w{n}x{k}", (n, k))]
                nbytes = w[0].nbytes
                w += [_Source(None, device, fmt)(f"model.layers.0.w{n}x{k}", (n, k))
                      for _ in range(-(-L2_SPILL // nbytes) - 1)]
            reps = len(w) * max(1, 40 // len(w))
            t = _timed(device, _product(xv, w), reps=reps)
            dense = [a.transpose() for a in w] if fmt is None else w  # (n, k) as stored
            total = nd.array(np.zeros((1, n), np.float32), device=device, dtype="bfloat16")
            t_fused = _timed(device, _fused(xv, dense, total), reps=reps)
            t_mm = _timed(device, _product(xm, w[:1]), reps=5, rounds=3)
            t_8 = _timed(device, _product(x8, w), reps=reps)
            base = base or t
            base_mm = base_mm or t_mm
            base_8 = base_8 or t_8
            print(f"{f'({n}, {k})':<14} {name:<27} {t * 1e6:9.1f} {nbytes / t / 1e9:6.0f} "
                  f"{100 * nbytes / t / copy:6.0f}% {base / t:7.2f} {t_fused * 1e6:8.1f} "
                  f"{nbytes / t_fused / 1e9:6.0f} {t_8 * 1e6:8.1f} {t_8 / base_8:7.2f} "
                  f"{t_mm * 1e6:10.1f} {t_mm / base_mm:7.2f}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run")
    parser.add_argument("--kernels", action="store_true", help="also time each layer matrix")
    parser.add_argument("--no-decode", action="store_true", help="skip the whole-model runs")
    parser.add_argument("--shapes", choices=("1.1b", "8b"), default="1.1b",
                        help="the layer whose matrices --kernels times")
    args = parser.parse_args(argv)
    from needle import backend_ndarray as nd

    device = nd.device_from_name(args.device) if args.device else nd.default_device()
    cfg = _config(args.quick)
    copy = copy_bandwidth(device)
    if args.kernels:
        kernel_table(device, copy, args.quick, args.shapes, args.only)
    rows = []
    for name, fmt in VARIANTS.items():
        if args.no_decode or (args.only and name not in args.only):
            continue
        tps, streamed, prefill = _measure(cfg, device, fmt, args.tokens, args.prefill)
        rows.append((name, tps, streamed, prefill))
        print(f"  {name}: {tps:.1f} tok/s", flush=True)
    if not rows:
        return
    base = next((r[1] for r in rows if r[0] == "bf16"), None)
    base_pf = next((r[3] for r in rows if r[0] == "bf16"), None)
    print(f"\ndevice {device.name}; copy bandwidth {copy / 1e9:.0f} GB/s (read + write)")
    print(f"{'variant':<27} {'tok/s':>8} {'x bf16':>7} {'MB/token':>9} {'GB/s':>7} "
          f"{'% copy':>7} {'prefill tok/s':>14} {'x bf16':>7}")
    for name, tps, streamed, prefill in rows:
        bw = streamed * tps
        print(f"{name:<27} {tps:8.1f} {tps / base if base else 0:7.2f} {streamed / 1e6:9.1f} "
              f"{bw / 1e9:7.0f} {100 * bw / copy:6.0f}% {prefill:14.0f} "
              f"{prefill / base_pf if base_pf else 0:7.2f}")


if __name__ == "__main__":
    main()
