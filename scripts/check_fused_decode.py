"""The decode step's fused projections on a device against the float64 definition, and the
1.1B decode step fused vs composed (logits of both paths and tokens/s).

    python scripts/check_fused_decode.py [--device cuda]
"""

from __future__ import annotations

import argparse

import numpy as np


def check_ops(dev) -> None:
    import needle.backend_ndarray as nd

    rng = np.random.default_rng(0)
    worst = {}
    for dtype, tol in (("bfloat16", 2e-2), ("float16", 2e-3), ("float32", 1e-5)):
        for dim, p in ((2048, 2560), (2048, 24), (5632, 2048), (64, 520), (200, 8)):
            x = rng.standard_normal((1, dim)).astype(np.float32)
            w = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
            W = (rng.standard_normal((2 * p, dim)) / np.sqrt(dim)).astype(np.float32)
            t = rng.standard_normal((1, p)).astype(np.float32)
            arrs = [nd.array(v, device=dev, dtype=dtype) for v in (x, w, W, t)]
            ref = [nd.array(v, device=nd.cpu_numpy(), dtype=dtype) for v in (x, w, W, t)]
            for kind in ("plain", "swiglu", "add"):
                def run(a, kind=kind, p=p):
                    xa, wa, Wa, ta = a
                    if kind == "plain":
                        return nd.rmsnorm_matvec(xa, wa, Wa[:p], 1e-5).numpy()
                    if kind == "swiglu":
                        return nd.rmsnorm_matvec(xa, wa, Wa, 1e-5, "swiglu").numpy()
                    tt = ta + 0  # a copy: matvec_add writes in place
                    return nd.matvec_add(xa, Wa[:p], tt).numpy()
                got = run(arrs).astype(np.float64)
                want = run(ref).astype(np.float64)
                err = np.abs(got - want).max() / max(1e-6, np.abs(want).max())
                worst[(dtype, kind)] = max(worst.get((dtype, kind), 0), err)
                assert err <= tol, (dtype, kind, dim, p, err)
    for key, err in sorted(worst.items()):
        print(f"fused {key[1]:<7} {key[0]:<9} max rel err vs cpu_numpy {err:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    import needle.backend_ndarray as nd

    check_ops(getattr(nd, args.device)())


if __name__ == "__main__":
    main()
