"""``needle serve --tp 2`` on two MPI processes (CPU): rank 0 serves and schedules, rank 1
runs each step beside it. Driven by the official ``openai`` client, it gives the answers of
``needle serve`` in one process (greedy and seeded sampling, one request and several
together), and a server left idle longer than the group's timeout still answers: the other
rank waits on the host between requests, not in a collective."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from needle.serve import step_message
from needle.serve.batch import StepBatch
from needle.serve.choice import SamplingRows

from ..models.hf_models import build_with_tokenizer
from ..serve.serve_job import ServeJob


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tp_serve")
    build_with_tokenizer(directory, chat=True)
    return directory


def answers(job: ServeJob) -> dict:
    """The same questions, asked of any server: a chat, a completion, a seeded sampled
    stream, and six completions at once (more than --max-seqs 4: prompt chunks and decode
    tokens share steps)."""
    out = {"chat": job.chat(temperature=0), "complete": job.complete("The quick", temperature=0),
           "sampled": job.streamed("Once upon", temperature=0.8, seed=3)}
    with ThreadPoolExecutor(6) as pool:
        out["together"] = list(pool.map(lambda i: job.complete(f"Story {i}:", temperature=0),
                                        range(6)))
    return out


SCORED = "Once upon a time there was a story about the quick brown fox"


def test_serve_tp2_answers_as_one_process(chat_model):
    one = ServeJob(chat_model, "--max-seqs", "4")
    try:
        expected = answers(one)
        expected_scores = one.scores(SCORED)
    finally:
        code, err = one.stop()
    assert code == 0, err
    two = ServeJob(chat_model, "--max-seqs", "4", "--tp", "2",
                   env={"NEEDLE_DIST_TIMEOUT": "4"})
    try:
        got = answers(two)
        scores = two.scores(SCORED)  # every rank runs the scored rows' vocab-split head
        assert scores[0] is None and expected_scores[0] is None
        np.testing.assert_allclose(scores[1:], expected_scores[1:], atol=1e-4)
        time.sleep(6)  # idle for longer than any collective may wait
        again = two.complete("The quick", temperature=0)
    finally:
        code, err = two.stop()
    assert got == expected
    assert all(expected["together"]) and expected["sampled"] != expected["complete"]
    assert again == expected["complete"]
    assert "tiny on 2 ranks (cpu)" in err
    assert code == 130, err  # Ctrl-C: mpiexec ends the job


def test_serve_tp_must_be_positive(chat_model, capsys):
    from needle.cli import main

    assert main(["serve", str(chat_model), "--tp", "0"]) == 1
    assert "--tp must be >= 1" in capsys.readouterr().err


def test_a_step_crosses_as_words_unchanged():
    """What rank 0 sends is the step the others run: every array, each prompt chunk's
    slots, and how to run it."""
    rng = np.random.default_rng(0)
    batch = StepBatch(tokens=rng.integers(0, 300, 7), positions=np.arange(7),
                      seq_of=np.array([0, 1, 2, 2, 2, 2, 2]), slots=rng.integers(0, 99, 7),
                      block_tables=rng.integers(-1, 9, (3, 4)).astype(np.int32),
                      logit_rows=np.array([0, 1, 6]),
                      chunks=[(2, 5, np.arange(11))], score_rows=np.array([2, 3, 4, 5]))
    batch.sampling = SamplingRows(rng.random((3, 5)).astype(np.float32),
                                  rng.integers(-2**31, 2**31, 3).astype(np.int32),
                                  np.array([1, 2, 7], np.int32),
                                  seen=np.ones((3, 300), bool))
    for captured, greedy, fed in ((False, True, False), (True, False, False),
                                  (True, True, True), (True, False, True)):
        head, payload = step_message.pack(batch, captured, greedy, fed)
        assert head.shape == (step_message.HEADER,)
        assert payload.size == step_message.payload_size(head)
        got, *how = step_message.unpack(head, payload)
        assert how == [captured, greedy, fed]
        for name in ("tokens", "positions", "seq_of", "slots", "block_tables", "logit_rows",
                     "score_rows"):
            np.testing.assert_array_equal(getattr(got, name), getattr(batch, name), name)
        assert got.block_tables.dtype == np.int32
        assert [(f, c, s.tolist()) for f, c, s in got.chunks] == [(2, 5, list(range(11)))]
        if greedy:
            assert got.sampling is None
        else:  # the settings bit for bit, seeds and positions; not the seen mask
            rows = got.sampling
            assert rows.params.dtype == np.float32 and rows.seeds.dtype == np.int32
            np.testing.assert_array_equal(rows.params, batch.sampling.params)
            np.testing.assert_array_equal(rows.seeds, batch.sampling.seeds)
            np.testing.assert_array_equal(rows.positions, batch.sampling.positions)
            assert rows.seen is None
    empty = StepBatch(*(np.zeros(1, np.int64) for _ in range(4)),
                      np.zeros((1, 1), np.int32), np.zeros(1, np.int64))
    head, payload = step_message.pack(empty, False, True)
    assert step_message.unpack(head, payload)[0].chunks == []
    from needle.errors import DistributedError

    with pytest.raises(DistributedError, match="malformed"):
        step_message.unpack(head, payload[:-1])
