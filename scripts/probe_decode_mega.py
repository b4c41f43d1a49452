"""Probe the experimental persistent decode kernel (kernels/decode_mega.cu) on CUDA.

Builds the 1.1B benchmark model (random weights), prefills a prompt, then for the token at
position P runs every layer two ways from the same residual stream: the five fused
operations a layer (``Transformer._fused_layer``, what the decoder runs) and one launch of
``decode_layers*``. Prints their agreement (x after 1, 2 and all layers), the time of each
(the layers captured in a graph, replayed), the kernel's time with parts switched off
(``--flags``: docs of ``Params::flags`` in the kernel) and group 0's time per stage.
docs/cuda_notes.md v22 has the figures and what they say.

    python scripts/probe_decode_mega.py [--position 128] [--flags 0] [--parts 7,6]
    compute-sanitizer python scripts/probe_decode_mega.py --check-only
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

PARAMS = struct.Struct("8q2fi4x")  # decode_mega.cu's Params
CONSUMER_WARPS, PRODUCER_WARPS, PAGES, PAGE, MAX_ROWS = 16, 4, 5, 28672, 512
STAGES = ["qkv rows", "qkv out + barrier", "attention + barrier", "o input + rows",
          "o out + barrier", "gu input + rows", "gu out + barrier", "down input + rows",
          "down out + barrier"]


def _address(a) -> int:
    from needle.backend_ndarray.dtypes import ITEMSIZE

    h = a._handle
    return h.buffer.handle + h.buffer.offset + a._offset * ITEMSIZE[a.dtype]


def _median_ms(be, fn, reps: int = 7, n: int = 50) -> float:
    times = []
    for _ in range(reps):
        be.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        be.synchronize()
        times.append((time.perf_counter() - t) / n * 1e3)
    return statistics.median(times)


def main() -> None:  # noqa: PLR0915 - one probe, read top to bottom
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--position", type=int, default=128)
    ap.add_argument("--flags", type=int, default=0, help="the kernel's flags for the checks")
    ap.add_argument("--parts", default="7,6,1,2,4,39",
                    help="flags to time besides --flags (comma-separated)")
    ap.add_argument("--check-only", action="store_true",
                    help="only the agreement checks (e.g. under compute-sanitizer)")
    args = ap.parse_args()

    from benchmarks import cases_llm
    from benchmarks.runner import Context
    from cuda.bindings import driver as cu

    import needle.backend_ndarray as nd

    dev = nd.cuda()
    be = dev.backend
    models = cases_llm._Models(Context(device=dev, frameworks={}, quick=False))
    model = models.model
    tr, cfg = model.transformer, model.transformer.cfg
    layers = tr.weights.layers
    if not (all(tr.five_ops) and all(layer.norms_folded for layer in layers)):
        raise SystemExit("the probe needs the five-operation layers with folded norms")
    decoder = model.decoder()
    state, cache = decoder.state, decoder.cache
    p = args.position
    if not 1 <= p < cache.capacity:
        raise SystemExit(f"--position must be in 1..{cache.capacity - 1} (the model's cache)")
    decoder.prefill(cases_llm._prompt(p, cfg.vocab_size)[0])
    state.set(7, p)
    x0 = tr._embed(state.token)

    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q_heads, kv_heads, d, n_layers = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, len(layers)
    group = q_heads // kv_heads
    dt = model.dtype
    sms = int(cu.cuDeviceGetAttribute(
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0)[1])
    splits = min(32, sms // kv_heads)
    table = nd.NDArray(np.array([[_address(w.qkv.weight), _address(w.o.weight),
                                  _address(w.gate_up.weight), _address(w.down.weight),
                                  _address(cache.keys[i]), _address(cache.values[i])]
                                 for i, w in enumerate(layers)], np.int64), device=dev)
    scratch = [nd.empty(((q_heads + 2 * kv_heads) * d,), dt, dev),  # qkv
               nd.empty((q_heads * d,), dt, dev),  # attention output
               nd.empty((inter,), dt, dev),  # silu(g) u
               nd.empty((q_heads * splits * d,), "float32", dev),  # partial outputs
               nd.empty((q_heads * splits * 2,), "float32", dev)]  # partial (m, l)
    sync = nd.zeros((2,), "int32", dev)
    stamps = nd.zeros((n_layers * 10,), "int64", dev)
    kern = be._kernel("decode_mega", f"decode_layers{d}g{group}_"
                                     f"{'bf16' if dt == 'bfloat16' else 'f16'}")
    vec = max(2 * max(hidden, inter, q_heads * d),
              4 * (group * d + CONSUMER_WARPS * group * (d + 2)))
    shared = PAGES * PAGE + 16 * PAGES + MAX_ROWS * 4 + 128 + vec
    kern.reserve_shared(shared)
    threads = 32 * (CONSUMER_WARPS + PRODUCER_WARPS)

    def mega(x, n=n_layers, flags=args.flags):
        params = PARAMS.pack(hidden, inter, q_heads, kv_heads, n, cache.capacity,
                             tr.rope.cos.shape[0], splits, cfg.rms_norm_eps, cfg.attn_scale,
                             flags)
        arrays = [table, x, *scratch, tr.rope.cos, tr.rope.sin, state.position, sync, stamps]
        be.queue.dispatch(kern, (sms, 1, 1), (threads, 1, 1),
                          [a._handle.buffer for a in arrays], params, shared)

    def five_ops(x, n=n_layers):
        for i in range(n):
            x = tr._fused_layer(i, layers[i], x, state, cache)
        return x

    def copy(a):
        return nd.NDArray(a.numpy(), device=dev, dtype=a.dtype)

    print(f"{sms} groups of {threads} threads, {shared} bytes of shared memory, "
          f"position {p}")
    for n in (1, 2, n_layers):
        ref = five_ops(copy(x0), n).numpy().astype(np.float32).ravel()
        x = copy(x0)
        mega(x, n)
        got = x.numpy().astype(np.float32).ravel()
        err = np.abs(ref - got).max() / np.abs(ref).max()
        print(f"after {n} layers: max |x| {np.abs(ref).max():.3f}, max difference / max |x| "
              f"{err:.2e}")
    if args.check_only:
        return

    xa, xb = copy(x0), copy(x0)
    with be.capture() as g_five:
        five_ops(xa)
    with be.capture() as g_mega:
        mega(xb)
    weights = sum(int(np.prod(a.shape)) * 2 for w in layers
                  for a in (w.qkv.weight, w.o.weight, w.gate_up.weight, w.down.weight))
    kv = n_layers * kv_heads * (p + 1) * d * 2 * 2
    rows = [("five operations a layer (graph)", _median_ms(be, g_five.replay)),
            (f"decode_layers, flags {args.flags} (graph)", _median_ms(be, g_mega.replay))]
    for flags in (int(f) for f in args.parts.split(",") if f):
        rows.append((f"decode_layers, flags {flags}", _median_ms(be, lambda f=flags: mega(xb,
                                                                                    flags=f))))
    mega(xb)
    be.synchronize()
    st = stamps.numpy().reshape(n_layers, 10).astype(np.int64)
    gaps = np.diff(st, axis=1) / 1e3
    print(f"group 0's time per stage, µs (median over layers), flags {args.flags}:")
    for j, name in enumerate(STAGES):
        print(f"  {name:22s} {np.median(gaps[:, j]):6.2f}")
    print(f"\n{n_layers} layers' weights {weights / 1e9:.3f} GB + keys and values "
          f"{kv / 1e6:.1f} MB")
    for name, ms in rows:
        print(f"{name:36s} {ms:.4f} ms  {(weights + kv) / ms / 1e6:6.0f} GB/s")


if __name__ == "__main__":
    main()
