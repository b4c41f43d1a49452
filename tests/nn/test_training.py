"""Short training runs: a model reaches its accuracy, and training resumed from a
checkpoint continues with exactly the losses of an uninterrupted run."""

import numpy as np

import needle as ndl
from needle import init, nn, optim
from needle.data import ArrayDataset, DataLoader, DigitsDataset


def flat_digits(train: bool) -> ArrayDataset:
    images, labels = DigitsDataset(train=train).arrays
    return ArrayDataset(images.reshape(len(images), -1), labels)


def mlp(device):
    return nn.Sequential(nn.Linear(64, 64, device=device), nn.BatchNorm1d(64, device=device),
                         nn.ReLU(), nn.Linear(64, 10, device=device))


def run_epoch(model, loader, opt, loss_fn) -> list[float]:
    losses = []
    for x, y in loader:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_mlp_learns_digits(device):
    init.manual_seed(0)
    model = mlp(device)
    loader = DataLoader(flat_digits(True), batch_size=64, shuffle=True, seed=0, device=device)
    opt = optim.AdamW(model.parameters(), lr=0.01, weight_decay=1e-4)
    loss_fn = nn.SoftmaxLoss()
    first = run_epoch(model, loader, opt, loss_fn)
    second = run_epoch(model, loader, opt, loss_fn)
    assert np.mean(second) < 0.5 * np.mean(first)
    model.eval()
    x, y = next(iter(DataLoader(flat_digits(False), batch_size=1000, device=device)))
    with ndl.no_grad():
        predicted = model(x).numpy().argmax(axis=1)
    assert (predicted == y.numpy()).mean() >= 0.9


def test_resume_gives_identical_losses(tmp_path, device):
    def fresh(seed):
        init.manual_seed(seed)
        model = mlp(device)
        opt = optim.Adam(model.parameters(), lr=0.01, weight_decay=1e-3)
        loader = DataLoader(flat_digits(True), batch_size=128, shuffle=True, seed=3,
                            device=device)
        return model, opt, optim.CosineDecay(opt, total_steps=3 * len(loader)), loader

    loss_fn = nn.SoftmaxLoss()

    def epoch_losses(model, opt, sched, loader) -> list[float]:
        losses = []
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        return losses

    model, opt, sched, loader = fresh(seed=1)
    straight = []
    for epoch in range(3):
        straight += epoch_losses(model, opt, sched, loader)
        if epoch == 0:
            ndl.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                      "schedule": sched.state_dict(), "epoch": 1}, tmp_path / "ck.safetensors")

    model, opt, sched, loader = fresh(seed=99)  # the checkpoint, not the seed, decides
    ckpt = ndl.load(tmp_path / "ck.safetensors", device=device)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["schedule"])
    loader.epoch = ckpt["epoch"]
    resumed = []
    for _ in range(2):
        resumed += epoch_losses(model, opt, sched, loader)
    assert resumed == straight[len(straight) - len(resumed):]
