"""``needle warmup``: compile a device's kernels into the disk cache ahead of time.

On CUDA the kernels are compiled by NVRTC the first time they are used and kept in
``$NEEDLE_CACHE_DIR`` (default ``~/.cache/needle``); ``load_pretrained`` already compiles the
ones a model needs while its weights load. ``needle warmup`` does it for whole dtypes up
front (after an install, in a container build), so that no later run waits for a compiler.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="needle warmup",
                                description="Compile kernels into the disk cache ahead of use.")
    p.add_argument("--device", default="auto", help="auto, cuda[:i], ... (default: auto)")
    p.add_argument("--dtype", action="append", default=None,
                   choices=("float32", "float16", "bfloat16", "float64"),
                   help="model dtype(s) to compile for (default: bfloat16 and float32); "
                        "int32, int64 and bool kernels come with them")
    p.add_argument("--training", action="store_true",
                   help="also the optimizer-update kernels")
    args = p.parse_args(argv)
    from .backend_ndarray import device_from_name
    from .backends.api import has

    device = device_from_name(args.device)
    backend = device.backend
    if not has(backend, "precompile"):
        print(f"{device.name} compiles nothing ahead (its kernels are built in or compile "
              "at once)", file=sys.stderr)
        return 0
    dtypes = (args.dtype or ["bfloat16", "float32"]) + ["int32", "int64", "bool"]
    families = None if args.training else \
        [f for f in backend.device.executables.families() if f != "optim"]
    start = time.perf_counter()
    units = backend.precompile(dict.fromkeys(dtypes), families)
    backend.wait_precompiled()
    print(f"{device.name}: {len(units)} kernel shards compiled or found in the cache in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
