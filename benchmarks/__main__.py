"""``python -m benchmarks`` (and ``needle bench`` from a checkout): time needle against its peers.

Progress goes to stderr as each case finishes; the table goes to stdout at the end. The exit
status is 0, or 1 when needle computed a wrong result in some case, or 2 for bad arguments or a
disabled device.
"""

from __future__ import annotations

import argparse
import sys

from needle.backend_ndarray import device_from_name
from needle.errors import NeedleError

from .ceilings import measure
from .frameworks import frameworks_for
from .report import machine, progress_line, table, to_json, write_json
from .runner import Context, Settings, discover, run_all, select


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Time needle against numpy and PyTorch on the same device and data.")
    p.add_argument("--device", default="auto",
                   help="cpu, cpu_numpy, cuda[:i], metal or auto (the default device)")
    p.add_argument("--cases", default="",
                   help="comma-separated case names or groups, globs allowed "
                        "(e.g. matmul,sum_rows_*); see --list")
    p.add_argument("--quick", action="store_true", help="small sizes, few samples (smoke test)")
    p.add_argument("--repeat", type=_positive_int, default=None,
                   help="timed samples per implementation (default 10, 3 with --quick)")
    p.add_argument("--json", metavar="PATH", help="write every raw timing and the machine here")
    p.add_argument("--list", action="store_true", help="list the cases for the device and exit")
    return p


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        device = device_from_name(args.device)
    except NeedleError as e:
        _log(f"benchmarks: {e}")
        return 2
    if not device.enabled():
        _log(f"benchmarks: device {device.name} is disabled: {device.reason}")
        return 2
    frameworks, missing = frameworks_for(device)
    ctx = Context(device, frameworks, quick=args.quick)
    cases, broken = discover(ctx)
    for module, why in broken.items():
        _log(f"benchmarks: case module {module} not loaded: {why}")
    if args.list:
        for case in cases:
            print(f"{case.group:<10} {case.name}")
        return 0
    chosen = select(cases, args.cases.split(","))
    if not chosen:
        _log(f"benchmarks: no case matches {args.cases!r}; --list shows them")
        return 2
    settings = Settings(repeat=args.repeat or (3 if args.quick else 10),
                        min_sample_s=1e-3 if args.quick else 5e-3,
                        budget_s=2.0 if args.quick else 30.0,
                        settle_s=0.0 if ctx.gpu else 0.01 if args.quick else 0.15)
    absent = "".join(f"; no {name}: {why}" for name, why in missing.items())
    _log(f"benchmarks on {device.name}: {len(chosen)} cases, "
         f"frameworks {', '.join(frameworks)}{absent}")

    info = machine(frameworks)
    info["missing_peers"] = missing
    results = run_all(chosen, ctx, settings, lambda *done: _log(progress_line(*done)))
    keys = {r.ceiling for r in results if r.ceiling and not r.skipped}
    _log(f"measuring ceilings: {', '.join(sorted(keys)) or 'none needed'}")
    ceilings, no_ceiling = measure(ctx, keys, settings)

    info["missing_ceilings"] = no_ceiling
    print(table(results, ceilings, device.name, settings, info))
    if args.json:
        write_json(args.json, to_json(results, ceilings, device.name, settings, info,
                                      args.quick, broken))
        _log(f"wrote {args.json}")
    return 1 if any(r.wrong for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
