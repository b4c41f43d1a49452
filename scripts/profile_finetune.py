"""Where a fine-tuning step's device time goes: one LoRA (or full) step of
``benchmarks.finetune_step``'s model under the backend's profiler, kernels by total time,
and the step's wall time against the device's sum (a host-bound step has wall >> device).

    python scripts/profile_finetune.py [--mode lora|full] [--layers N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.finetune_step import SHAPES_1B, make_checkpoint  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("lora", "full"), default="lora")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    args = p.parse_args(argv)
    import needle as ndl
    from needle import backend_ndarray as nd
    from needle.finetune import CausalLM, LoraConfig, add_lora

    dev = nd.cuda()
    lora = args.mode == "lora"
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp), dict(SHAPES_1B, num_hidden_layers=args.layers))
        model = CausalLM.from_pretrained(tmp, device=dev,
                                         dtype="bfloat16" if lora else "float32")
    if lora:
        add_lora(model, LoraConfig(r=16, alpha=32))
    opt = ndl.optim.AdamW(model.trainable_parameters(), lr=1e-4, weight_decay=0.0)
    ids = np.random.default_rng(0).integers(0, SHAPES_1B["vocab_size"], (args.batch, args.seq))

    def step():
        with ndl.autocast("bfloat16"):
            loss = model.loss(ids, ids)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    dev.synchronize()
    start = time.perf_counter()
    step()
    issue = time.perf_counter() - start
    dev.synchronize()
    wall = time.perf_counter() - start
    with dev.backend.profile() as prof:
        step()
    print(prof.table(45))
    launches = sum(t.calls for t in prof.totals.values())
    print(f"\n{args.mode}, {args.layers} layers, batch {args.batch} x {args.seq}: wall "
          f"{wall * 1e3:.1f} ms (host issue {issue * 1e3:.1f} ms), device sum "
          f"{prof.total_ms:.1f} ms over {launches} launches")


if __name__ == "__main__":
    main()
