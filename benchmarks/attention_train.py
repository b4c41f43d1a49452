"""Training attention (forward keeping its statistics, then the backward) of needle against
PyTorch's ``scaled_dot_product_attention`` in the same run.

    python -m benchmarks.attention_train --device cuda
    python -m benchmarks.attention_train --device cpu --quick      # a smoke test

Causal grouped-query attention in bf16 at the shapes of models people fine-tune: TinyLlama /
Llama-3.2-1B (head size 64, 32 query heads over 4 or 8 KV heads) and Llama-3.2-3B / Qwen3
(head size 128, 24 query heads over 8 KV heads), batch x sequence of 4 x 512 and 1 x 2,048.
needle runs ``nd.attention_with_stats`` then ``nd.attention_backward`` on heads-first views of
token-major q, k and v projections (as a model's layers hand them over); ``--float32`` also times
needle's float32 kernels on float32 inputs (head size 64 only), the path bf16 attention took
before the tensor-core backward (less the casts). PyTorch runs its SDPA forward and backward
(the flash kernel in bf16). Printed: the median ms of forward + backward and needle's time
over PyTorch's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

SHAPES = [  # batch, q_heads, kv_heads, seq, head_dim
    (4, 32, 4, 512, 64),
    (1, 32, 4, 2048, 64),
    (4, 24, 8, 512, 128),
    (1, 24, 8, 2048, 128),
]
QUICK = [(1, 4, 2, 96, 64)]


def _median_ms(run, sync, warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        run()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _needle(shape, device: str, dtype: str, warmup: int, repeat: int) -> float:
    import needle.backend_ndarray as nd

    b, hq, hkv, s, d = shape
    dev = nd.device_from_name(device)
    rng = np.random.default_rng(0)
    # token-major projections seen heads-first, as a model's q, k and v layers give them
    q, k, v = (nd.array(rng.standard_normal((b, s, h, d)).astype(np.float32), device=dev)
               .astype(dtype).permute((0, 2, 1, 3)) for h in (hq, hkv, hkv))
    dout = nd.array(rng.standard_normal((b, s, hq, d)).astype(np.float32),
                    device=dev).astype(dtype).permute((0, 2, 1, 3))

    def run():
        out, stats = nd.attention_with_stats(q, k, v, causal=True)
        grads = nd.attention_backward(q, k, v, out, dout, causal=True, stats=stats)
        assert grads is not None, "no fused backward for these arrays"

    return _median_ms(run, dev.synchronize, warmup, repeat)


def _torch(shape, device: str, warmup: int, repeat: int) -> float | None:
    try:
        import torch
        import torch.nn.functional as functional
    except ImportError:
        return None
    b, hq, hkv, s, d = shape
    dev = "cuda" if device.startswith("cuda") else "cpu"
    g = torch.Generator(device="cpu").manual_seed(0)
    qkv = torch.randn(b, s, hq + 2 * hkv, d, generator=g).to(dev, torch.bfloat16)
    dout = torch.randn(b, hq, s, d, generator=g).to(dev, torch.bfloat16)

    def run():
        x = qkv.detach().requires_grad_()
        q = x[:, :, :hq].transpose(1, 2)
        k = x[:, :, hq:hq + hkv].transpose(1, 2)
        v = x[:, :, hq + hkv:].transpose(1, 2)
        out = functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(dout)

    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    return _median_ms(run, sync, warmup, repeat)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="one small shape (a smoke test)")
    p.add_argument("--float32", action="store_true",
                   help="also time the float32 kernel on widened inputs (head size 64)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args(argv)
    print(f"{'shape (b, hq, hkv, s, d)':<26} {'needle bf16 ms':>15} {'f32 ms':>8} "
          f"{'torch ms':>9} {'needle/torch':>13}")
    for shape in QUICK if args.quick else SHAPES:
        ours = _needle(shape, args.device, "bfloat16", args.warmup, args.repeat)
        wide = (_needle(shape, args.device, "float32", args.warmup, args.repeat)
                if args.float32 and shape[-1] == 64 else None)
        theirs = _torch(shape, args.device, args.warmup, args.repeat)
        print(f"{str(shape):<26} {ours:>15.3f} "
              f"{'-' if wide is None else f'{wide:.3f}':>8} "
              f"{'-' if theirs is None else f'{theirs:.3f}':>9} "
              f"{'-' if theirs is None else f'{ours / theirs:.2f}x':>13}")


if __name__ == "__main__":
    main()
