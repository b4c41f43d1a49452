"""Transformer training cases (issue 13 item 5): one AdamW step of a small GPT.

A decoder-only model: token and learned position embeddings, ``layers`` pre-norm blocks
(LayerNorm, causal multi-head attention, LayerNorm, ReLU MLP of width 4d), a final LayerNorm
and a vocabulary head; cross-entropy on next tokens; AdamW. needle builds it from
``nn.Embedding``, ``nn.Transformer`` and ``nn.Linear``; PyTorch from the same layers by hand
(``F.scaled_dot_product_attention`` with ``is_causal``). Each framework starts from its own
initialisation, so the losses are not compared.

Two cases, ``fp32`` and ``bf16`` (the forward pass and loss under ``ndl.autocast`` /
``torch.autocast``; float32 weights and optimizer state, backward outside the block). Four
ways each: ``needle``, ``needle:compiled`` (``ndl.compile``), ``torch`` and, on CUDA,
``torch:compile`` (``torch.compile(model)``: Inductor for forward and backward; the
optimizer stays eager, as compiling it too takes minutes for this model). On cuda and metal,
``needle:nofuse`` is the compiled step without elementwise fusion (``fuse=False``); the lines
under the table give each recorded step's kernels per replay.

The rate is 6 x tokens x weights (the matmul work of forward and backward, attention left
out) against the peer's matmul rate of the dtype.
"""

from __future__ import annotations

import numpy as np

from .launches import launch_notes
from .runner import Bench, Case, Context, Impl, Skip

LR = 3e-4


def _shape(ctx: Context) -> dict:
    if ctx.quick:
        return {"vocab": 256, "dim": 64, "layers": 2, "heads": 4, "seq": 32, "batch": 4}
    return {"vocab": 4096, "dim": 512, "layers": 6, "heads": 8, "seq": 256, "batch": 16}


def _weights(s: dict) -> int:
    d = s["dim"]
    return s["layers"] * (4 * d * d + 8 * d * d) + 2 * s["vocab"] * d


def _batches(ctx: Context, s: dict):
    def make(rng: np.random.Generator):
        ids = rng.integers(0, s["vocab"], size=(s["batch"], s["seq"] + 1), dtype=np.int64)
        return ids[:, :-1].copy(), ids[:, 1:].copy()
    return ctx.input_sets(make)


def needle_gpt_step(device, vocab: int, dim: int, hidden: int, layers: int, heads: int,
                    seq: int, lr: float, low: str | None):
    """(step, optimizer) of needle's GPT, built from seed 0: ``step(x, y)`` is one AdamW
    step on token ids x and next-token targets y, its forward pass and loss under
    ``ndl.autocast(low)`` when ``low`` is set; returns the loss. Also the fusion tests'
    model (tests/test_fusion.py)."""
    import needle as ndl
    from needle import nn, optim

    ndl.init.manual_seed(0)
    embed = nn.Embedding(vocab, dim, device=device)
    body = nn.Transformer(dim, hidden, layers, num_heads=heads, max_len=seq, batch_first=True,
                          device=device)
    head = nn.Linear(dim, vocab, device=device)
    opt = optim.AdamW(embed.parameters() + body.parameters() + head.parameters(), lr=lr)
    loss_fn = nn.SoftmaxLoss()

    def step(x, y):
        opt.zero_grad()
        with ndl.autocast(low or "bfloat16", enabled=low is not None):
            loss = loss_fn(head(body(embed(x))), y)
        loss.backward()
        opt.step()
        return loss

    return step, opt


def _needle_impl(ctx: Context, s: dict, batches, low: str | None, compiled: bool,
                 fuse: bool | None = None) -> Impl:
    try:
        import needle as ndl
    except ImportError as e:
        raise Skip(f"needle is not importable ({e})") from None
    dev = ctx.device
    step, _ = needle_gpt_step(dev, s["vocab"], s["dim"], 4 * s["dim"], s["layers"], s["heads"],
                              s["seq"], LR, low)
    fn = ndl.compile(step, fuse=fuse) if compiled else step
    inputs = [(ndl.Tensor(x, device=dev, requires_grad=False),
               ndl.Tensor(y, device=dev, requires_grad=False)) for x, y in batches]
    return Impl(fn, inputs)


def _torch_impl(ctx: Context, s: dict, batches, low: str | None, compiled: bool) -> Impl:
    fw = ctx.frameworks["torch"]
    torch = fw.torch
    F = torch.nn.functional  # noqa: N806 -- torch's own name
    d, h = s["dim"], s["heads"]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
            self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            a = self.ln1(x)
            q, k, v = (p(a).view(b, t, h, d // h).transpose(1, 2) for p in (self.q, self.k,
                                                                             self.v))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(att.transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.relu(self.up(self.ln2(x))))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(s["vocab"], d)
            self.pos = torch.nn.Embedding(s["seq"], d)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(s["layers"]))
            self.ln = torch.nn.LayerNorm(d)
            self.head = torch.nn.Linear(d, s["vocab"])

        def forward(self, ids):
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    torch.manual_seed(0)
    model = GPT().to(fw.device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    run = torch.compile(model) if compiled else model
    device_type = fw.device.type

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=getattr(torch, low or "bfloat16"),
                            enabled=low is not None):
            logits = run(x)
            loss = F.cross_entropy(logits.view(-1, s["vocab"]).float(), y.view(-1))
        loss.backward()
        opt.step()
        return loss

    return Impl(step, [(fw.put(x, "int64"), fw.put(y, "int64")) for x, y in batches])


def _case(low: str | None):
    def build(ctx: Context) -> Bench:
        s = _shape(ctx)
        batches = _batches(ctx, s)
        impls = {"needle": _needle_impl(ctx, s, batches, low, False),
                 "needle:compiled": _needle_impl(ctx, s, batches, low, True)}
        if ctx.gpu:  # the A/B of fusion
            impls["needle:nofuse"] = _needle_impl(ctx, s, batches, low, True, fuse=False)
        if "torch" in ctx.frameworks:
            impls["torch"] = _torch_impl(ctx, s, batches, low, False)
            if ctx.kind == "cuda":
                impls["torch:compile"] = _torch_impl(ctx, s, batches, low, True)
        tokens = s["batch"] * s["seq"]
        return Bench(impls, flops=6.0 * tokens * _weights(s),
                     ceiling=f"matmul_{low or 'float32'}", rtol=None,
                     later_notes=lambda: launch_notes(impls))
    return build


def cases(ctx: Context) -> list[Case]:
    s = _shape(ctx)
    base = f"gpt_step_l{s['layers']}_d{s['dim']}_s{s['seq']}_b{s['batch']}"
    return [Case(f"{base}_fp32", "train", _case(None)),
            Case(f"{base}_bf16", "train", _case("bfloat16"))]
