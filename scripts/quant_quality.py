"""Quality of needle's quantized formats on a model trained with needle itself.

    python scripts/quant_quality.py [--steps 400] [--out /tmp/needle-quality]

1. Trains a small Llama-architecture LM (byte-level vocabulary of 256, RMSNorm, RoPE,
   grouped-query attention, SwiGLU: the layout of transformers' LlamaForCausalLM) with
   needle's autograd and Adam on the source of Python's ``argparse`` module (a text every
   Python ships), on the CPU.
2. Saves it in the Hugging Face format (config.json + model.safetensors in bfloat16), loads
   it back with ``load_pretrained`` (the bf16 reference), and writes quantized copies with
   ``needle quantize``'s function: int8 per channel; int4 with groups of 128, 64 and 32,
   symmetric and with offsets.
3. On held-out text (the source of ``difflib``), prints for each: max and mean |logit -
   reference logit| and the perplexity next to the reference's (float32 activations, so the
   weights' quantization is all that differs).
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import needle as ndl  # noqa: E402
from needle import backend_ndarray as nd  # noqa: E402
from needle import nn, ops  # noqa: E402

CONFIG = dict(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, rope_theta=10000.0)
FORMATS = [("int8", 8, None, True), ("int4 g128", 4, 128, True),
           ("int4 g128 +off", 4, 128, False), ("int4 g64", 4, 64, True),
           ("int4 g64 +off", 4, 64, False), ("int4 g32", 4, 32, True),
           ("int4 g32 +off", 4, 32, False)]


class Block(nn.Module):
    def __init__(self, c, device):
        super().__init__()
        h, inter = c["hidden_size"], c["intermediate_size"]
        self.heads, self.kv = c["num_attention_heads"], c["num_key_value_heads"]
        self.d = h // self.heads
        lin = lambda i, o: nn.Linear(i, o, bias=False, device=device)  # noqa: E731
        self.attn_norm, self.mlp_norm = nn.RMSNorm(h, 1e-5, device), nn.RMSNorm(h, 1e-5, device)
        self.q, self.k, self.v = lin(h, h), lin(h, self.kv * self.d), lin(h, self.kv * self.d)
        self.o, self.gate, self.up, self.down = lin(h, h), lin(h, inter), lin(h, inter), \
            lin(inter, h)

    def forward(self, x, cos, sin):
        b, t, h = x.shape
        a = self.attn_norm(x)
        q = ops.rope(ops.reshape(self.q(a), (b, t, self.heads, self.d)), cos, sin)
        k = ops.rope(ops.reshape(self.k(a), (b, t, self.kv, self.d)), cos, sin)
        v = ops.reshape(self.v(a), (b, t, self.kv, self.d))
        perm = (0, 2, 1, 3)
        out = ops.scaled_dot_product_attention(ops.permute(q, perm), ops.permute(k, perm),
                                               ops.permute(v, perm), causal=True)
        x = x + self.o(ops.reshape(ops.permute(out, perm), (b, t, h)))
        m = self.mlp_norm(x)
        return x + self.down(ops.silu_mul(self.gate(m), self.up(m)))


class TinyLlama(nn.Module):
    def __init__(self, c, device):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c["vocab_size"], c["hidden_size"], device=device)
        self.embed.weight.data = self.embed.weight.data * 0.02
        self.blocks = [Block(c, device) for _ in range(c["num_hidden_layers"])]
        self.norm = nn.RMSNorm(c["hidden_size"], 1e-5, device)
        self.head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False, device=device)
        d = c["hidden_size"] // c["num_attention_heads"]
        inv = 1.0 / (c["rope_theta"] ** (np.arange(0, d, 2) / d))
        ang = np.outer(np.arange(c["max_position_embeddings"]), inv)
        self.cos_np, self.sin_np, self.device = np.cos(ang), np.sin(ang), device

    def forward(self, ids):
        t = ids.shape[1]
        cos = ndl.Tensor(nd.array(self.cos_np[:t].astype(np.float32), device=self.device),
                         requires_grad=False)
        sin = ndl.Tensor(nd.array(self.sin_np[:t].astype(np.float32), device=self.device),
                         requires_grad=False)
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.head(self.norm(x))

    def hf_state(self) -> dict[str, np.ndarray]:
        """Weights by transformers' LlamaForCausalLM names; Linear weights (out, in)."""
        w = lambda p: p.numpy()  # noqa: E731
        out = {"model.embed_tokens.weight": w(self.embed.weight),
               "model.norm.weight": w(self.norm.weight), "lm_head.weight": w(self.head.weight).T}
        for i, b in enumerate(self.blocks):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = w(b.attn_norm.weight)
            out[p + "post_attention_layernorm.weight"] = w(b.mlp_norm.weight)
            for name, lin in (("self_attn.q_proj", b.q), ("self_attn.k_proj", b.k),
                              ("self_attn.v_proj", b.v), ("self_attn.o_proj", b.o),
                              ("mlp.gate_proj", b.gate), ("mlp.up_proj", b.up),
                              ("mlp.down_proj", b.down)):
                out[f"{p}{name}.weight"] = w(lin.weight).T
        return out


def train(text: bytes, steps: int, device, seq: int = 128, batch: int = 16):
    data = np.frombuffer(text, np.uint8).astype(np.int64)
    model = TinyLlama(CONFIG, device)
    opt = ndl.optim.Adam(model.parameters(), lr=2e-3)
    loss_fn = nn.SoftmaxLoss()
    rng = np.random.default_rng(0)
    start = time.time()
    for step in range(steps):
        at = rng.integers(0, len(data) - seq - 1, batch)
        x = np.stack([data[a:a + seq] for a in at])
        y = np.stack([data[a + 1:a + seq + 1] for a in at])
        # warm-up, then cosine decay
        opt.lr = 2e-3 * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * step / steps))
        logits = model(ndl.Tensor(nd.array(x, device=device, dtype="int64"),
                                  requires_grad=False))
        loss = loss_fn(logits, ndl.Tensor(nd.array(y, device=device, dtype="int64"),
                                          requires_grad=False))
        opt.reset_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step:4d}  loss {float(loss.numpy()):.3f}  ({time.time() - start:.0f}s)",
                  flush=True)
    return model


def save_hf(model: TinyLlama, directory: Path) -> None:
    import ml_dtypes
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {k: np.ascontiguousarray(v.astype(np.float32)) for k, v in model.hf_state().items()}
    save_file(state, str(directory / "model.safetensors"))  # float32 on disk; bf16 below
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": None,
           "eos_token_id": None, **CONFIG}
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    # store the weights as bf16 values (the checkpoint dtype the comparison starts from)
    bf16 = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in state.items()}
    save_file(bf16, str(directory / "model.safetensors"))


def evaluate(model, ids: np.ndarray, window: int = 256):
    """Logits of consecutive windows of held-out ids, and the perplexity over them."""
    logits, nll, count = [], 0.0, 0
    for a in range(0, len(ids) - window - 1, window):
        chunk = ids[a:a + window + 1]
        out = model([chunk[:-1].tolist()]).numpy()[0].astype(np.float64)
        logits.append(out)
        z = out - out.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        nll -= logp[np.arange(window), chunk[1:]].sum()
        count += window
    return np.concatenate(logits), math.exp(nll / count)


def main(argv=None) -> None:
    from needle.models import load_pretrained
    from needle.models.quantized import quantize_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", default="/tmp/needle-quality")
    p.add_argument("--device", default="cpu")
    p.add_argument("--eval-bytes", type=int, default=16384)
    args = p.parse_args(argv)
    out = Path(args.out)
    device = nd.device_from_name(args.device)
    train_text = inspect.getsource(argparse).encode()
    held_out = np.frombuffer(inspect.getsource(difflib).encode()[:args.eval_bytes], np.uint8)
    print(f"training on argparse.py ({len(train_text)} bytes), {args.steps} steps, "
          f"{device.name}", flush=True)
    model = train(train_text, args.steps, device)
    save_hf(model, out / "bf16")
    ref_model = load_pretrained(out / "bf16", device=device, dtype="float32")
    ref, ref_ppl = evaluate(ref_model, held_out)
    rows = [("bf16 (reference)", 0.0, 0.0, ref_ppl)]
    for name, bits, group, sym in FORMATS:
        qdir = quantize_checkpoint(out / "bf16", out / name.replace(" ", "_").replace("+", ""),
                                   bits, group, sym, progress=False)
        q, ppl = evaluate(load_pretrained(qdir, device=device, dtype="float32"), held_out)
        err = np.abs(q - ref)
        rows.append((name, float(err.max()), float(err.mean()), ppl))
    print(f"\nheld-out: difflib.py, first {len(held_out)} bytes; logits over a vocabulary of "
          "256 bytes")
    print(f"{'format':<18} {'max |dlogit|':>12} {'mean |dlogit|':>13} {'perplexity':>11} "
          f"{'delta':>8}")
    for name, mx, mean, ppl in rows:
        print(f"{name:<18} {mx:12.4f} {mean:13.5f} {ppl:11.4f} "
              f"{100 * (ppl / ref_ppl - 1):7.2f}%")


if __name__ == "__main__":
    main()
