"""A gpt-fast-style Llama decode in PyTorch: the strongest plain-PyTorch recipe for one stream.

The recipe (as PyTorch's gpt-fast popularised it): a KV cache allocated once for the whole
sequence (static shapes), each decode step attending over the whole cache under a causal
mask row (so the step's shapes never change), the one-token step (forward and greedy argmax)
compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)`` — Inductor's fused
Triton kernels replayed as one CUDA graph per token — and the generated tokens left on the
device (no host read per token). Inductor's coordinate-descent tuning is on, as gpt-fast
sets it (``NEEDLE_BENCH_TORCH_TUNING=0`` turns it off to shorten compilation).

The weights are needle's own arrays, viewed through DLPack (no copy where the backend
exports device memory), in needle's layout: q, k and v stacked into one matrix, gate and up
into another, as gpt-fast stacks them too. Written for this benchmark from the Llama
architecture (RMSNorm, rotary embedding in Hugging Face's rotate-half form, grouped-query
attention, SwiGLU); plain Llama only (no biases, windows or soft-capping).
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention

PREFILL_CHUNK = 1024  # prompt tokens per eager forward when filling the cache (bounds memory)


class StaticLlama(torch.nn.Module):
    """Llama with a static KV cache of ``capacity`` positions over the given weights.

    ``weights``: ``embed`` (vocab, hidden), ``final_norm``, ``lm_head`` (vocab, hidden) and
    ``layers``, each a dict of ``attn_norm``, ``qkv`` ((q + 2 kv) * head_dim, hidden), ``o``,
    ``mlp_norm``, ``gate_up`` (2 * intermediate, hidden), ``down``. ``cos``/``sin``:
    (positions >= capacity, head_dim / 2) rotary tables in the model's dtype.
    """

    def __init__(self, cfg, weights: dict, cos: torch.Tensor, sin: torch.Tensor,
                 capacity: int):
        super().__init__()
        self.cfg, self.capacity = cfg, capacity
        embed = weights["embed"]
        device, dtype = embed.device, embed.dtype
        self.embed = _frozen(embed)
        self.final_norm = _frozen(weights["final_norm"])
        self.lm_head = _frozen(weights["lm_head"])
        self.layers = torch.nn.ModuleList(_Layer(w) for w in weights["layers"])
        half = cfg.head_dim // 2
        self.register_buffer("cos", torch.cat([cos[:capacity, :half]] * 2, dim=-1).contiguous())
        self.register_buffer("sin", torch.cat([sin[:capacity, :half]] * 2, dim=-1).contiguous())
        self.register_buffer("mask", torch.ones(capacity, capacity, dtype=torch.bool,
                                                device=device).tril())
        shape = (1, cfg.num_kv_heads, capacity, cfg.head_dim)
        for layer in self.layers:
            layer.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device))
            layer.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device))
        for t in [*self.parameters(), *self.buffers()]:
            # the same addresses every replay: a CUDA graph reads them in place, no copies
            torch._dynamo.mark_static_address(t)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits (1, seq, vocab) of ``ids`` (1, seq) at positions ``pos`` (seq,), writing
        their keys and values into the cache."""
        cfg = self.cfg
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[pos], self.sin[pos]  # (seq, head_dim)
        mask = self.mask[pos][None, None]  # (1, 1, seq, capacity): what each row may see
        for layer in self.layers:
            x = x + layer.attention(_rmsnorm(x, layer.attn_norm, cfg.rms_norm_eps), cos, sin,
                                    mask, pos, cfg)
            x = x + layer.mlp(_rmsnorm(x, layer.mlp_norm, cfg.rms_norm_eps))
        return F.linear(_rmsnorm(x, self.final_norm, cfg.rms_norm_eps), self.lm_head)

    def decode_one(self, token: torch.Tensor, pos: torch.Tensor):
        """One greedy step: (next token (1, 1), logits (1, vocab)) for ``token`` at ``pos``."""
        logits = self.forward(token, pos)[:, -1]
        return logits.argmax(-1, keepdim=True), logits

    @torch.no_grad()
    def prefill(self, prompt: list[int]) -> None:
        """Fill the cache with the prompt's keys and values (eager, in chunks)."""
        device = self.embed.device
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        for start in range(0, len(prompt), PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, len(prompt))
            self.forward(ids[:, start:end], torch.arange(start, end, device=device))


class _Layer(torch.nn.Module):
    def __init__(self, w: dict):
        super().__init__()
        for name in ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down"):
            setattr(self, name, _frozen(w[name]))

    def attention(self, h, cos, sin, mask, pos, cfg):
        b, s, _ = h.shape
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        g = hq // hkv
        q, k, v = F.linear(h, self.qkv).split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k = _rope(q.view(b, s, hq, d), cos, sin), _rope(k.view(b, s, hkv, d), cos, sin)
        self.k_cache.index_copy_(2, pos, k.transpose(1, 2))
        self.v_cache.index_copy_(2, pos, v.view(b, s, hkv, d).transpose(1, 2))
        # Grouped-query attention without repeating K and V per query head (gpt-fast repeats
        # them; that copies the cache every step): the g query heads sharing a KV head
        # become g query rows of that head, each under its position's mask row.
        q = q.view(b, s, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, s * g, d)
        rows = mask[:, :, :, None, :].expand(1, 1, s, g, mask.shape[-1]).reshape(
            1, 1, s * g, mask.shape[-1])
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=rows,
                                             scale=cfg.attn_scale)
        out = out.view(b, hkv, s, g, d).permute(0, 2, 1, 3, 4).reshape(b, s, hq * d)
        return F.linear(out, self.o)

    def mlp(self, h):
        gate, up = F.linear(h, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)


def _frozen(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def _rmsnorm(x, weight, eps: float):
    """Hugging Face's Llama RMSNorm: normalised in float32, scaled in the model's dtype."""
    f = x.float()
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return weight * f.to(x.dtype)


def _rope(x, cos, sin):
    """Rotary embedding, rotate-half form; x (b, seq, heads, d), cos/sin (seq, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class GreedyDecoder:
    """Greedy tokens from a StaticLlama, ``compiled`` or eager; positions cycle through
    ``start .. capacity - 1`` (cache rows past a position are masked, so going back to
    ``start`` needs no clearing). The position is kept on the host too, so that cycling
    never reads the device."""

    def __init__(self, model: StaticLlama, start: int, first_token: int, compiled: bool):
        self.model, self.start, self.first_token = model, start, first_token
        device = model.embed.device
        self.pos = torch.full((1,), start, dtype=torch.long, device=device)
        self.token = torch.full((1, 1), first_token, dtype=torch.long, device=device)
        self.position = start
        self.compile_s: float | None = None
        self.graphs = self.cudagraph_skips = 0
        self._step = model.decode_one
        if compiled:
            # dynamic=False: the 1.1B and 8B models share decode_one's code, and a second
            # shape must not turn the dimensions symbolic (static shapes, as gpt-fast has)
            self._step = torch.compile(model.decode_one, mode="reduce-overhead",
                                       fullgraph=True, dynamic=False)
            skips = _count("inductor", "cudagraph_skips")
            graphs = _count("stats", "unique_graphs")
            tuning = os.environ.get("NEEDLE_BENCH_TORCH_TUNING", "1") != "0"
            begin = time.perf_counter()
            # compiled on the first call (tuned only here: the setting is process-wide), then
            # recorded by CUDA graph trees on the third
            with torch._inductor.config.patch(coordinate_descent_tuning=tuning):
                self.run(3)
            self.restart()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.compile_s = time.perf_counter() - begin
            self.graphs = _count("stats", "unique_graphs") - graphs  # 1 unless it recompiled
            # > 0: Inductor ran the step without CUDA graphs (its log says why)
            self.cudagraph_skips = _count("inductor", "cudagraph_skips") - skips

    def restart(self) -> None:
        """Back to ``start``, fed the first token again (what the first call checks)."""
        self.pos.fill_(self.start)
        self.token.fill_(self.first_token)
        self.position = self.start

    @torch.no_grad()
    def run(self, tokens: int) -> torch.Tensor:
        """``tokens`` greedy steps; the first step's logits (a copy)."""
        first = None
        for _ in range(tokens):
            if self.position >= self.model.capacity:
                self.pos.fill_(self.start)
                self.position = self.start
            token, logits = self._step(self.token, self.pos)
            self.token = token.clone()  # a graph's output buffer is rewritten by its replay
            self.pos.add_(1)
            self.position += 1
            if first is None:
                first = logits.clone()
        return first


def _count(group: str, name: str) -> int:
    from torch._dynamo.utils import counters

    return int(counters[group][name])
