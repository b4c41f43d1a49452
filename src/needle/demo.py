"""``needle demo``: train a small CNN on scikit-learn's 8x8 digits, end to end.

It exercises the whole stack on one device: data loading, conv/batch-norm/linear layers,
autograd, Adam with a cosine schedule, evaluation, a checkpoint and a plot of the curves.
The last line printed is ``test accuracy: 0.97`` (two decimals).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from tqdm import tqdm

from . import init, nn, optim
from .autograd import Tensor, no_grad
from .backend_ndarray import device_from_name
from .data import DataLoader, DigitsDataset
from .plot import save_line_plots
from .serialization import save


def build_model(device, dtype: str = "float32") -> nn.Module:
    """Two 3x3 convolutions (the second with stride 2: 8x8 -> 4x4), then two linear layers."""
    return nn.Sequential(
        nn.Conv(1, 16, 3, device=device, dtype=dtype),
        nn.BatchNorm2d(16, device=device, dtype=dtype),
        nn.ReLU(),
        nn.Conv(16, 32, 3, stride=2, device=device, dtype=dtype),
        nn.BatchNorm2d(32, device=device, dtype=dtype),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64, device=device, dtype=dtype),
        nn.ReLU(),
        nn.Linear(64, 10, device=device, dtype=dtype),
    )


def _correct(logits: Tensor, labels: Tensor) -> int:
    predicted = logits.realize_cached_data().argmax(axis=1)
    return int((predicted == labels.realize_cached_data()).sum().item())


def evaluate(model: nn.Module, loader: DataLoader, loss_fn: nn.Module) -> tuple[float, float]:
    """(mean loss, accuracy) over ``loader`` in eval mode, without building graphs."""
    model.eval()
    total_loss, correct, seen = 0.0, 0, 0
    with no_grad():
        for x, y in loader:
            logits = model(x)
            total_loss += loss_fn(logits, y).item() * len(y)
            correct += _correct(logits, y)
            seen += len(y)
    model.train()
    return total_loss / seen, correct / seen


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="needle demo", description="Train a small CNN on scikit-learn's 8x8 digits.")
    parser.add_argument("--device", default="auto",
                        help="auto (the default device), cpu, cpu_numpy, cuda[:i] or metal")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("needle-out"),
                        help="directory for model.safetensors and curves.png")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be >= 1")
    if not (math.isfinite(args.lr) and args.lr > 0):  # `nan <= 0` is False: test positively
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = device_from_name(args.device)
    device.backend  # noqa: B018 -- raises DeviceError with the reason if it is disabled
    try:  # before training, so that a bad --out does not cost a training run
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"needle demo: error: --out {args.out}: cannot create the directory ({e.strerror})",
              file=sys.stderr)
        return 2
    init.manual_seed(args.seed)
    train_loader = DataLoader(DigitsDataset(train=True), batch_size=args.batch_size,
                              shuffle=True, seed=args.seed, device=device)
    test_loader = DataLoader(DigitsDataset(train=False), batch_size=256, device=device)
    model = build_model(device)
    loss_fn = nn.SoftmaxLoss()
    opt = optim.Adam(model.parameters(), lr=args.lr)
    schedule = optim.CosineDecay(opt, total_steps=args.epochs * len(train_loader))
    print(f"needle demo: {len(train_loader.dataset)} training and {len(test_loader.dataset)} "
          f"test digits on {device.name}, {sum(p.size for p in model.parameters())} parameters")

    history = {"train loss": [], "test loss": [], "train acc": [], "test acc": []}
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        total_loss, correct, seen = 0.0, 0, 0
        bar = tqdm(train_loader, desc=f"epoch {epoch}/{args.epochs}", unit="batch",
                   disable=args.no_progress, file=sys.stderr, leave=True)
        for x, y in bar:
            logits = model(x)
            loss = loss_fn(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
            total_loss += loss.item() * len(y)
            correct += _correct(logits, y)
            seen += len(y)
            bar.set_postfix(loss=f"{total_loss / seen:.3f}", acc=f"{correct / seen:.3f}")
        test_loss, test_acc = evaluate(model, test_loader, loss_fn)
        for key, value in (("train loss", total_loss / seen), ("test loss", test_loss),
                           ("train acc", correct / seen), ("test acc", test_acc)):
            history[key].append(value)
        if not math.isfinite(total_loss):
            bar.close()
            print(f"error: training diverged in epoch {epoch} (the loss is {total_loss}); "
                  "try a smaller --lr", file=sys.stderr)
            return 1
        bar.write(f"epoch {epoch}: train loss {total_loss / seen:.4f}, test loss "
                  f"{test_loss:.4f}, test accuracy {test_acc:.4f}", file=sys.stderr)

    save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": args.epochs,
          "test_accuracy": history["test acc"][-1], "seed": args.seed},
         args.out / "model.safetensors")
    save_line_plots(args.out / "curves.png", {
        "loss": {"train": history["train loss"], "test": history["test loss"]},
        "accuracy": {"train": history["train acc"], "test": history["test acc"]},
    }, xlabel="epoch")
    print(f"trained in {time.perf_counter() - start:.1f} s; wrote {args.out / 'model.safetensors'}"
          f" and {args.out / 'curves.png'}")
    print(f"test accuracy: {history['test acc'][-1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
