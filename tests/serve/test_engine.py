"""The batching engine: every greedy answer equals single-sequence generate, sequences join
and leave between steps, pages come back, admission and errors."""

from __future__ import annotations

import numpy as np
import pytest

from needle.errors import GenerationError
from needle.serve import (
    Engine,
    QueueFullError,
    RequestParams,
    RequestTooLargeError,
    SamplingParams,
)
from needle.serve.pages import PagePool, PagePoolError


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]


def test_batched_greedy_equals_single_sequence_generate(model):
    prompts = _prompts(6)
    single = [model.generate(p, 12, temperature=0, stop=()) for p in prompts]
    assert model.generate(prompts, 12, temperature=0, stop=()) == single


def test_sequences_join_and_leave_between_steps_and_free_pages(model):
    # small steps force chunked prefill of the long prompt while others decode
    engine = Engine(model, max_seqs=3, max_batch_tokens=8, page_size=4)
    prompts = _prompts(5, seed=1) + [list(range(3, 100))]
    lengths = [3, 9, 5, 14, 2, 6]
    expected = [model.generate(p, n, temperature=0, stop=()) for p, n in zip(prompts, lengths)]
    requests = []
    for p, n in zip(prompts, lengths):
        requests.append(engine.submit(p, RequestParams(max_tokens=n, ignore_eos=True)))
        engine.step()  # the next request arrives while these run
    engine.run_until_idle()
    assert [r.output for r in requests] == expected
    assert [r.finish_reason for r in requests] == ["length"] * 6
    stats = engine.cache.pool.stats()
    assert stats.used == 0 and stats.reserved == 0


def test_cancel_frees_pages_and_ends_the_stream(model):
    engine = Engine(model, max_seqs=2, page_size=4)
    a = engine.submit([5, 6, 7], RequestParams(max_tokens=50, ignore_eos=True))
    b = engine.submit([8, 9], RequestParams(max_tokens=50, ignore_eos=True))
    c = engine.submit([10], RequestParams(max_tokens=50, ignore_eos=True))  # waits: 2 seqs
    for _ in range(3):
        engine.step()
    assert engine.cache.pool.stats().used > 0
    engine.cancel(a)
    engine.cancel(c)
    engine.step()
    assert a.finish_reason == "cancelled" and c.finish_reason == "cancelled"
    assert list(a.stream())[-1].finish_reason == "cancelled"
    engine.cancel(b)
    engine.run_until_idle()
    assert engine.cache.pool.stats().used == 0 and engine.cache.pool.stats().reserved == 0


def test_stop_strings_stop_ids_and_text(model):
    engine = Engine(model, max_seqs=4)
    free = engine.submit("The quick brown", RequestParams(max_tokens=20, ignore_eos=True))
    engine.run_until_idle()
    full = free.text
    assert full == model.tokenizer.decode(free.output)
    stop = full[5:8]
    cut = engine.submit("The quick brown", RequestParams(max_tokens=20, stop=(stop,),
                                                         ignore_eos=True))
    by_id = engine.submit("The quick brown", RequestParams(
        max_tokens=20, stop_token_ids=(free.output[3],), ignore_eos=True))
    engine.run_until_idle()
    assert cut.finish_reason == "stop" and cut.text == full[:full.find(stop)]
    assert "".join(e.text for e in cut.stream(timeout=1)) == cut.text
    assert by_id.finish_reason == "stop" and by_id.output == free.output[:4]


def test_seeded_sampling_is_reproducible_and_matches_generate(model):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    engine = Engine(model, max_seqs=4)
    reqs = [engine.submit([4, 5, 6], RequestParams(params, 10, ignore_eos=True))
            for _ in range(2)]
    engine.run_until_idle()
    assert reqs[0].output == reqs[1].output
    assert reqs[0].output == model.generate([4, 5, 6], 10, temperature=0.9, top_p=0.9,
                                            seed=7, stop=())


def test_admission_control_queue_limit_and_too_large(model):
    engine = Engine(model, max_seqs=1, kv_memory=None, page_size=16, max_queue=2)
    pool = engine.cache.pool
    with pytest.raises(RequestTooLargeError, match="KV pages"):
        small = Engine(model, max_seqs=1, kv_memory=2 * pool.page_size and
                       2 * engine.cache.page_bytes(model.config, 16, model.dtype), page_size=16)
        small.submit([3] * 40, RequestParams(max_tokens=10))
    engine.submit([3], RequestParams(max_tokens=2))
    engine.submit([4], RequestParams(max_tokens=2))
    with pytest.raises(QueueFullError, match="retry later"):
        engine.submit([5], RequestParams(max_tokens=2))
    with pytest.raises(GenerationError, match="max_seq_len"):
        engine.submit([3] * 10, RequestParams(max_tokens=model.max_seq_len))
    with pytest.raises(GenerationError, match="max_tokens"):
        RequestParams(max_tokens=0)
    engine.run_until_idle()


def test_page_pool_bookkeeping():
    pool = PagePool(4, 2)
    pool.reserve(3)
    pages = [pool.take(), pool.take()]  # taking spends the promise
    assert pool.stats().used == 2 and pool.stats().reserved == 3 and pool.stats().free == 1
    assert not pool.can_reserve(2) and pool.can_reserve(1)
    pool.share(pages[0])  # a second holder of a prompt page
    pool.give_back(pages)
    assert pool.stats().used == 1  # the shared page stays until its last holder is done
    pool.give_back(pages[:1])
    with pytest.raises(PagePoolError):
        pool.give_back(pages[:1])
    pool.unreserve(1)
    assert pool.stats().used == 0 and pool.stats().reserved == 0


def test_identical_prompt_prefixes_share_pages(model):
    engine = Engine(model, max_seqs=4, page_size=4)
    system = list(range(10, 50))  # 40 tokens: 10 full pages
    tails = [[60, 61, 62], [70, 71], [80]]
    want = [model.generate(system + t, 8, temperature=0, stop=()) for t in tails]
    first = engine.submit(system + tails[0], RequestParams(max_tokens=8, ignore_eos=True))
    engine.step()  # its prompt is in the cache: the others find its pages
    used_one = engine.cache.pool.stats().used
    rest = [engine.submit(system + t, RequestParams(max_tokens=8, ignore_eos=True))
            for t in tails[1:]]
    engine.step()
    assert rest[0].table.pages[:10] == first.table.pages[:10]
    assert rest[1].table.pages[:10] == first.table.pages[:10]
    assert engine.cache.pool.stats().used < 3 * used_one  # shared, not copied
    engine.cancel(first)  # the shared pages outlive their first holder
    engine.run_until_idle()
    assert [r.output for r in rest] == want[1:]
    stats = engine.cache.pool.stats()
    assert stats.used == 0 and stats.reserved == 0


def test_every_device_batches_like_generate(device, model_dir):
    """On each enabled device (metal through the emulator: its recorded command buffers
    replay the captured decode steps, as CUDA graphs do on cuda)."""
    from needle.models import load_pretrained

    m = load_pretrained(model_dir, device=device, dtype="float32", max_seq_len=64)
    prompts = _prompts(5, seed=3)
    single = [m.generate(p, 6, temperature=0, stop=()) for p in prompts]
    engine = Engine(m, max_seqs=5, page_size=8)
    reqs = [engine.submit(p, RequestParams(max_tokens=6, ignore_eos=True)) for p in prompts]
    engine.run_until_idle()
    assert [r.output for r in reqs] == single
    if engine.graphs.enabled:  # decode-only steps were replayed from a capture
        assert engine.graphs._recorded


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_checkpoints_batch_like_generate(tmp_path, model_dir, bits):
    """`needle quantize` output served: the engine's batched steps run the packed projections
    and give single-sequence generate's tokens."""
    from needle.cli import main
    from needle.models import load_pretrained

    out = tmp_path / f"int{bits}"
    assert main(["quantize", str(model_dir), str(out), "--bits", str(bits),
                 "--group-size", "32"]) == 0
    m = load_pretrained(out, device="cpu", dtype="float32", max_seq_len=64)
    prompts = _prompts(4, seed=5)
    single = [m.generate(p, 6, temperature=0, stop=()) for p in prompts]
    assert m.generate(prompts, 6, temperature=0, stop=()) == single


def test_steps_queued_ahead_end_as_one_at_a_time(device, model_dir):
    """Where decode steps are captured (cuda, metal), a greedy step's successor is queued,
    fed by its argmaxes on the device, before its tokens are read. A sequence that ends
    meanwhile (a stop token, its max_tokens, a cancel) has that successor's token dropped:
    every answer is one-sequence generate's, cut where it should be, and every page comes
    back."""
    from needle.models import load_pretrained

    m = load_pretrained(model_dir, device=device, dtype="float32", max_seq_len=64)
    prompts = _prompts(4, seed=11)
    single = [m.generate(p, 12, temperature=0, stop=()) for p in prompts]
    engine = Engine(m, max_seqs=4, page_size=8)
    end_as_one_at_a_time(engine, prompts, single, lambda i: SamplingParams())
    if engine.graphs.enabled:
        assert engine.metrics.queued_ahead > 5
    else:
        assert engine.metrics.queued_ahead == 0


def end_as_one_at_a_time(engine, prompts, single, sampling) -> None:
    """Four requests (``sampling(i)`` each) whose answers alone are ``single``: the first
    stops at a stop token, the second at its max_tokens, the fourth is cancelled mid-answer.
    Each answer is ``single``'s, cut where it should be, and every page comes back."""
    stop_at = single[0][4]  # request 0 stops at its fifth token (or earlier, if repeated)

    def params(i, n, **more):
        return RequestParams(sampling(i), n, ignore_eos=True, **more)

    reqs = [engine.submit(prompts[0], params(0, 12, stop_token_ids=(stop_at,))),
            engine.submit(prompts[1], params(1, 7)),
            engine.submit(prompts[2], params(2, 12)),
            engine.submit(prompts[3], params(3, 12))]
    while len(reqs[3].output) < 5:
        engine.step()
    engine.cancel(reqs[3])
    engine.run_until_idle()
    first_stop = single[0].index(stop_at) + 1
    assert reqs[0].output == single[0][:first_stop] and reqs[0].finish_reason == "stop"
    assert reqs[1].output == single[1][:7] and reqs[1].finish_reason == "length"
    assert reqs[2].output == single[2] and reqs[2].finish_reason == "length"
    assert reqs[3].finish_reason == "cancelled"
    assert reqs[3].output == single[3][:len(reqs[3].output)] and len(reqs[3].output) >= 5
    stats = engine.cache.pool.stats()
    assert stats.used == 0 and stats.reserved == 0 and not engine.has_work()


@pytest.mark.parametrize("name", ["mistral_window", "gemma3", "gemma2"])
def test_sliding_window_models_batch_like_generate(device, tmp_path, name):
    """Models whose windows bind (Mistral's 5 positions on every layer; Gemma 3's 6 on two
    layers of three, two rotary tables; Gemma 2's 6 on every other layer, with soft-capped
    scores and logits): prompt chunks and decode steps through the paged kernels' windows
    (and soft caps) give ``generate``'s tokens and transformers', sequences longer than
    their windows, a prompt split over several steps (8 tokens a step)."""
    from needle.models import load_pretrained

    from ..models.hf_models import build, reference_greedy

    hf = build(name, tmp_path)
    m = load_pretrained(tmp_path, device=device, dtype="float32", max_seq_len=64)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (3, 11, 20, 7)]
    single = [m.generate(p, 10, temperature=0, stop=()) for p in prompts]
    assert single[2] == reference_greedy(hf, prompts[2], 10)  # the window binds: HF agrees
    engine = Engine(m, max_seqs=4, page_size=4, max_batch_tokens=8)
    reqs = [engine.submit(p, RequestParams(max_tokens=10, ignore_eos=True)) for p in prompts]
    engine.run_until_idle()
    assert [r.output for r in reqs] == single
