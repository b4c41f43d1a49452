"""Compile time, replay time and launches per step of the compiled MLP and GPT training
steps (issue 13), with and without elementwise fusion:
``python scripts/compile_stats.py [device]`` (default cuda)."""

import sys
import time

import numpy as np

import needle as ndl
from needle import nn, optim

dev = ndl.backend_ndarray.device_from_name(sys.argv[1] if len(sys.argv) > 1 else "cuda")
rng = np.random.default_rng(0)


def data(x, y):
    return (ndl.Tensor(x, device=dev, requires_grad=False),
            ndl.Tensor(y, device=dev, requires_grad=False))


def mlp():
    ndl.init.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 1024, device=dev), nn.ReLU(),
                          nn.Linear(1024, 1024, device=dev), nn.ReLU(),
                          nn.Linear(1024, 10, device=dev))
    opt = optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.SoftmaxLoss()

    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step, data(rng.standard_normal((512, 784)).astype(np.float32),
                      rng.integers(0, 10, 512))


def gpt(low: bool):
    ndl.init.manual_seed(0)
    embed = nn.Embedding(4096, 512, device=dev)
    body = nn.Transformer(512, 2048, 6, num_heads=8, max_len=256, batch_first=True, device=dev)
    head = nn.Linear(512, 4096, device=dev)
    opt = optim.AdamW(embed.parameters() + body.parameters() + head.parameters(), lr=3e-4)
    loss_fn = nn.SoftmaxLoss()

    def step(x, y):
        opt.zero_grad()
        with ndl.autocast("bfloat16", enabled=low):
            loss = loss_fn(head(body(embed(x))), y)
        loss.backward()
        opt.step()
        return loss

    ids = rng.integers(0, 4096, (16, 257))
    return step, data(ids[:, :-1], ids[:, 1:])


def main() -> None:
    cases = (("mlp", mlp), ("gpt_fp32", lambda: gpt(False)), ("gpt_bf16", lambda: gpt(True)))
    for name, make in cases:
        for fuse in (False, True):
            run(name, make, fuse)


def run(name: str, make, fuse: bool) -> None:
    step, args = make()
    fn = ndl.compile(step, fuse=fuse)
    first = []
    for _ in range(3):  # watched, watched, recorded
        start = time.perf_counter()
        fn(*args)
        dev.synchronize()
        first.append(round(time.perf_counter() - start, 3))
    start = time.perf_counter()
    for _ in range(20):
        fn(*args)
    dev.synchronize()
    replay = (time.perf_counter() - start) / 20
    print(f"{name} {'fused' if fuse else 'unfused'}: calls 1-3 {first} s; "
          f"replay {replay * 1e3:.3f} ms; "
          f"{fn.stats(*args)}", flush=True)


if __name__ == "__main__":
    main()
