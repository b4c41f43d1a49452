"""The chat page at / in a real headless browser: Debian's chromium driven by Playwright.

Type a message, see the answer stream in (equal to single-sequence greedy generate), the
model name and a tokens/s figure; the stop button ends an answer and frees its pages.
Set NEEDLE_CHAT_SCREENSHOT=path to keep a screenshot (docs/serving-chat.png is made so).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time

import pytest
from playwright import sync_api

from needle.serve import RequestParams  # noqa: E402

from .test_server import KEY, NAME, Running, _wait_idle  # noqa: E402

_MAC_CHROME = "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome"  # macOS runners
CHROMIUM = (shutil.which("chromium") or shutil.which("chromium-browser")
            or (_MAC_CHROME if os.path.exists(_MAC_CHROME) else None))
assert CHROMIUM is not None, "no chromium on PATH: apt-get install -y chromium (the README)"


@contextlib.contextmanager
def _page(url: str, **options):
    """The chat page at ``url`` in headless chromium."""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(**options)
            page.goto(f"{url}/?key={KEY}")
            yield page
        finally:
            browser.close()


@pytest.fixture(scope="module")
def page_server(model):
    server = Running(model, max_seqs=4)
    yield server
    server.stop()


def test_chat_page_streams_an_answer(model, page_server, tmp_path):
    text = "The quick brown fox"
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True, return_dict=False)
    want = model.tokenizer.decode(model.generate(ids, model.max_seq_len - len(ids),
                                                 temperature=0))
    with _page(page_server.url, viewport={"width": 900, "height": 560}) as page:
        sync_api.expect(page.locator("#model")).to_have_text(NAME)
        page.fill("#input", text)
        page.keyboard.press("Enter")
        answer = page.locator(".msg.assistant").last
        sync_api.expect(page.locator("#send")).to_be_enabled(timeout=30_000)
        assert want and answer.text_content() == want
        assert page.locator(".msg.user").first.inner_text() == text
        assert "tokens/s" in page.locator("#speed").inner_text()
        shot = os.environ.get("NEEDLE_CHAT_SCREENSHOT") or str(tmp_path / "chat.png")
        page.screenshot(path=shot)
        assert os.path.getsize(shot) > 1000


def test_stop_button_ends_the_answer_and_frees_pages(model):
    # one sequence at a time, held by a long request: the page's request waits in the queue
    # (its stream already open) until the stop button cancels it
    server = Running(model, max_seqs=1)
    long = RequestParams(max_tokens=250, ignore_eos=True)
    try:
        with _page(server.url) as page:
            page.fill("#input", "Tokens, tokens everywhere")
            blockers = [server.engine.submit([3, 4], long) for _ in range(4)]
            page.keyboard.press("Enter")
            page.click("#stop")
            sync_api.expect(page.locator("#send")).to_be_enabled()
            sync_api.expect(page.locator("#stop")).to_be_disabled()
        deadline = time.time() + 10
        while server.engine.stats()["finished"].get("cancelled", 0) < 1:
            assert time.time() < deadline, "the stopped request was not cancelled"
            time.sleep(0.01)
        assert not blockers[-1].finished  # the page's request was the one cancelled
        for b in blockers:
            server.engine.cancel(b)
        assert _wait_idle(server.engine)
    finally:
        server.stop()


def test_a_thinking_models_thinking_folds_above_its_answer(tmp_path):
    """A reasoning model (trained in the test to think, then answer): the page shows the
    thinking in a box above the answer, folded once the answer begins."""
    from needle.models import load_pretrained

    from . import tool_model

    answer = "Hello to you."
    tool_model.build(tmp_path, template=tool_model.THINKING_TEMPLATE, tools=None,
                     answers=("<think>\nA greeting.\n</think>\n\n" + answer, answer))
    server = Running(load_pretrained(tmp_path, device="cpu", dtype="float32"), max_seqs=2)
    try:
        with _page(server.url) as page:
            sync_api.expect(page.locator("#model")).to_have_text(NAME)
            page.fill("#input", tool_model.QUESTION[0]["content"])
            page.keyboard.press("Enter")
            sync_api.expect(page.locator("#send")).to_be_enabled(timeout=30_000)
            bubble = page.locator(".msg.assistant").last
            box = bubble.locator("details.thinking")
            assert box.locator("div").text_content() == "A greeting."
            assert box.get_attribute("open") is None  # folded
            assert bubble.locator(":scope > div").last.text_content() == answer
    finally:
        server.stop()
