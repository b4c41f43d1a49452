"""LLM inference (issue 6): decode and prefill of a Llama-family model, against transformers.

On a GPU the model is TinyLlama-1.1B-shaped (hidden 2048, 22 layers, 32 heads, 4 KV heads,
intermediate 5632, vocab 32000) with random bfloat16 weights made in memory (no files); on a
CPU, or with ``--quick``, a tiny one of the same family, as a smoke test. needle and Hugging
Face transformers (eager attention, its default dynamic KV cache) get the *same* weights, so
their logits are compared as every case's result check.

* ``llm_decode_<size>``: 16 consecutive greedy tokens per call after a 128-token prompt:
  sampled argmax included, as in generation (needle's captured decode step, replayed one
  step ahead of the host's read of each token, as ``generate`` does). Rated in tokens/s.
  A run of tokens per call, not one, so that the runner's synchronize between samples does
  not drain the pipeline every few tokens. Each call's first step's logits are its result.
* ``llm_decode_<size>_vs_limit``: the same call rated in bytes of weights streamed per token,
  so that "% ceil" is the fraction of the bandwidth limit (measured copy bandwidth ÷ weight
  bytes; the embedding table is not streamed, only one row of it is read).
* ``llm_prefill_<n>_<size>``: a prompt of n tokens from an empty cache to the last position's
  logits (2048 tokens on a GPU). Rated in tokens/s.
* ``llm_decode_<size>_sampled``: as the decode case, with temperature 0.8 and top-p 0.9
  drawn on the device (where the backend can; on the host elsewhere), against needle's own
  greedy decode in the same run.

The models are built once per run and shared by the three cases (building 1.1B random
weights takes a while); the last case to run drops them.
"""

from __future__ import annotations

import numpy as np

from needle.backend_ndarray.dtypes import ITEMSIZE

from .runner import Bench, Case, Context, Impl

DECODE_PROMPT = 128
DECODE_TOKENS = 16  # greedy tokens per timed call
# The token fed after the prompt, the same for every framework: each one's own argmax of
# bf16 logits of random weights can differ, and then so would every step after it.
FIRST_TOKEN = 7
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
_GROUP = "llm"
_CASES_LEFT: set[str] = set()
_BUILT: dict[str, object] = {}


def _setup(ctx: Context) -> tuple[str, dict, str, int]:
    """(size name, config, dtype, prefill length) for this device."""
    if ctx.gpu and not ctx.quick:
        return "1.1b", TINYLLAMA, "bfloat16", 2048
    return "tiny", TINY, ("float32" if ctx.kind.startswith("cpu") else "bfloat16"), 64


class _Models:
    """The needle model and (when transformers is present) its twin, over the same weights."""

    def __init__(self, ctx: Context):
        from needle.models import LlamaConfig, LlamaForCausalLM

        _, hf_config, dtype, prefill = _setup(ctx)
        raw = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
               **hf_config}
        self.config = LlamaConfig.from_dict(raw, source="benchmark config")
        self.dtype, self.prefill_len = dtype, prefill
        self.capacity = max(prefill, DECODE_PROMPT + 1024)
        self.weights = _random_weights(self.config, dtype)
        self.model = LlamaForCausalLM(
            self.config, lambda name, shape: _to_needle(self.weights[name], ctx, dtype),
            self.capacity, ctx.device, dtype)
        self.hf = _hf_model(ctx, raw, self.weights, dtype)
        self.weights = None  # the host copy is no longer needed

    def streamed_bytes(self) -> int:
        """Weight bytes one decode step reads: all but the embedding table (one row of it)."""
        cfg = self.config
        shapes = cfg.tensor_shapes()
        total = sum(int(np.prod(s)) for s in shapes.values())
        return (total - cfg.vocab_size * cfg.hidden_size + cfg.hidden_size) * ITEMSIZE[self.dtype]


def _random_weights(cfg, dtype: str) -> dict[str, np.ndarray]:
    """Uniform weights of std 0.02 (norm scales near 1), in the model's dtype on the host."""
    from needle.backend_ndarray.dtypes import to_numpy_dtype

    rng = np.random.default_rng(0)
    amplitude = np.float32(0.02 * np.sqrt(3))
    out = {}
    for name, shape in cfg.tensor_shapes().items():
        if name.endswith("norm.weight"):
            x = 1 + 0.1 * rng.random(shape, dtype=np.float32)
        else:
            x = (rng.random(shape, dtype=np.float32) * 2 - 1) * amplitude
        out[name] = x.astype(to_numpy_dtype(dtype))
    return out


def _to_needle(host: np.ndarray, ctx: Context, dtype: str):
    from needle.backend_ndarray import NDArray

    return NDArray(host, device=ctx.device, dtype=dtype)


def _hf_model(ctx: Context, raw: dict, weights: dict[str, np.ndarray], dtype: str):
    """transformers' LlamaForCausalLM on the peer device with ``weights``, or None."""
    fw = ctx.frameworks.get("torch")
    if fw is None:
        return None
    try:
        import transformers
    except ImportError:
        return None
    torch = fw.torch
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    config = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    config._attn_implementation = "eager"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(tdtype)  # what from_pretrained does: rotary tables stay float32
    try:
        with torch.device(fw.device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    state = {}
    for name, array in weights.items():
        t = (torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
             if dtype == "bfloat16" else torch.from_numpy(array))
        state[name] = t
    model.load_state_dict(state)
    return model.eval()


def _models(ctx: Context, case: str) -> _Models:
    """The shared models, built on first use; dropped when the last case takes them."""
    key = ctx.device.name
    if key not in _BUILT:
        _BUILT[key] = _Models(ctx)
    built = _BUILT[key]
    _CASES_LEFT.discard(case)
    if not _CASES_LEFT:
        _BUILT.pop(key)
    return built


# --- implementations --------------------------------------------------------------------------

def _prompt(length: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(1).integers(0, vocab, (1, length))


def _needle_decode(m: _Models, sampled: bool = False) -> Impl:
    """16 tokens per call as generation makes them: chosen on the device (the argmax, or a
    draw with temperature 0.8 and top-p 0.9), one step queued ahead of the host's read."""
    from needle.models import Sampler

    decoder = m.model.decoder()
    kind = "sampled" if sampled else "greedy"
    prompt = [int(t) for t in _prompt(DECODE_PROMPT, m.config.vocab_size)[0]]
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
            if token is None:  # the cache is full (or streaming starts): rewind, stream again
                if decoder.length >= m.capacity:
                    decoder.rewind(DECODE_PROMPT)
                state["steps"] = decoder.stream(kind, state["token"],
                                                m.capacity - decoder.length)
                token = next(state["steps"])
            state["token"] = token
        return first if first is not None else decoder.last_logits

    return Impl(step, [()])


def _hf_decode(m: _Models, ctx: Context) -> Impl:
    torch = ctx.frameworks["torch"].torch
    ids = torch.as_tensor(_prompt(DECODE_PROMPT, m.config.vocab_size), device=m.hf.device)
    with torch.no_grad():
        out = m.hf(ids, use_cache=True)
    state = {"cache": out.past_key_values,
             "token": torch.full((1, 1), FIRST_TOKEN, dtype=torch.long, device=ids.device)}

    @torch.no_grad()
    def step():
        first = None
        for _ in range(DECODE_TOKENS):
            cache = state["cache"]
            if cache.get_seq_length() >= m.capacity:
                cache.crop(DECODE_PROMPT - cache.get_seq_length())
            out = m.hf(state["token"], past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]
            state["cache"], state["token"] = out.past_key_values, logits.argmax(-1, keepdim=True)
            first = logits if first is None else first
        return first

    return Impl(step, [()])


def _needle_prefill(m: _Models) -> Impl:
    decoder = m.model.decoder()
    ids = _prompt(m.prefill_len, m.config.vocab_size)[0]
    return Impl(lambda: decoder.prefill(ids), [()])


def _hf_prefill(m: _Models, ctx: Context) -> Impl:
    torch = ctx.frameworks["torch"].torch
    ids = torch.as_tensor(_prompt(m.prefill_len, m.config.vocab_size), device=m.hf.device)

    @torch.no_grad()
    def run():
        return m.hf(ids, use_cache=True, logits_to_keep=1).logits[:, -1]

    return Impl(run, [()])


def _rtol(m: _Models) -> float | None:
    """Same weights, different summation orders: bf16 logits agree to a few percent."""
    if m.hf is None:
        return None
    return 1e-3 if m.dtype == "float32" else 5e-2


def _decode_case(name: str, rated_by_bytes: bool) -> Case:
    def build(ctx: Context) -> Bench:
        m = _models(ctx, name)
        impls = {"needle": _needle_decode(m)}
        if m.hf is not None:
            impls["torch"] = _hf_decode(m, ctx)
        if rated_by_bytes:
            return Bench(impls, bytes=m.streamed_bytes() * DECODE_TOKENS, rtol=_rtol(m))
        return Bench(impls, count=DECODE_TOKENS, count_unit="tok", rtol=_rtol(m))

    return Case(name, _GROUP, build)


def _sampled_case(name: str) -> Case:
    """Sampled decode (temperature 0.8, top-p 0.9, drawn on the device) against greedy
    decode of the same model in the same run: the needle÷needle:greedy column is the cost
    of sampling (the target is at most 1/0.95 = 1.05)."""

    def build(ctx: Context) -> Bench:
        m = _models(ctx, name)
        impls = {"needle": _needle_decode(m, sampled=True),
                 "needle:greedy": _needle_decode(m)}
        return Bench(impls, count=DECODE_TOKENS, count_unit="tok", rtol=None)

    return Case(name, _GROUP, build)


def _prefill_case(name: str) -> Case:
    def build(ctx: Context) -> Bench:
        m = _models(ctx, name)
        impls = {"needle": _needle_prefill(m)}
        if m.hf is not None:
            impls["torch"] = _hf_prefill(m, ctx)
        return Bench(impls, count=m.prefill_len, count_unit="tok", rtol=_rtol(m))

    return Case(name, _GROUP, build)


def cases(ctx: Context) -> list[Case]:
    size, _, _, prefill = _setup(ctx)
    names = [f"llm_decode_{size}", f"llm_decode_{size}_vs_limit", f"llm_prefill_{prefill}_{size}",
             f"llm_decode_{size}_sampled"]
    _CASES_LEFT.clear()
    _CASES_LEFT.update(names)
    return [_decode_case(names[0], False), _decode_case(names[1], True),
            _prefill_case(names[2]), _sampled_case(names[3])]
