"""What a fine-tuning run has done, written so that nothing is lost and it can go on.

``Run`` holds the step losses, the held-out losses and the labelled tokens seen, and writes
the output directory: the model as it stands (a PEFT adapter, or a checkpoint), the log
``finetune.json`` (settings, data digest, every loss) and, while the run is unfinished,
``trainer_state.safetensors``: the trainable parameters in their training dtype (float32
master weights, or the adapters), AdamW's moments and the schedule's position. ``needle
finetune --resume`` reads them back and continues at the next batch, which the data order
(a permutation drawn from seed + epoch) makes the batch the run would have taken: the
resumed run ends where an uninterrupted one would. The state goes when the run finishes
(for a full fine-tune it is three times the model's float32 size).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict
from pathlib import Path

from .. import serialization
from ..amp import autocast
from ..errors import ArgumentError
from ..grad_mode import no_grad
from ..models.config import read_json_object
from ..models.quantized import COPIED
from ..models.safetensors_io import write_json
from .data import IGNORE, batches
from .lora import save_adapter
from .model import CausalLM
from .save import save_pretrained

LOG_FILE = "finetune.json"
STATE_FILE = "trainer_state.safetensors"
# settings that may differ on resume (they do not change what the run computes)
_FREE_ON_RESUME = ("save_every", "gradient_checkpointing")


class Run:
    """The losses so far and how to write (and read back) the run as it stands."""

    def __init__(self, model: CausalLM, settings, out_dir: Path, source: Path, dtype: str,
                 data: Path, opt, schedule):
        self.model, self.settings, self.out_dir = model, settings, out_dir
        self.opt, self.schedule = opt, schedule  # their state is the run's too
        self.source, self.dtype = source, dtype
        self.data_digest = _digest(data)
        self.losses: list[float] = []
        self.eval_losses: list[dict] = []
        self.tokens = 0
        self.seconds_before = 0.0  # training time of the run before it was resumed

    def record(self, loss: float, tokens: int) -> None:
        if not math.isfinite(loss):
            raise ArgumentError(f"the loss became {loss} at step {len(self.losses) + 1}; "
                                "lower the learning rate (lr) or check the data")
        self.losses.append(loss)
        self.tokens += tokens

    def evaluate(self, examples, mixed: bool, epoch: int) -> float:
        """The held-out loss: the mean cross-entropy over every labelled token of
        ``examples`` (batches weighted by their labelled tokens), without gradients."""
        total, count = 0.0, 0
        self.model.eval()
        try:
            with no_grad(), autocast("bfloat16", enabled=mixed):
                for ids, labels in batches(examples, self.settings.batch_size, pad_id=0,
                                           shuffle=False, seed=0):
                    n = int((labels[:, 1:] != IGNORE).sum())
                    total += float(self.model.loss(ids, labels).numpy()) * n
                    count += n
        finally:
            self.model.train()
        self.eval_losses.append({"epoch": epoch, "step": len(self.losses),
                                 "loss": total / count})
        return total / count

    # --- writing -------------------------------------------------------------------------
    def save(self, seconds: float, finished: bool) -> None:
        """The model, then (unfinished) the state to resume from, then the log: the log
        names a step only once everything of that step is on disk."""
        s = self.settings
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if s.lora_rank is not None and not s.merge:
            save_adapter(self.model, self.out_dir)
            for extra in COPIED:  # the tokenizer beside the adapter, as PEFT users keep it
                if (self.source / extra).is_file() and extra != "generation_config.json":
                    (self.out_dir / extra).write_bytes((self.source / extra).read_bytes())
        else:
            save_pretrained(self.model, self.out_dir, dtype=self.dtype, progress=False)
        state = self.out_dir / STATE_FILE
        if finished:
            state.unlink(missing_ok=True)
        else:
            params = self.model.trainable_parameters()
            serialization.save({"params": {str(i): p for i, p in enumerate(params)},
                                "optimizer": self.opt.state_dict(),
                                "schedule": self.schedule.state_dict() if self.schedule else {}},
                               state)
        log = {"base_model": str(self.source), "finished": finished,
               "steps": len(self.losses), "labelled_tokens": self.tokens,
               "seconds": round(self.seconds_before + seconds, 3), "data_sha256": self.data_digest,
               "settings": asdict(s), "losses": self.losses, "eval": self.eval_losses}
        write_json(self.out_dir / LOG_FILE, log)

    # --- reading back --------------------------------------------------------------------
    def restore(self, device) -> None:
        """Continue the unfinished run in ``out_dir``: refuse one whose settings, base model
        or data differ from this run's, then load its parameters, optimizer and schedule
        state and its losses."""
        log = self._resumable_log()
        state = serialization.load(self.out_dir / STATE_FILE, device=device)
        params = self.model.trainable_parameters()
        saved = state.get("params", {})
        if len(saved) != len(params):
            raise ArgumentError(f"{self.out_dir / STATE_FILE} holds {len(saved)} parameters, "
                                f"this run trains {len(params)}; it belongs to another run")
        for i, p in enumerate(params):
            value = saved[str(i)]
            if tuple(value.shape) != tuple(p.shape):
                raise ArgumentError(f"{self.out_dir / STATE_FILE}: parameter {i} has shape "
                                    f"{tuple(value.shape)}, this run's {tuple(p.shape)}")
            p.data = value.astype(p.dtype) if value.dtype != p.dtype else value
        self.opt.load_state_dict(state["optimizer"])
        if self.schedule is not None:
            self.schedule.load_state_dict(state["schedule"])
        self.losses = [float(x) for x in log["losses"]]
        self.eval_losses = list(log.get("eval", []))
        self.tokens = int(log["labelled_tokens"])
        self.seconds_before = float(log.get("seconds", 0.0))

    def _resumable_log(self) -> dict:
        path = self.out_dir / LOG_FILE
        if not path.is_file() or not (self.out_dir / STATE_FILE).is_file():
            raise ArgumentError(f"nothing to resume in {self.out_dir}: it holds no {LOG_FILE} "
                                f"and {STATE_FILE} of an unfinished run")
        log = read_json_object(path, LOG_FILE)
        if log.get("finished"):
            raise ArgumentError(f"the run in {self.out_dir} finished; start a new one (in "
                                "another directory) to train further")
        if log.get("base_model") != str(self.source):
            raise ArgumentError(f"the run in {self.out_dir} trained {log.get('base_model')}, "
                                f"not {self.source}")
        if log.get("data_sha256") != self.data_digest:
            raise ArgumentError(f"the data file differs from the one the run in "
                                f"{self.out_dir} trained on; resume with the same file")
        ours, theirs = asdict(self.settings), log.get("settings", {})
        changed = [k for k in ours if k not in _FREE_ON_RESUME and ours[k] != theirs.get(k)]
        if changed:
            raise ArgumentError(f"the run in {self.out_dir} had other settings ("
                                + ", ".join(f"{k}: {theirs.get(k)!r}, now {ours[k]!r}"
                                            for k in changed)
                                + "); resume with the same ones")
        return log


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
