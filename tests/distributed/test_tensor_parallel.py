"""Tensor-parallel inference on 2 MPI processes gives the logits and tokens of one process,
for checkpoints written by transformers (separate and fused projections, biases, GQA,
sliding windows and soft-capping); ``needle generate --tp 2`` writes what --tp 1 does."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import needle as ndl
from needle.distributed.tensor_parallel import Slicer, shard_config
from needle.errors import ModelFormatError
from needle.models import load_pretrained
from needle.models.config import ModelConfig

from ..models.hf_models import build, build_with_tokenizer
from .jobs import run_job

PROMPT = [1, 17, 92, 5, 201, 33, 8]
# variant, overrides: Llama (GQA), Qwen2 (q/k/v biases), Phi-3 (fused qkv and gate_up,
# window), Gemma 2 (soft-capping, sandwich norms, window), Qwen3 (per-head q/k norms),
# Gemma 3 (q/k norms, GeGLU, two rotary tables, windows on two layers of three)
MODELS = [("llama", {}), ("qwen2", {"num_key_value_heads": 2}), ("phi3", {}), ("gemma2", {}),
          ("qwen3", {}), ("gemma3", {})]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """variant -> its checkpoint directory, written on first use."""
    made = {}

    def get(variant: str):
        if variant not in made:
            made[variant] = tmp_path_factory.mktemp(f"tp_{variant}")
            build(variant, made[variant], **dict(MODELS)[variant])
        return made[variant]

    return get


@pytest.mark.parametrize("fused", ["auto", "1"])
def test_two_ranks_give_the_logits_and_tokens_of_one(model_dir, tmp_path, fused, monkeypatch):
    """``fused``: NEEDLE_FUSED_DECODE in the ranks. The CPU backend decodes layer by layer
    by default; "1" makes the ranks take the five fused operations (CUDA's default), the
    row-parallel projections adding their all-reduced sums (``add_into``)."""
    model_dirs = [model_dir(variant) for variant, _ in MODELS]
    job = run_job("tp_logits.py", str(tmp_path), *map(str, model_dirs),
                  env={"NEEDLE_FUSED_DECODE": fused})
    assert job.returncode == 0, job.stdout + job.stderr
    monkeypatch.setenv("NEEDLE_FUSED_DECODE", fused)  # the one-process model decodes alike
    for i, directory in enumerate(model_dirs):
        model = load_pretrained(directory, device=ndl.cpu(), max_seq_len=32)
        got = np.load(tmp_path / f"{i}.npz")
        np.testing.assert_allclose(got["logits"], model.forward([PROMPT]).numpy(),
                                   rtol=1e-4, atol=1e-4, err_msg=directory.name)
        tokens = model.generate(PROMPT, 6, temperature=0)
        assert got["tokens"].tolist() == tokens
        decoder = model.decoder()
        decoder.prefill(PROMPT)
        steps = np.stack([decoder.step(t).numpy().reshape(-1) for t in tokens[:3]])
        np.testing.assert_allclose(got["steps"], steps, rtol=1e-4, atol=1e-4,
                                   err_msg=directory.name)
        # the ranks' layers decode as one process's do (Llama's, Qwen2's, Qwen3's and
        # Phi-3's as the fused operations when asked; Gemma's sandwich norms never)
        assert got["fused"].tolist() == model.transformer.five_ops, directory.name
        if fused == "1" and MODELS[i][0] in ("llama", "qwen2", "qwen3", "phi3"):
            assert all(got["fused"])
        # each rank holds half the head's vocabulary rows, but a head tied to the
        # embeddings (Gemma's) stays whole: the lookup needs every row
        vocab = model.config.vocab_size
        tied = MODELS[i][0] in ("gemma2", "gemma3")
        assert int(got["head_rows"]) == (vocab if tied else vocab // 2)


def test_shards_are_disjoint_and_rebuild_the_matrices(model_dir):
    """Rank r's slices, put back together, are the checkpoint's matrices."""
    from needle.models.checkpoint import Checkpoint

    directory = model_dir("phi3")  # fused projections
    cfg = ModelConfig.from_file(directory / "config.json")
    ckpt = Checkpoint(directory)
    shapes = cfg.tensor_shapes()
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    full_qkv, full_o = ckpt.read(qkv, shapes[qkv]), ckpt.read(o, shapes[o])
    slices = [Slicer(cfg, r, 2) for r in range(2)]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    parts = [s(qkv, full_qkv) for s in slices]
    half_q, half_kv = q // 2, kv // 2
    rebuilt_q = np.concatenate([p[:half_q] for p in parts])
    rebuilt_v = np.concatenate([p[half_q + half_kv:] for p in parts])
    np.testing.assert_array_equal(rebuilt_q, full_qkv[:q])
    np.testing.assert_array_equal(rebuilt_v, full_qkv[q + kv:])
    np.testing.assert_array_equal(np.concatenate([s(o, full_o) for s in slices], axis=1),
                                  full_o)
    head = ckpt.read("lm_head.weight", shapes["lm_head.weight"])  # by vocabulary rows
    np.testing.assert_array_equal(np.concatenate([s("lm_head.weight", head) for s in slices]),
                                  head)
    assert slices[0].shape("lm_head.weight", head.shape) == (head.shape[0] // 2, head.shape[1])
    ckpt.close()


def test_a_tied_or_uneven_head_stays_whole():
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    for extra in ({"vocab_size": 257}, {"vocab_size": 256, "tie_word_embeddings": True}):
        cfg = ModelConfig.from_dict({**base, **extra})
        head = np.ones((cfg.vocab_size, 64), np.float32)
        assert Slicer(cfg, 1, 2)("lm_head.weight", head) is head
        assert Slicer(cfg, 1, 2).shape("lm_head.weight", head.shape) == head.shape


def test_heads_must_divide():
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 1,
                                 "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "vocab_size": 32})
    assert shard_config(cfg, 2).num_kv_heads == 1
    with pytest.raises(ModelFormatError, match=r"attention heads \(4\) to divide evenly"):
        shard_config(cfg, 3)
    with pytest.raises(ModelFormatError, match=r"key/value heads \(2\)"):
        shard_config(cfg, 4)


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tp_cli")
    build_with_tokenizer(directory)
    return directory


def _generate(directory, *options: str, device: str = "cpu") -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "needle.cli", "generate", str(directory), "--prompt",
               "The quick brown", "--max-tokens", "10", "--device", device, *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "NCCL_NVLS_ENABLE": "0"})


@pytest.mark.parametrize("sampling", [(), ("--temperature", "0.9", "--seed", "4")])
def test_generate_tp2_writes_what_tp1_writes(cli_model, sampling):
    one, two = _generate(cli_model, *sampling), _generate(cli_model, "--tp", "2", *sampling)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout  # rank 0 alone writes the text
    assert two.stderr.count("decode:") == 1  # and the report


@pytest.mark.skipif(not ndl.cuda(1).enabled(), reason="needs two CUDA devices")
def test_generate_tp2_on_two_gpus_writes_what_tp1_writes_and_exits(cli_model):
    """On GPUs the ranks decode through captured steps whose all-reduces are NCCL calls:
    leaving the group must close those graphs, or NCCL's destroy waits for them forever
    (the ranks then never exit and the run times out)."""
    options = ("--dtype", "float32")
    one = _generate(cli_model, *options, device="cuda")
    two = _generate(cli_model, "--tp", "2", *options, device="cuda")
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tp_chat")
    build_with_tokenizer(directory, chat=True)
    return directory


def _chat(directory, turns: str, *options: str, device: str = "cpu",
          timeout: float = 180) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "needle.cli", "chat", str(directory), "--max-tokens", "8",
               "--device", device, *options]
    return subprocess.run(command, input=turns, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "NCCL_NVLS_ENABLE": "0"})


def test_chat_tp2_answers_as_tp1(chat_model):
    """``needle chat --tp 2``: rank 0 reads the turns (an empty line skipped, /reset, then
    the end of input) and hands each to rank 1; the answers are --tp 1's, greedy and seeded
    sampling alike, and the report comes once."""
    turns = "Hello there\n\nAnd again?\n/reset\nThe quick\n"
    for options in ((), ("--temperature", "0.8", "--seed", "3")):
        one = _chat(chat_model, turns, *options, "--stats")
        two = _chat(chat_model, turns, "--tp", "2", *options, "--stats")
        assert one.returncode == 0 and two.returncode == 0, two.stderr
        assert two.stdout == one.stdout and two.stdout.count("\n") == 3
        assert two.stderr.count("decode:") == 3  # rank 0's report, once per answer


def test_chat_tp_must_be_positive(chat_model):
    job = _chat(chat_model, "hi\n", "--tp", "0")
    assert job.returncode == 1 and "--tp must be >= 1" in job.stderr


def test_tp_beyond_the_gpus_is_refused_before_any_rank_starts(cli_model, monkeypatch, capsys):
    """On GPUs a rank takes one: --tp 2 on a machine of one GPU says so (instead of a
    rank failing on a missing device); the launcher is never reached."""
    from needle.cli import main as needle_main
    from needle.distributed import launcher, tp_generate

    monkeypatch.setattr(tp_generate, "_backend_and_device", lambda device: ("nccl", None))
    monkeypatch.setattr(tp_generate, "_gpu_count", lambda: 1)
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("ranks started"))
    assert needle_main(["generate", str(cli_model), "--prompt", "hi", "--tp", "2"]) == 1
    assert "--tp 2 runs one rank a GPU, but this machine has 1 GPU;" in \
        capsys.readouterr().err


def test_generate_tp_must_be_positive(cli_model):
    job = _generate(cli_model, "--tp", "0")
    assert job.returncode == 1 and "--tp must be >= 1" in job.stderr


def test_quantized_and_gguf_checkpoints_are_refused_with_the_reason(tmp_path):
    """--tp splits unquantized Hugging Face checkpoints: a `needle quantize` output and a
    GGUF file written by the gguf package are refused, each saying what to do (before any
    rank joins a group), not reported as a checkpoint missing tensors."""
    from gguf import GGMLQuantizationType

    from needle.cli import main as needle_main
    from needle.distributed import load_tensor_parallel

    from ..models.gguf_files import write_llama_gguf

    hf = build("llama", tmp_path / "bf16")
    assert needle_main(["quantize", str(tmp_path / "bf16"), str(tmp_path / "q4"), "--bits",
                        "4", "--group-size", "32"]) == 0
    with pytest.raises(ModelFormatError, match="holds quantized weights.*without --tp"):
        load_tensor_parallel(tmp_path / "q4")
    path = write_llama_gguf(hf, tmp_path / "m.gguf", GGMLQuantizationType.Q8_0,
                            np.random.default_rng(0))
    with pytest.raises(ModelFormatError, match="is a GGUF file.*without --tp"):
        load_tensor_parallel(path)
