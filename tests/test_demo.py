"""`needle demo` end to end: one epoch into a temporary directory."""

import re

import pytest
import sklearn  # noqa: F401 - the demo's data (the data extra)

import needle as ndl
from needle import demo, nn
from needle.data import DataLoader, DigitsDataset

from .test_plot import read_png


def test_demo_one_epoch(tmp_path, capsys):
    device = ndl.default_device()
    assert demo.main(["--epochs", "1", "--out", str(tmp_path), "--no-progress",
                      "--device", device.name]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    match = re.fullmatch(r"test accuracy: (\d\.\d\d)", lines[-1])
    assert match, lines[-1]
    accuracy = float(match.group(1))
    assert accuracy >= 0.9
    assert read_png(tmp_path / "curves.png").shape == (300, 840, 3)

    ckpt = ndl.load(tmp_path / "model.safetensors", device=device)
    assert ckpt["epoch"] == 1 and ckpt["optimizer"]["type"] == "Adam"
    model = demo.build_model(device)
    model.load_state_dict(ckpt["model"])
    test = DataLoader(DigitsDataset(train=False), batch_size=512, device=device)
    _, reloaded_accuracy = demo.evaluate(model, test, nn.SoftmaxLoss())
    assert f"{reloaded_accuracy:.2f}" == match.group(1)


def test_demo_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        demo.main(["--epochs", "0", "--out", str(tmp_path)])
    with pytest.raises(ndl.DeviceError, match="unknown device"):
        demo.main(["--device", "tpu", "--out", str(tmp_path)])


@pytest.mark.parametrize("lr", ["nan", "inf", "-1", "0"])
def test_demo_rejects_a_learning_rate_that_cannot_train(tmp_path, capsys, lr):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--lr", lr, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--lr must be a finite number > 0" in capsys.readouterr().err


def test_demo_that_diverges_exits_nonzero(tmp_path, capsys):
    code = demo.main(["--lr", "1e30", "--epochs", "1", "--device", "cpu_numpy", "--out",
                      str(tmp_path), "--no-progress"])
    assert code == 1
    assert "training diverged" in capsys.readouterr().err
    assert not (tmp_path / "model.safetensors").exists()
