"""The MPI jobs of test_data_parallel.py and test_tensor_parallel.py, run again with the
nccl backend on two GPUs: data-parallel training equals one process on the whole batch, and
a tensor-parallel model (captured decode steps whose all-reduces are NCCL calls, the fused
row-parallel ``add_into``) gives one GPU's logits and tokens. Skips without two GPUs."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import needle as ndl
from needle.models import load_pretrained

from ..models.hf_models import build
from .jobs import SCRIPTS, run_job

pytestmark = pytest.mark.skipif(not ndl.cuda(1).enabled(), reason="needs two CUDA devices")
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}  # no NVLink multicast on shared hosts
PROMPT = [1, 17, 92, 5, 201, 33, 8]


def test_two_gpus_train_as_one_process_on_the_whole_batch(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    import ddp_train

    path = tmp_path / "ddp.safetensors"
    job = run_job("ddp_train.py", str(path), backend="nccl", timeout=180, env=NCCL_ENV)
    assert job.returncode == 0, job.stdout + job.stderr[-3000:]
    reference = ddp_train.reference().state_dict()
    model = ddp_train.build_model(seed=5)
    model.load_state_dict(ndl.load(path)["model"])
    for name, array in model.state_dict().items():
        np.testing.assert_allclose(array.numpy(), reference[name].numpy(), rtol=1e-4,
                                   atol=1e-5, err_msg=name)


@pytest.mark.parametrize("variant,overrides", [("llama", {}),
                                               ("qwen2", {"num_key_value_heads": 2})])
def test_two_gpus_give_the_logits_and_tokens_of_one(tmp_path, variant, overrides):
    directory = tmp_path / variant
    build(variant, directory, **overrides)
    out = tmp_path / "out"
    out.mkdir()
    job = run_job("tp_logits.py", str(out), str(directory), backend="nccl", timeout=240,
                  env=NCCL_ENV)
    assert job.returncode == 0, job.stdout + job.stderr[-3000:]
    got = np.load(out / "0.npz")
    model = load_pretrained(directory, device=ndl.cuda(0), max_seq_len=32)
    np.testing.assert_allclose(got["logits"], model.forward([PROMPT]).numpy(), rtol=1e-3,
                               atol=1e-3)
    tokens = model.generate(PROMPT, 6, temperature=0)
    assert got["tokens"].tolist() == tokens
    decoder = model.decoder()
    decoder.prefill(PROMPT)
    steps = np.stack([decoder.step(t).numpy().reshape(-1) for t in tokens[:3]])
    np.testing.assert_allclose(got["steps"], steps, rtol=1e-3, atol=1e-3)
    assert got["fused"].tolist() == model.transformer.five_ops
    assert all(got["fused"])  # CUDA decodes Llama's and Qwen2's layers as five fused ops
    assert int(got["head_rows"]) == model.config.vocab_size // 2  # a vocabulary-parallel head


def test_chat_tp2_on_two_gpus_answers_as_one(tmp_path):
    """``needle chat --tp 2`` on GPUs: the nccl launcher's ranks, rank 0 reading the
    relayed input; the answers are one GPU's."""
    from ..models.hf_models import build_with_tokenizer
    from .test_tensor_parallel import _chat

    build_with_tokenizer(tmp_path, chat=True)
    turns, options = "Hello there\nAnd again?\n", ("--dtype", "float32")
    one = _chat(tmp_path, turns, *options, device="cuda", timeout=240)
    two = _chat(tmp_path, turns, "--tp", "2", *options, device="cuda", timeout=240)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and two.stdout.count("\n") == 2


def test_serve_tp2_on_two_gpus_answers_as_one_and_drains_on_ctrl_c(tmp_path):
    """``needle serve --tp 2`` on GPUs (captured batched steps whose all-reduces are NCCL
    calls, rank 1 woken from the store's doorbell after an idle spell longer than the
    group's timeout): the official client gets one GPU's answers; a Ctrl-C mid-answer lets
    the answer finish (rank 1 runs the steps until rank 0 stops it), then the job exits."""
    import json
    import os
    import signal
    import time

    from ..models.hf_models import build_with_tokenizer
    from ..serve.serve_job import NAME, ServeJob, stream_interrupted
    from .test_tp_serve import answers

    build_with_tokenizer(tmp_path, chat=True, max_position_embeddings=2048)
    options = ("--dtype", "float32", "--max-seqs", "4")
    one = ServeJob(tmp_path, *options, device="cuda")
    try:
        expected = answers(one)
    finally:
        code, err = one.stop()
    assert code == 0, err[-3000:]
    two = ServeJob(tmp_path, *options, "--tp", "2", device="cuda",
                   env={"NEEDLE_DIST_TIMEOUT": "4"})
    try:
        assert answers(two) == expected
        time.sleep(6)  # idle past the group's timeout: rank 1 waits on the doorbell
        assert two.complete("The quick", temperature=0) == expected["complete"]
        body = {"model": NAME, "prompt": "The quick brown", "max_tokens": 1500,
                "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        # Ctrl-C mid-answer (to the launcher)
        events = stream_interrupted(two.url, body,
                                    lambda: os.killpg(two.proc.pid, signal.SIGINT))
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 1500
        assert two.proc.wait(timeout=120) == 130
        err = two.stderr()
        assert "tiny on 2 ranks (cuda)" in err
        assert "stopped (running answers were finished)" in err
    finally:
        two.kill()
