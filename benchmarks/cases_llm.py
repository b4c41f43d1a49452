"""LLM inference (issues 6 and 20): decode and prefill of Llama-family models, against
transformers and a gpt-fast-style PyTorch decode, on the same weights.

On a GPU: a TinyLlama-1.1B-shaped model (hidden 2048, 22 layers, 32 heads, 4 KV heads,
intermediate 5632, vocab 32000) and a Llama-3-8B-shaped one (hidden 4096, 32 layers, 32
heads, 8 KV heads, intermediate 14336, vocab 128256), random bfloat16 weights made in memory
(no files; ``llm_models.py`` says how). On a CPU, or with ``--quick``, tiny models of the same
proportions, as a smoke test. The peers, where present:

* ``torch``: Hugging Face transformers (eager attention, its default dynamic KV cache), 1.1B
  only. Its logits are every 1.1B case's result check.
* ``torch:compile``: the gpt-fast recipe (``torch_llama.py``): static KV cache, the one-token
  step compiled with ``mode="reduce-overhead"`` (CUDA graphs), over needle's own weight
  arrays. On devices without CUDA graphs it runs eagerly, named ``torch:static``; set
  ``NEEDLE_BENCH_TORCH_COMPILE=1`` to compile it there too. Its compile time is a note
  under the table.

Cases (``<size>`` is 1.1b / tiny, or 8b / 8b_tiny):

* ``llm_decode_<size>``: 16 consecutive greedy tokens per call after a 128-token prompt:
  the argmax included, as in generation (needle's captured decode step, replayed one step
  ahead of the host's read of each token, as ``generate`` does). Rated in tokens/s. A run
  of tokens per call, not one, so that the runner's synchronize between samples does not
  drain the pipeline every few tokens. Each call's first step's logits are its result.
* ``llm_decode_<size>_vs_limit``: the same call rated in bytes streamed per token, so that
  "% ceil" is the fraction of the bandwidth limit (measured copy bandwidth ÷ bytes per
  token). Bytes: every weight but the embedding table (one row of it is read); the KV rows
  (a few hundred positions: under 0.3% of the weights) are not counted here.
* ``llm_decode_<size>_at_<n>`` (1.1B family): greedy decode at positions n .. n + 255
  (8000 on a GPU) after a prompt of n tokens, rewinding to n: the attention reads n real
  cached rows per layer. ``..._vs_limit`` counts the weights plus the K and V rows read per
  token (all layers, at the window's mean position).
* ``llm_prefill_<n>_<size>``: a prompt of n tokens from an empty cache to the last position's
  logits (2048 tokens on a GPU, and a short prompt of 100). Rated in tokens/s. Where the
  backend records work, ``needle`` replays the captured prefill of the prompt's bucket
  (``prefill_graphs.py``; the 100-token prompt pads to 128) and ``needle:eager`` issues
  the same prefill op by op from Python.
* ``llm_decode_<size>_sampled``: as the decode case, with temperature 0.8 and top-p 0.9
  drawn on the device (where the backend can; on the host elsewhere), against needle's own
  greedy decode in the same run.

A family's models are built once per run and shared by its cases; the last case to run, or
the first case of another family, drops them.
"""

from __future__ import annotations

import atexit
import gc
import math
import os

import numpy as np

from .llm_models import (
    TINY,  # noqa: F401 - scripts/cpu_busy.py reads it from here
    DeviceRandom,
    Family,
    families,
    hf_config,
    hf_model,
    host_random_weights,
    kv_bytes_per_position,
    reuse_weights,
    static_llama,
    weight_bytes,
)
from .runner import Bench, Case, Context, Impl, Skip

DECODE_PROMPT = 128
DECODE_TOKENS = 16  # greedy tokens per timed call
SHORT_PROMPT = 100  # a chat turn: the prefill case where the host time dominates
PEER_WINDOW = 256  # positions past the prompt the gpt-fast peer's static cache holds
# The token fed after the prompt, the same for every framework: each one's own argmax of
# bf16 logits of random weights can differ, and then so would every step after it.
FIRST_TOKEN = 7
_GROUP = "llm"
_random_weights = host_random_weights  # the name scripts/cpu_busy.py knows
_CASES_LEFT: dict[str, set[str]] = {}  # family key -> its cases not yet built
_BUILT: dict[str, _Models] = {}  # family key -> its models (one family at a time)


@atexit.register
def _drop_models() -> None:
    """Models kept by cases that were not selected go before the interpreter's teardown:
    torch tensors viewing needle arrays (DLPack) would otherwise outlive needle's bindings."""
    _BUILT.clear()
    gc.collect()


class _Models:
    """One family's needle model, its transformers twin (1.1B, when present), and the
    gpt-fast-style peers and long-cache model, made when first asked for."""

    def __init__(self, ctx: Context, family: Family | None = None):
        from needle.backend_ndarray import NDArray
        from needle.models import LlamaConfig, LlamaForCausalLM

        family = family or families(ctx)["1.1b"]  # (scripts/profile_decode.py's default)
        self.ctx, self.family, self.dtype = ctx, family, family.dtype
        self.capacity = max(family.prefill, DECODE_PROMPT + 1024)
        self.long_capacity = family.long_prompt + family.long_window + DECODE_TOKENS
        raw = hf_config(family.shapes, max(4096, self.long_capacity))
        self.config = LlamaConfig.from_dict(raw, source="benchmark config")
        self.hf = None
        if family.key == "8b":  # 16 GB: made on the device, no transformers twin
            source = DeviceRandom(ctx, self.dtype)
        else:
            weights = host_random_weights(self.config, self.dtype)
            source = lambda name, shape: NDArray(  # noqa: E731
                weights[name], device=ctx.device, dtype=self.dtype)
        self.model = LlamaForCausalLM(self.config, source, self.capacity, ctx.device,
                                      self.dtype)
        if family.key != "8b":
            self.hf = hf_model(ctx, raw, weights, self.dtype)
        self._long = None
        self._peers: dict[str, object] = {}

    @property
    def prefill_len(self) -> int:
        return self.family.prefill

    def streamed_bytes(self) -> int:
        """Weight bytes one decode step reads (scripts/profile_decode.py's limit)."""
        return weight_bytes(self.config, self.dtype)

    def long_model(self):
        """needle's model over the same weights with a cache of ``long_capacity`` positions
        (the decode cases keep their own, shorter one, as before these cases existed)."""
        if self._long is None:
            from needle.models import LlamaForCausalLM

            self._long = LlamaForCausalLM(self.config, reuse_weights(self.model),
                                          self.long_capacity, self.ctx.device, self.dtype)
        return self._long

    def peer(self, long: bool):
        """(name, decoder, notes) of the gpt-fast-style peer at the short or long position,
        restarted at its first step; built, prefilled and compiled on first use."""
        key = "long" if long else "short"
        if key not in self._peers:
            try:
                self._peers[key] = self._make_peer(long)
            except Exception as e:  # remembered: the next case does not compile it again
                self._peers[key] = e
        if isinstance(self._peers[key], Exception):
            raise self._peers[key]
        name, decoder, notes = self._peers[key]
        decoder.restart()
        return name, decoder, notes

    def _make_peer(self, long: bool):
        from .torch_llama import GreedyDecoder

        fw = self.ctx.frameworks["torch"]
        fam = self.family
        start = fam.long_prompt if long else DECODE_PROMPT
        model = static_llama(self.ctx, self.long_model() if long else self.model,
                             start + (fam.long_window if long else PEER_WINDOW))
        model.prefill([int(t) for t in _prompt(start, self.config.vocab_size)[0]])
        asked = os.environ.get("NEEDLE_BENCH_TORCH_COMPILE")  # "1": also without CUDA
        compiled = asked != "0" and (fw.device.type == "cuda" or asked == "1")
        decoder = GreedyDecoder(model, start, FIRST_TOKEN, compiled)
        if not compiled:
            why = ("NEEDLE_BENCH_TORCH_COMPILE=0" if asked == "0" else
                   f"reduce-overhead (CUDA graphs) needs CUDA, not {fw.device.type} "
                   f"(NEEDLE_BENCH_TORCH_COMPILE=1 compiles it anyway)")
            return "torch:static", decoder, [
                f"torch:static is the gpt-fast-style model run eagerly: {why}"]
        tuning = os.environ.get("NEEDLE_BENCH_TORCH_TUNING", "1") != "0"
        notes = [f"torch:compile (static cache of {model.capacity} positions, "
                 f"mode=reduce-overhead, coordinate-descent tuning {'on' if tuning else 'off'})"
                 f" compiled and recorded in {decoder.compile_s:.1f} s "
                 f"({decoder.graphs} graph{'s' if decoder.graphs != 1 else ''})"]
        if decoder.cudagraph_skips:
            notes.append("torch:compile ran WITHOUT CUDA graphs (Inductor's cudagraph_skips "
                         f"counter rose by {decoder.cudagraph_skips}"
                         f"{'; a CPU has none' if fw.device.type == 'cpu' else ''})")
        return "torch:compile", decoder, notes


def _models(ctx: Context, family: Family, case: str) -> _Models:
    """The family's shared models, built on first use (after dropping another family's);
    dropped when its last case takes them."""
    for key in [k for k in _BUILT if k != family.key]:
        _BUILT.pop(key)
        if "torch" in ctx.frameworks:  # its compiled steps (and their CUDA graphs) go too
            ctx.frameworks["torch"].torch._dynamo.reset()
    if family.key not in _BUILT:
        _BUILT[family.key] = _Models(ctx, family)
    built = _BUILT[family.key]
    left = _CASES_LEFT.setdefault(family.key, set())
    left.discard(case)
    if not left:
        _BUILT.pop(family.key)
    return built


# --- implementations --------------------------------------------------------------------------

def _prompt(length: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(1).integers(0, vocab, (1, length))


def _needle_decode(m: _Models, sampled: bool = False, long: bool = False) -> Impl:
    """16 tokens per call as generation makes them: chosen on the device (the argmax, or a
    draw with temperature 0.8 and top-p 0.9), one step queued ahead of the host's read.
    Positions run from the prompt's end to the cache's end (long: the window's), then
    rewind to the prompt's end."""
    from needle.models import Sampler

    model = m.long_model() if long else m.model
    start = m.family.long_prompt if long else DECODE_PROMPT
    limit = m.long_capacity - DECODE_TOKENS if long else m.capacity
    decoder = model.decoder()
    kind = "sampled" if sampled else "greedy"
    prompt = [int(t) for t in _prompt(start, m.config.vocab_size)[0]]
    logits = decoder.prefill(prompt)
    if sampled:
        sampler = Sampler(temperature=0.8, top_p=0.9, seed=0)
        sampler.observe(prompt)
        decoder.start_sampling(sampler, prompt)
        token = decoder.sample_first(logits)
    else:
        token = FIRST_TOKEN
    state = {"token": token, "steps": None}

    def step():
        first, todo = None, DECODE_TOKENS
        if state["steps"] is None and not sampled:  # the first call (checked against torch)
            state["steps"] = iter(())
            state["token"] = decoder.greedy_step(state["token"])
            first, todo = decoder.last_logits.copy(), DECODE_TOKENS - 1
        for _ in range(todo):
            token = next(state["steps"], None) if state["steps"] is not None else None
            if token is None:  # the window is used up (or streaming starts): rewind, stream
                if decoder.length >= limit:
                    state["steps"] = None  # close the old stream before rewinding
                    decoder.rewind(start)
                state["steps"] = decoder.stream(kind, state["token"], limit - decoder.length)
                token = next(state["steps"])
            state["token"] = token
        return first if first is not None else decoder.last_logits

    return Impl(step, [()])


def _hf_decode(m: _Models, ctx: Context, long: bool = False) -> Impl:
    torch = ctx.frameworks["torch"].torch
    start = m.family.long_prompt if long else DECODE_PROMPT
    limit = m.long_capacity - DECODE_TOKENS if long else m.capacity
    ids = torch.as_tensor(_prompt(start, m.config.vocab_size), device=m.hf.device)
    with torch.no_grad():
        out = m.hf(ids, use_cache=True, logits_to_keep=1)
    state = {"cache": out.past_key_values,
             "token": torch.full((1, 1), FIRST_TOKEN, dtype=torch.long, device=ids.device)}

    @torch.no_grad()
    def step():
        first = None
        for _ in range(DECODE_TOKENS):
            cache = state["cache"]
            if cache.get_seq_length() >= limit:
                cache.crop(start - cache.get_seq_length())
            out = m.hf(state["token"], past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]
            state["cache"], state["token"] = out.past_key_values, logits.argmax(-1, keepdim=True)
            first = logits if first is None else first
        return first

    return Impl(step, [()])


def _needle_prefill(m: _Models, n: int, captured: bool = True) -> Impl:
    """The decoder's prefill: where the backend records work, the bucket's captured graph
    replayed (the default), or (``captured=False``) issued op by op from Python."""
    if captured:
        decoder = m.model.decoder()
    else:
        from needle.models.decoder import Decoder

        decoder = Decoder(m.model)
        decoder.prefills.limit = 0
    ids = _prompt(n, m.config.vocab_size)[0]
    return Impl(lambda: decoder.prefill(ids), [()])


def _hf_prefill(m: _Models, ctx: Context, n: int) -> Impl:
    torch = ctx.frameworks["torch"].torch
    ids = torch.as_tensor(_prompt(n, m.config.vocab_size), device=m.hf.device)

    @torch.no_grad()
    def run():
        return m.hf(ids, use_cache=True, logits_to_keep=1).logits[:, -1]

    return Impl(run, [()])


def _rtol(m: _Models, peers: bool = True) -> float | None:
    """Same weights, different summation orders: bf16 logits agree to a few percent, and the
    disagreement grows with depth like a random walk (H100: 3-5% between three frameworks at
    22 layers; 5.1% and 5.4% for two needle attention kernels against the compiled PyTorch
    peer at 32 layers), so the bound is 5% at 22 layers, scaled by sqrt(layers / 22)."""
    if not peers:
        return None
    if m.dtype == "float32":
        return 1e-3
    return 5e-2 * max(1.0, math.sqrt(m.config.num_layers / 22))


def _decode_impls(m: _Models, ctx: Context, long: bool) -> tuple[dict[str, Impl], list[str]]:
    """needle's decode and the peers' (transformers first: it is the result check where
    present; the gpt-fast-style peer where torch is)."""
    impls = {"needle": _needle_decode(m, long=long)}
    notes: list[str] = []
    if m.hf is not None:
        impls["torch"] = _hf_decode(m, ctx, long)
    if "torch" in ctx.frameworks:
        try:
            name, decoder, notes = m.peer(long)
        except Skip as e:
            return impls, [f"no gpt-fast-style peer: {e}"]
        except Exception as e:  # a peer that cannot be built must not cost needle's figures
            first = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            return impls, [f"the gpt-fast-style peer could not be built: {first}"]
        impls[name] = Impl(lambda: decoder.run(DECODE_TOKENS), [()])
    return impls, notes


def _decode_case(name: str, family: Family, rated_by_bytes: bool, long: bool = False) -> Case:
    def build(ctx: Context) -> Bench:
        m = _models(ctx, family, name)
        impls, notes = _decode_impls(m, ctx, long)
        rtol = _rtol(m, len(impls) > 1)
        if not rated_by_bytes:
            return Bench(impls, count=DECODE_TOKENS, count_unit="tok", rtol=rtol, notes=notes)
        per_token = weight_bytes(m.config, m.dtype)
        if long:  # token at position p reads p + 1 cached rows; positions start .. start+W-1
            mean_rows = family.long_prompt + (family.long_window + 1) / 2
            kv = kv_bytes_per_position(m.config, m.dtype) * mean_rows
            notes = notes + [f"bytes per token: {per_token / 1e6:.1f} MB of weights + "
                             f"{kv / 1e6:.1f} MB of K and V ({mean_rows:.1f} rows, all "
                             "layers, the mean position of the window)"]
            per_token += int(kv)
        return Bench(impls, bytes=per_token * DECODE_TOKENS, rtol=rtol, notes=notes)

    return Case(name, _GROUP, build)


def _sampled_case(name: str, family: Family) -> Case:
    """Sampled decode (temperature 0.8, top-p 0.9, drawn on the device) against greedy
    decode of the same model in the same run: the needle÷needle:greedy column is the cost
    of sampling (the target is at most 1/0.95 = 1.05)."""

    def build(ctx: Context) -> Bench:
        m = _models(ctx, family, name)
        impls = {"needle": _needle_decode(m, sampled=True),
                 "needle:greedy": _needle_decode(m)}
        return Bench(impls, count=DECODE_TOKENS, count_unit="tok", rtol=None)

    return Case(name, _GROUP, build)


def _prefill_case(name: str, family: Family, n: int) -> Case:
    """A prompt of n tokens: needle's prefill (captured per bucket where the backend records
    work; ``needle:eager`` issued from Python, where that differs) and transformers'."""

    def build(ctx: Context) -> Bench:
        m = _models(ctx, family, name)
        impls = {"needle": _needle_prefill(m, n)}
        if m.model.decoder().prefills.applies(n):
            impls["needle:eager"] = _needle_prefill(m, n, captured=False)
        if m.hf is not None:
            impls["torch"] = _hf_prefill(m, ctx, n)
        return Bench(impls, count=n, count_unit="tok", rtol=_rtol(m, m.hf is not None))

    return Case(name, _GROUP, build)


def cases(ctx: Context) -> list[Case]:
    fams = families(ctx)
    small, big = fams["1.1b"], fams["8b"]
    s, b = small.size, big.size
    long = f"llm_decode_{s}_at_{small.long_prompt}"
    plan = [(small, _decode_case(f"llm_decode_{s}", small, False)),
            (small, _decode_case(f"llm_decode_{s}_vs_limit", small, True)),
            (small, _prefill_case(f"llm_prefill_{small.prefill}_{s}", small, small.prefill)),
            (small, _prefill_case(f"llm_prefill_{SHORT_PROMPT}_{s}", small, SHORT_PROMPT)),
            (small, _sampled_case(f"llm_decode_{s}_sampled", small)),
            (small, _decode_case(long, small, False, long=True)),
            (small, _decode_case(f"{long}_vs_limit", small, True, long=True)),
            (big, _decode_case(f"llm_decode_{b}", big, False)),
            (big, _decode_case(f"llm_decode_{b}_vs_limit", big, True))]
    _CASES_LEFT.clear()
    for fam, case in plan:
        _CASES_LEFT.setdefault(fam.key, set()).add(case.name)
    return [case for _, case in plan]
