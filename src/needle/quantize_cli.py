"""``needle quantize MODEL_DIR OUT_DIR --bits {8,4} [--group-size N]``: a quantized copy of a
Hugging Face checkpoint directory that ``load_pretrained``, ``needle generate`` and
``needle chat`` read (docs/quantization.md)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="needle quantize",
        description="Write a weight-only quantized copy of a model directory: every Linear "
                    "weight of the decoder layers packed to int8 or int4; embeddings, norms "
                    "and the output head stay in the checkpoint's dtype unless asked.")
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--bits", type=int, choices=(8, 4), required=True)
    parser.add_argument("--group-size", type=int, default=None,
                        help="k values per scale: 32, 64 or 128 (int4 default 128); int8 "
                             "default: one scale per output channel")
    parser.add_argument("--asymmetric", action="store_true",
                        help="int4 only: a scale and a minimum per group (better accuracy, "
                             "0.25 bit more per weight at group 128)")
    parser.add_argument("--quantize-head", action="store_true",
                        help="also quantize the output head (when not tied to the embeddings)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    group = args.group_size
    if group is None and args.bits == 4:
        group = 128
    if group is not None and group not in (16, 32, 64, 128, 256):
        parser.error(f"--group-size must be 16, 32, 64, 128 or 256, not {group}")
    if args.asymmetric and args.bits == 8:
        parser.error("--asymmetric applies to --bits 4 only (int8 is symmetric)")
    from .models.quantized import quantize_checkpoint

    out = quantize_checkpoint(args.model_dir, args.out_dir, args.bits, group,
                              symmetric=not args.asymmetric, quantize_head=args.quantize_head,
                              progress=not args.quiet)
    print(f"wrote {out} (int{args.bits}, "
          f"{'per-channel' if group is None else f'group {group}'}"
          f"{', asymmetric' if args.asymmetric else ''})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
