"""Gemma 3 (1B shapes) or Gemma 2 (2B shapes) on one device: decode, time to first token
and serving, against transformers on the same weights, in one run.

    python -m benchmarks.gemma3 [--device cuda] [--prompts 16,1000,3000] [--quick]
    python -m benchmarks.gemma3 --family gemma2 [--device cuda]

The model is Gemma-3-1B-shaped (hidden 1152, 26 layers of which 22 slide over a 512-position
window, 4 query heads and 1 KV head of 256, intermediate 6912, a tied 262,144-token
vocabulary; about 1.0 B parameters) with random bf16 weights, made by transformers'
``Gemma3ForCausalLM`` and written with ``save_pretrained`` (as the Hub's checkpoint is);
``--quick`` uses a tiny one in float32 (a smoke test on the CPU). needle loads the directory
with ``load_pretrained``; transformers (eager, its default generate and cache) runs the very
same model object it wrote. ``--family gemma2``: Gemma-2-2B-shaped instead (hidden 2304, 26
layers alternating 4,096-position windows and global attention, 8 query heads and 4 KV
heads of 256, intermediate 9216, a tied 256,000-token vocabulary, attention scores capped
at 50 and logits at 30; about 2.6 B parameters).

Printed per prompt length: needle's decode tokens/s (greedy, 128 tokens after the prompt,
the time of the first token taken off), its time to first token (the prompt's prefill and
the first token: median of 5), the logits' largest difference from transformers' over the
first 64 prompt tokens (relative to their largest magnitude), and transformers' two figures
(32 decode tokens; median of 3 for the first token). Then the decode rate as a share of the
bandwidth limit (copy bandwidth, read + write, of a 1 GiB device copy measured in the same
run, divided by the weight bytes one step reads: every projection and the tied output head;
the benchmarks' llm cases count the same way) and ``needle.serve.Engine`` at 1, 8 and 32
streams of 64 tokens after 600-token prompts (tok/s including the prompts), and how many of
its greedy tokens equal ``generate``'s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from .quant_decode import copy_bandwidth

GEMMA3_1B = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                 num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                 head_dim=256, sliding_window=512, max_position_embeddings=32768,
                 query_pre_attn_scalar=256)
GEMMA2_2B = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                 num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=256, sliding_window=4096, max_position_embeddings=8192,
                 query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
            max_position_embeddings=512, query_pre_attn_scalar=16)


def build(directory: Path, quick: bool, torch_device: str, family: str = "gemma3"):
    """The transformers model (bf16, or float32 with ``quick``), saved to ``directory``."""
    import torch
    import transformers

    if family == "gemma2":
        config = transformers.Gemma2Config(**(
            {**TINY, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
            if quick else GEMMA2_2B))
        config._attn_implementation = "eager"  # transformers' choice for soft-capped models
        model_class = transformers.Gemma2ForCausalLM
    else:
        config = transformers.Gemma3TextConfig(**(TINY if quick else GEMMA3_1B))
        model_class = transformers.Gemma3ForCausalLM
    torch.manual_seed(0)
    with torch.device(torch_device):
        model = model_class(config).eval()
    if not quick:
        model = model.to(torch.bfloat16)
    model.save_pretrained(directory)
    return model


def _median(f, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(model, hf, prompt: list[int], tokens: int, torch_device: str) -> dict:
    """needle's and transformers' decode rate and first-token time for one prompt."""
    import torch

    ids = np.array([prompt[:64]])
    with torch.no_grad():
        ref = hf(torch.tensor(ids, device=torch_device)).logits.float().cpu().numpy()
    got = model(ids).numpy().astype(np.float64)
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    model.generate(prompt, max_new_tokens=4, stop=())  # compiles, captures
    ttft = _median(lambda: model.generate(prompt, max_new_tokens=1, stop=()), 5)
    whole = _median(lambda: model.generate(prompt, max_new_tokens=tokens + 1, stop=()), 3)
    tensor = torch.tensor([prompt], device=torch_device)

    def hf_generate(n: int) -> None:
        with torch.no_grad():
            hf.generate(tensor, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        if torch_device == "cuda":
            torch.cuda.synchronize()

    hf_generate(2)
    hf_ttft = _median(lambda: hf_generate(1), 3)
    hf_whole = _median(lambda: hf_generate(33), 1)
    return {"tok_s": tokens / (whole - ttft), "ttft": ttft, "err": err,
            "hf_tok_s": 32 / (hf_whole - hf_ttft), "hf_ttft": hf_ttft}


def serving(model, quick: bool) -> tuple[str, list[tuple[int, float]]]:
    """(how many of the engine's greedy tokens equal generate's, [(streams, tok/s)]) over
    600-token prompts (60 with ``quick``). Random bf16 weights leave near-ties among the
    logits, which the two paths' different sums may break apart, so the agreement is
    reported, not required (the tests require it, in float32)."""
    from needle.serve import Engine, RequestParams

    rng = np.random.default_rng(1)
    length = 60 if quick else 600
    prompts = [rng.integers(3, model.config.vocab_size, length).tolist() for _ in range(32)]
    single = [model.generate(p, 16, temperature=0, stop=()) for p in prompts[:4]]
    engine = Engine(model, max_seqs=4)
    reqs = [engine.submit(p, RequestParams(max_tokens=16, ignore_eos=True))
            for p in prompts[:4]]
    engine.run_until_idle()
    same = sum(a == b for r, want in zip(reqs, single) for a, b in zip(r.output, want))
    agreement = f"{same} of {sum(map(len, single))} greedy tokens as generate's"
    rates = []
    for streams in (1, 8, 32):
        engine = Engine(model, max_seqs=streams)
        for p in prompts[:streams]:  # warm: prefill paths, captured steps
            engine.submit(p, RequestParams(max_tokens=4, ignore_eos=True))
        engine.run_until_idle()
        for p in prompts[:streams]:
            engine.submit(p, RequestParams(max_tokens=64, ignore_eos=True))
        start = time.perf_counter()
        engine.run_until_idle()
        rates.append((streams, streams * 64 / (time.perf_counter() - start)))
    return agreement, rates


def main(argv: list[str] | None = None) -> None:
    from needle import backend_ndarray as nd
    from needle.models import load_pretrained
    from needle.models.memory import estimate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="needle device (default: the best)")
    parser.add_argument("--prompts", default="16,1000,3000",
                        help="prompt lengths, comma-separated")
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens timed")
    parser.add_argument("--quick", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument("--family", choices=("gemma3", "gemma2"), default="gemma3",
                        help="Gemma-3-1B shapes (default) or Gemma-2-2B shapes")
    args = parser.parse_args(argv)
    device = nd.device_from_name(args.device) if args.device else nd.default_device()
    torch_device = "cuda" if device.kind == "cuda" else "cpu"
    lengths = [int(n) for n in args.prompts.split(",")]
    if args.quick:
        lengths = [min(n, 100) for n in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        hf = build(Path(tmp), args.quick, torch_device, args.family)
        model = load_pretrained(tmp, device=device, max_seq_len=4096 if not args.quick else 256)
    rng = np.random.default_rng(0)
    rows = {n: compare(model, hf, rng.integers(3, model.config.vocab_size, n).tolist(),
                       args.tokens, torch_device) for n in lengths}
    copy = copy_bandwidth(device)
    # every weight once: the tied output head reads the whole embedding table
    step_bytes = estimate(model.config, model.weights.embed.dtype, 1).weights
    limit = copy / step_bytes  # the weights read at the copy rate (as the llm cases count)
    print(f"\n{'prompt':>6} {'needle tok/s':>12} {'% limit':>8} {'TTFT ms':>8} "
          f"{'rel err':>8} {'transformers tok/s':>18} {'TTFT ms':>8}")
    for n, r in rows.items():
        print(f"{n:6d} {r['tok_s']:12.1f} {100 * r['tok_s'] / limit:7.0f}% "
              f"{r['ttft'] * 1e3:8.1f} {r['err']:8.4f} {r['hf_tok_s']:18.1f} "
              f"{r['hf_ttft'] * 1e3:8.1f}")
    print(f"\nweights a step reads {step_bytes / 1e9:.2f} GB; copy {copy / 1e9:.0f} GB/s "
          f"(read + write): limit {limit:.0f} tok/s; device {device.name}")
    agreement, rates = serving(model, args.quick)
    for streams, rate in rates:
        print(f"serving {streams:2d} streams: {rate:9.1f} tok/s (prompts included)")
    print(f"serving: {agreement}")


if __name__ == "__main__":
    main()
