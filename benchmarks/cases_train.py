"""Training case (issue 3): one step of an MLP, Adam, cross-entropy, against PyTorch.

Four ways to run it (issue 13): ``needle`` eager, ``needle:compiled`` (the same step under
``ndl.compile``: a recorded replay, elementwise chains fused where the device fuses),
``torch`` eager and, on CUDA, ``torch:compile`` (``torch.compile(step,
mode="reduce-overhead")``: Inductor kernels in CUDA graphs, optimizer included). On cuda and
metal ``needle:nofuse`` is the recorded step without fusion (``fuse=False``), and the lines
under the table give each recorded step's kernels per replay.

One step is what a training loop repeats: reset the gradients, forward, loss, backward, Adam
update, then the device synchronize the runner adds. Both frameworks train the same shape of
model from their own default initialisation on the same random batches (rotated, as real
batches would be), so the losses differ and are not compared. The rate is an estimate of the
step's matmul work, 6 x batch x weights (2 forward, 4 backward), against the peer's fp32
matmul rate.
"""

from __future__ import annotations

import numpy as np

from .launches import launch_notes
from .runner import Bench, Case, Context, Impl, Skip

LR = 1e-3


def _sizes(ctx: Context) -> tuple[list[int], int]:
    """(layer widths, batch): the MNIST-sized MLP of issue 3, or a small one for --quick."""
    return ([784, 64, 64, 10], 32) if ctx.quick else ([784, 1024, 1024, 10], 512)


def _batches(ctx: Context, widths: list[int], batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    def make(rng: np.random.Generator):
        return (rng.standard_normal((batch, widths[0]), dtype=np.float32),
                rng.integers(0, widths[-1], size=batch, dtype=np.int64))

    return ctx.input_sets(make)


def _needle_step(ctx: Context, widths: list[int], batches, compiled: bool = False,
                 fuse: bool | None = None) -> Impl:
    try:
        from needle import nn, optim
        from needle.autograd import Tensor
    except ImportError as e:
        raise Skip(f"needle.nn / needle.optim are not importable yet ({e})") from None
    dev = ctx.device
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(fan_in, fan_out, device=dev, dtype="float32"))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    loss_fn = nn.SoftmaxLoss()
    opt = optim.Adam(model.parameters(), lr=LR)

    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    if compiled:
        import needle as ndl
        step = ndl.compile(step, fuse=fuse)
    inputs = [(Tensor(x, device=dev, requires_grad=False), Tensor(y, device=dev,
                                                                 requires_grad=False))
              for x, y in batches]
    return Impl(step, inputs)


def _torch_step(ctx: Context, widths: list[int], batches, compiled: bool = False) -> Impl:
    fw = ctx.frameworks["torch"]
    torch = fw.torch
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(fw.device)
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    if compiled:
        step = torch.compile(step, mode="reduce-overhead")
    return Impl(step, [(fw.put(x), fw.put(y, "int64")) for x, y in batches])


def _mlp_step(ctx: Context) -> Bench:
    widths, batch = _sizes(ctx)
    batches = _batches(ctx, widths, batch)
    impls = {"needle": _needle_step(ctx, widths, batches),
             "needle:compiled": _needle_step(ctx, widths, batches, compiled=True)}
    if ctx.gpu:  # the A/B of fusion (the CPUs do not fuse by default)
        impls["needle:nofuse"] = _needle_step(ctx, widths, batches, compiled=True, fuse=False)
    if "torch" in ctx.frameworks:
        impls["torch"] = _torch_step(ctx, widths, batches)
        if ctx.kind == "cuda":  # reduce-overhead means CUDA graphs
            impls["torch:compile"] = _torch_step(ctx, widths, batches, compiled=True)
    weights = sum(a * b for a, b in zip(widths, widths[1:]))
    return Bench(impls, flops=6.0 * batch * weights, ceiling="matmul_float32", rtol=None,
                 later_notes=lambda: launch_notes(impls))


def cases(ctx: Context) -> list[Case]:
    widths, batch = _sizes(ctx)
    name = f"mlp_step_{'-'.join(map(str, widths))}_b{batch}"
    return [Case(name, "train", _mlp_step)]
