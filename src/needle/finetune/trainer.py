"""``finetune``: a Hugging Face checkpoint trained on a data file, fully or with LoRA.

The loop is the plain one a course teaches (forward, loss, backward, clip, AdamW step,
cosine schedule with warmup) over ``data.read_examples``' token ids and labels, with a
progress bar. On CUDA the products run in bfloat16 under ``autocast`` with float32
master weights (a LoRA run keeps the frozen weights in bf16, halving their memory); on
other devices everything is float32. On devices that record work (CUDA, Metal) the step is
recorded once per batch shape and replayed (``make_step``).

Nothing is lost: the result is written whole or not at all (a full fine-tune as a
checkpoint directory, a LoRA run as a PEFT adapter, or merged into a checkpoint), every
``save_every`` steps and when the run is interrupted, with ``finetune.json`` beside it
(the settings and every step's loss) and, until the run finishes, the state it resumes
from (``run.py``).
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import checks
from ..amp import autocast
from ..compiled import compile as compile_step
from ..errors import ArgumentError
from ..init import manual_seed
from ..models.config import ModelConfig
from ..models.loader import resolve_device
from ..models.lora_format import ALL_LINEAR, LoraConfig
from ..models.tokenizer import load_tokenizer
from ..optim import AdamW, CosineDecay, clip_grad_norm
from .data import IGNORE, batches, read_examples
from .lora import add_lora
from .model import CausalLM, next_token_targets
from .run import STATE_FILE, Run


@dataclass
class FinetuneSettings:
    """What a run does. ``lora_rank`` None trains every weight; a rank trains LoRA adapters
    (``lora_alpha`` default 2 x rank) on ``target_modules`` and leaves the weights frozen.
    ``lr`` defaults to 2e-4 with LoRA and 2e-5 without (the usual starting points)."""

    epochs: int = 1
    batch_size: int = 4
    max_len: int = 1024
    lr: float | None = None
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    target_modules: list[str] | str = ALL_LINEAR
    merge: bool = False
    save_every: int | None = None
    seed: int = 0
    compile: bool | None = None  # record the step once and replay it; None: on GPUs
    # fuse elementwise chains into generated kernels when compiling: ~9% faster, but the
    # recording call then holds every array the step makes (1.1B LoRA: 39 GiB against 11.5
    # unfused, measured before each LoRA projection was one node; unfused now 6.9)
    fuse: bool = False
    # keep one decoder layer's activations at a time, recomputing each in the backward
    # pass (CausalLM.gradient_checkpointing_enable): less memory, ~a third more compute
    gradient_checkpointing: bool = False
    # batches whose gradients add up before each optimizer step: a step then learns from
    # batch_size x this many examples, holding one batch's activations at a time
    gradient_accumulation_steps: int = 1

    def __post_init__(self):
        where = "finetune"
        checks.positive(self.epochs, "epochs", where)
        checks.positive(self.batch_size, "batch_size", where)
        checks.positive(self.gradient_accumulation_steps, "gradient_accumulation_steps", where)
        checks.positive(self.max_len, "max_len", where)
        if self.lora_rank is not None:
            checks.positive(self.lora_rank, "lora_rank", where)
        elif self.merge:
            raise ArgumentError("finetune: merge applies to a LoRA run (give lora_rank); a "
                                "full fine-tune writes a checkpoint already")
        if self.save_every is not None:
            checks.positive(self.save_every, "save_every", where)
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ArgumentError(f"finetune: warmup_ratio must be in [0, 1), got "
                                f"{self.warmup_ratio!r}")
        if self.lr is None:
            self.lr = 2e-4 if self.lora_rank is not None else 2e-5
        checks.number(self.lr, "lr", where, 0.0, low_open=True)


@dataclass
class FinetuneResult:
    output: Path
    steps: int
    examples: int
    tokens: int  # labelled tokens seen (each epoch counted)
    seconds: float
    losses: list[float] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)  # before training, each epoch


def finetune(model_dir: str | Path, data: str | Path, out_dir: str | Path,
             settings: FinetuneSettings | None = None, device=None,
             progress: bool = True, eval_data: str | Path | None = None,
             resume: bool = False,
             on_step: Callable[[int, float], None] | None = None) -> FinetuneResult:
    """Train the checkpoint in ``model_dir`` on ``data`` (JSONL / JSON: text, prompt and
    completion, or chat messages; ``data.py``) and write the result to ``out_dir``. With
    ``eval_data`` (a file of the same forms), its loss over the labelled tokens is measured
    before training and after each epoch (``FinetuneResult.eval_losses``, finetune.json).
    ``resume`` continues the unfinished run in ``out_dir`` (same model, data and settings;
    ``run.py``). ``on_step(step, loss)`` is called after each step (1-based)."""
    s = settings or FinetuneSettings()
    model_dir, out_dir, data = Path(model_dir), Path(out_dir), Path(data)
    device = resolve_device(device)
    cfg = ModelConfig.from_file(model_dir / "config.json")
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ArgumentError(f"{model_dir} has no tokenizer.json (or the tokenizers package is "
                            "missing); fine-tuning reads text, so it needs the tokenizer")
    max_len = min(s.max_len, cfg.max_position_embeddings)
    examples = read_examples(data, tokenizer, max_len, eos_id=_eos(cfg))
    held_out = (read_examples(eval_data, tokenizer, max_len, eos_id=_eos(cfg))
                if eval_data is not None else None)
    if not resume and (out_dir / STATE_FILE).is_file():
        raise ArgumentError(f"{out_dir} holds an unfinished run; continue it with resume "
                            "(--resume) or write to another directory")
    mixed = device.name.startswith("cuda")
    model = _model(model_dir, s, device, mixed)
    total = math.ceil(math.ceil(len(examples) / s.batch_size)
                      / s.gradient_accumulation_steps) * s.epochs
    opt = AdamW(model.trainable_parameters(), lr=s.lr, weight_decay=s.weight_decay)
    warmup = min(int(s.warmup_ratio * total), total - 1)
    schedule = CosineDecay(opt, total, warmup) if total > 1 else None
    run = Run(model, s, out_dir, model_dir, cfg.dtype, data, opt, schedule)
    if resume:
        run.restore(device)
    # LoRA dropout draws its masks on the host, which a replay cannot repeat: such a run is
    # eager (asked for compile, ndl.compile says why and runs eagerly all the same)
    compiled = s.compile if s.compile is not None else (
        hasattr(device.backend, "capture") and not s.lora_dropout)
    step = make_step(model, opt, schedule, s.max_grad_norm, mixed, compiled, s.fuse)
    loop = _Loop(run, step, examples, held_out, total, max_len, compiled, mixed, on_step)
    seconds = loop.train(progress)
    return FinetuneResult(out_dir, len(run.losses), len(examples), run.tokens, seconds,
                          run.losses, [e["loss"] for e in run.eval_losses])


def _model(model_dir: Path, s: FinetuneSettings, device, mixed: bool) -> CausalLM:
    """The model to train: every weight float32, or frozen weights (bf16 on CUDA) with
    fresh adapters."""
    manual_seed(s.seed)
    base_dtype = "bfloat16" if mixed and s.lora_rank is not None else "float32"
    model = CausalLM.from_pretrained(model_dir, device=device, dtype=base_dtype)
    if s.lora_rank is not None:
        add_lora(model, LoraConfig(r=s.lora_rank, alpha=s.lora_alpha or 2.0 * s.lora_rank,
                                   dropout=s.lora_dropout, target_modules=s.target_modules))
    if s.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


class _Loop:
    """The epochs of a run, from where it stands (a resumed run skips the batches done)."""

    def __init__(self, run: Run, step, examples, held_out, total: int, max_len: int,
                 compiled: bool, mixed: bool, on_step):
        self.run, self.step = run, step
        self.examples, self.held_out, self.total = examples, held_out, total
        self.max_len, self.compiled, self.mixed, self.on_step = max_len, compiled, mixed, on_step

    def train(self, progress: bool) -> float:
        """Train to the end, saving as asked and when interrupted; the seconds taken."""
        from tqdm import tqdm

        run, s = self.run, self.run.settings
        done = len(run.losses)
        bar = tqdm(total=self.total, initial=done, desc="fine-tuning", unit="step",
                   disable=not progress)
        start = self.start = time.perf_counter()
        if self.held_out is not None and not run.eval_losses:
            run.evaluate(self.held_out, self.mixed, epoch=0)
        try:
            for epoch in range(s.epochs):
                self._epoch(epoch, done, bar)
        except KeyboardInterrupt:
            bar.close()
            if len(run.losses) > done:
                run.save(time.perf_counter() - start, False)
                print(f"interrupted after {len(run.losses)} of {self.total} steps; saved "
                      f"that state to {run.out_dir} (resume: --resume)", file=sys.stderr)
            raise
        bar.close()
        seconds = time.perf_counter() - start
        run.save(seconds, True)
        return seconds

    def _epoch(self, epoch: int, done: int, bar) -> None:
        run, s = self.run, self.run.settings
        device = run.model.model.embed_tokens.weight.device
        per_epoch = self.total // s.epochs
        # right padding: a causal model's earlier positions never see it, and its labels
        # are IGNORE, so any id pads (0); a compiled step's lengths are rounded up to a
        # multiple of 64 so that few shapes are recorded
        groups = _groups(batches(self.examples, s.batch_size, pad_id=0, shuffle=True,
                                 seed=s.seed + epoch), s.gradient_accumulation_steps)
        for i, group in enumerate(groups):
            if epoch * per_epoch + i < done:
                continue  # taken before the run was resumed
            if self.compiled:
                group = [_round_length(ids, labels, 64, self.max_len) for ids, labels in group]
            # every batch's losses weighted by the group's labelled positions, so that the
            # step's loss and gradient are those of the group as one batch
            count = sum(int((labels[:, 1:] != IGNORE).sum()) for _, labels in group)
            inputs = [t for ids, labels in group
                      for t in (run.model.ids_tensor(ids),
                                *next_token_targets(labels, device, count))]
            # read at once: the loss tensor (and the graph it holds) is dropped here
            loss = float(self.step(*inputs).numpy())
            run.record(loss, count)
            bar.set_postfix(loss=f"{loss:.4f}", epoch=epoch + 1)
            bar.update(1)
            if self.on_step is not None:
                self.on_step(len(run.losses), loss)
            if s.save_every and len(run.losses) % s.save_every == 0 \
                    and len(run.losses) < self.total:
                run.save(time.perf_counter() - self.start, False)
        if self.held_out is not None and (epoch + 1) * per_epoch > done:
            loss = run.evaluate(self.held_out, self.mixed, epoch + 1)
            bar.set_postfix(eval_loss=f"{loss:.4f}", epoch=epoch + 1)


def make_step(model: CausalLM, opt, schedule, max_grad_norm: float, mixed: bool,
              compiled: bool, fuse: bool = False):
    """One training step on device tensors (ids, targets, weights), or several such triples
    whose gradients add up before the update (gradient accumulation: each batch's graph is
    dropped after its backward pass) -> the summed loss; recorded and replayed
    (``ndl.compile``: one CUDA graph; elementwise chains fused with ``fuse``) when
    ``compiled``, which takes the Python of ~6,000 launches a step off the host."""
    params = model.trainable_parameters()

    def step(*batches):
        opt.zero_grad()
        total = None
        for i in range(0, len(batches), 3):
            with autocast("bfloat16", enabled=mixed):
                loss = model.loss_of(*batches[i:i + 3])
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        if max_grad_norm:
            clip_grad_norm(params, max_grad_norm)
        opt.step()
        if schedule is not None:
            schedule.step()
        return total

    return compile_step(step, fuse=fuse) if compiled else step


def _groups(items, n: int):
    """Consecutive lists of n items (the last may be shorter)."""
    it = iter(items)
    while group := list(itertools.islice(it, n)):
        yield group


def _round_length(ids: np.ndarray, labels: np.ndarray, multiple: int, most: int):
    """The batch padded on the right to a multiple of ``multiple`` positions (at most
    ``most``): ids with 0, labels with IGNORE."""
    b, s = ids.shape
    target = min(-(-s // multiple) * multiple, max(most, s))
    if target == s:
        return ids, labels
    pad = ((0, 0), (0, target - s))
    return np.pad(ids, pad), np.pad(labels, pad, constant_values=IGNORE)


def _eos(cfg: ModelConfig) -> int | None:
    return cfg.eos_token_ids[0] if cfg.eos_token_ids else None

