"""``needle finetune MODEL_DIR DATA OUT_DIR``: train a Hugging Face checkpoint on a JSONL / JSON
file (text, prompt + completion, or chat messages), fully or with LoRA (docs/finetuning.md)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="needle finetune",
        description="Fine-tune a model directory on a data file. Each record is "
                    '{"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [...]} '
                    "(the loss is taken on the completion or the assistant turns). Writes a "
                    "checkpoint directory (full fine-tune, or --lora-rank with --merge) or a "
                    "PEFT LoRA adapter (--lora-rank) that load_pretrained, needle generate / "
                    "chat / serve (--adapter), transformers and PEFT read.")
    p.add_argument("model_dir")
    p.add_argument("data", help=".jsonl (one record a line) or .json (a list of records)")
    p.add_argument("out_dir")
    p.add_argument("--eval-data", default=None,
                   help="a held-out file of the same forms: its loss before training and "
                        "after each epoch")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="train LoRA adapters of this rank (weights frozen); default: every "
                        "weight")
    p.add_argument("--lora-alpha", type=float, default=None, help="default 2 x rank")
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--target-modules", default="all-linear",
                   help="comma-separated projection names (q_proj,v_proj) or all-linear")
    p.add_argument("--merge", action="store_true",
                   help="with --lora-rank: write the merged checkpoint instead of the adapter")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-len", type=int, default=1024, help="tokens an example is cut to")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default 2e-4 with LoRA, 2e-5 without)")
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--save-every", type=int, default=None, help="also save every N steps")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1,
                   help="batches whose gradients add up before each update (a step learns "
                        "from batch size x N examples)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="keep one layer's activations at a time and recompute each in the "
                        "backward pass: less memory, ~a third more compute")
    p.add_argument("--resume", action="store_true",
                   help="continue the unfinished run in OUT_DIR (interrupted, or saved with "
                        "--save-every) with the same model, data and options")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda, metal, cpu (default: the best)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    from .finetune.trainer import FinetuneSettings, finetune

    targets = args.target_modules
    settings = FinetuneSettings(
        epochs=args.epochs, batch_size=args.batch_size, max_len=args.max_len, lr=args.lr,
        warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        target_modules=targets if targets == "all-linear" else targets.split(","),
        merge=args.merge, save_every=args.save_every, seed=args.seed,
        gradient_checkpointing=args.gradient_checkpointing,
        gradient_accumulation_steps=args.gradient_accumulation_steps)
    result = finetune(args.model_dir, args.data, args.out_dir, settings, device=args.device,
                      progress=not args.quiet, eval_data=args.eval_data,
                      resume=args.resume)
    first, last = result.losses[0], result.losses[-1]
    kind = ("LoRA adapter" if args.lora_rank and not args.merge else "checkpoint")
    print(f"wrote {kind} to {result.output}: {result.steps} steps over {result.examples} "
          f"examples ({result.tokens} labelled tokens) in {result.seconds:.1f} s; loss "
          f"{first:.4f} -> {last:.4f}"
          + (f"; held-out loss {result.eval_losses[0]:.4f} -> {result.eval_losses[-1]:.4f}"
             if result.eval_losses else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
