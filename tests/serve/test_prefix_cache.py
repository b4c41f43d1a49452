"""The prefix cache: a finished sequence's full pages stay in the pool under their prefix
names, counted free, until a page is needed; a later prompt that begins with the same
tokens (a conversation's next turn) takes them instead of computing them, and its answer is
still one-sequence generate's."""

from __future__ import annotations

import numpy as np
import pytest

from needle.serve import Engine, RequestParams
from needle.serve.pages import BlockTable, PagedKVCache, PagePool, PagePoolError, prefix_keys


def _finished_prefix(pool: PagePool, tokens: list[int], pages: int):
    """A sequence held ``pages`` pages, each named by its prefix of ``tokens``, and ended:
    the names and the pages, in position order."""
    table = BlockTable(pool, pages)
    table.ensure(pages * pool.page_size)
    held = list(table.pages)
    keys = prefix_keys(tokens, pool.page_size, pages)
    for key, page in zip(keys, held):
        pool.remember(key, page)
    table.release()
    return keys, held


def test_named_pages_stay_cached_and_free_until_needed():
    pool = PagePool(6, 4)
    keys, first = _finished_prefix(pool, list(range(100, 116)), 4)
    s = pool.stats()
    assert (s.used, s.reserved, s.cached, s.free) == (0, 0, 4, 6)
    assert [pool.lookup(k) for k in keys] == first  # still named
    # a prompt beginning with the first two pages revives them; nothing else moves
    other = BlockTable(pool, 3, shared=first[:2])
    assert other.pages == first[:2] and pool.stats().cached == 2
    assert not pool.can_reserve(4) and pool.can_reserve(3)  # 6 - 2 held - 1 promised
    other.ensure(12)  # its third page: a never-used one, while there are any
    assert other.pages[2] not in first
    other.release()
    assert pool.stats().cached == 4  # the two revived pages are cached again


def test_eviction_takes_never_used_pages_first_then_a_prefix_from_its_end():
    pool = PagePool(5, 4)
    keys, pages = _finished_prefix(pool, list(range(200, 212)), 3)
    assert pool.stats().cached == 3
    hog = BlockTable(pool, 4)  # 2 never-used pages, then 2 cached ones
    hog.ensure(16)
    assert set(hog.pages[:2]).isdisjoint(pages)
    assert hog.pages[2:] == [pages[2], pages[1]]  # the prefix's end goes first
    assert pool.lookup(keys[0]) == pages[0]
    assert pool.lookup(keys[1]) is None and pool.lookup(keys[2]) is None
    assert pool.stats().cached == 1
    with pytest.raises(PagePoolError):
        BlockTable(pool, 2)  # one page left (the cached one)
    hog.release()
    s = pool.stats()
    assert (s.used, s.reserved, s.cached) == (0, 0, 1)


def test_reviving_a_cached_page_counts_against_what_can_be_promised():
    pool = PagePool(4, 2)
    _, pages = _finished_prefix(pool, [5, 6, 7, 8], 2)
    assert pool.can_reserve(4)
    assert not pool.can_reserve(3, reviving=2)  # 4 free, 2 of them to be held
    with pytest.raises(PagePoolError):
        BlockTable(pool, 5, shared=pages)
    ok = BlockTable(pool, 4, shared=pages)
    ok.ensure(8)
    assert pool.stats().free == 0
    ok.release()


def test_without_the_cache_a_finished_sequences_pages_are_forgotten():
    pool = PagePool(4, 4, cache_prefixes=False)
    keys, _ = _finished_prefix(pool, list(range(8)), 2)
    assert pool.stats().cached == 0
    assert all(pool.lookup(k) is None for k in keys)


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 300, size=n).tolist()


@pytest.mark.parametrize("cache", [True, False])
def test_a_follow_up_turn_reads_only_its_new_tokens(model, cache):
    """Turn two's prompt is turn one's prompt, its answer and a new question: with the
    cache its keys up to the answer's last written page are taken, not computed; the
    answer is generate's either way."""
    engine = Engine(model, max_seqs=2, page_size=8, prefix_cache=cache)
    first = _prompt(36, seed=1)
    a = engine.submit(first, RequestParams(max_tokens=20, ignore_eos=True))
    engine.run_until_idle()
    assert a.output == model.generate(first, 20, temperature=0, stop=())
    second = first + a.output + _prompt(9, seed=2)
    b = engine.submit(second, RequestParams(max_tokens=10, ignore_eos=True))
    engine.run_until_idle()
    assert b.output == model.generate(second, 10, temperature=0, stop=())
    # written: the 36 prompt positions and 19 of the 20 answer tokens -> 6 full pages
    # (the seventh ends at the last answer token, whose keys no step has written)
    assert b.cached_tokens == (6 * 8 if cache else 0)
    assert engine.stats()["prompt_tokens_cached_total"] == b.cached_tokens
    s = engine.cache.pool.stats()
    assert s.used == 0 and s.reserved == 0
    assert s.cached == ((len(second) + 10 - 1) // 8 if cache else 0)


def test_cached_pages_give_way_to_new_prompts(model):
    """A pool too small to keep every finished prompt: later requests take cached pages
    (evicting them) and every answer is still generate's."""
    page = PagedKVCache.page_bytes(model.config, 4, model.dtype)
    engine = Engine(model, max_seqs=2, page_size=4, kv_memory=12 * page)
    prompts = [_prompt(20, seed=10 + i) for i in range(5)]
    for p in prompts + prompts[:1]:
        r = engine.submit(p, RequestParams(max_tokens=6, ignore_eos=True))
        engine.run_until_idle()
        assert r.output == model.generate(p, 6, temperature=0, stop=())
    assert engine.cache.pool.stats().cached <= 12
    assert r.cached_tokens == 0  # the first prompt's pages were taken by later ones


def test_every_device_follows_up_from_the_cache(device, model_dir):
    """The same on each enabled device (metal through the emulator; cuda's captured steps
    read the revived pages through the paged attention)."""
    from needle.models import load_pretrained

    m = load_pretrained(model_dir, device=device, dtype="float32", max_seq_len=128)
    engine = Engine(m, max_seqs=2, page_size=8)
    first = _prompt(30, seed=5)
    a = engine.submit(first, RequestParams(max_tokens=12, ignore_eos=True))
    engine.run_until_idle()
    second = first + a.output + _prompt(5, seed=6)
    b = engine.submit(second, RequestParams(max_tokens=8, ignore_eos=True))
    engine.run_until_idle()
    assert b.cached_tokens == (30 + 12 - 1) // 8 * 8
    assert b.output == m.generate(second, 8, temperature=0, stop=())
