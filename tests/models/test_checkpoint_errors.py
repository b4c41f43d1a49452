"""Bad model directories fail with ModelFormatError (or OutOfMemoryError) naming the problem."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from needle.errors import (
    DTypeError,
    GenerationError,
    ModelFormatError,
    OutOfMemoryError,
    ShapeError,
)
from needle.models import LlamaConfig, load_pretrained

from .hf_models import build

LAYER0_Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def model_dir(tmp_path):
    directory = tmp_path / "model"
    build("llama", directory)
    return directory


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _rewrite_tensors(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelFormatError, match="not a directory"):
        load_pretrained(tmp_path / "nowhere", device="cpu_numpy")


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelFormatError, match="config.json does not exist"):
        load_pretrained(model_dir, device="cpu_numpy")


def test_malformed_config(model_dir):
    (model_dir / "config.json").write_text("{ not json")
    with pytest.raises(ModelFormatError, match="config.json is not valid JSON"):
        load_pretrained(model_dir, device="cpu_numpy")


def test_config_entry_of_wrong_type(model_dir):
    _edit_config(model_dir, hidden_size="sixty-four")
    with pytest.raises(ModelFormatError, match="'hidden_size' must be int"):
        load_pretrained(model_dir, device="cpu_numpy")


def test_config_missing_entry(model_dir):
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    del config["vocab_size"]
    path.write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="'vocab_size' is missing"):
        load_pretrained(model_dir, device="cpu_numpy")


def test_unsupported_architecture(model_dir):
    _edit_config(model_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelFormatError, match="GPT2LMHeadModel.*not supported"):
        load_pretrained(model_dir, device="cpu_numpy")


def test_unsupported_rope_type(model_dir):
    _edit_config(model_dir, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                             "factor": 4.0})
    with pytest.raises(ModelFormatError, match="rope type 'yarn' is not supported"):
        load_pretrained(model_dir, device="cpu_numpy")


def test_missing_tensor(model_dir):
    _rewrite_tensors(model_dir, lambda t: t.pop(LAYER0_Q))
    with pytest.raises(ModelFormatError, match=f"model.safetensors has no tensor '{LAYER0_Q}'"):
        load_pretrained(model_dir, device="cpu_numpy")


def test_shape_mismatch(model_dir):
    def shrink(tensors):
        tensors[LAYER0_Q] = tensors[LAYER0_Q][:32]

    _rewrite_tensors(model_dir, shrink)
    with pytest.raises(ModelFormatError, match=rf"model.safetensors: tensor '{LAYER0_Q}' has "
                                               r"shape \(32, 64\), but config.json implies "
                                               r"\(64, 64\)"):
        load_pretrained(model_dir, device="cpu_numpy")


def test_truncated_file(model_dir):
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ModelFormatError, match=r"model.safetensors is truncated: tensor '.+'"):
        load_pretrained(model_dir, device="cpu_numpy")


def test_truncated_header(model_dir):
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ModelFormatError, match="model.safetensors is truncated"):
        load_pretrained(model_dir, device="cpu_numpy")


def test_integer_weights_refused(model_dir):
    def to_int(tensors):
        tensors[LAYER0_Q] = tensors[LAYER0_Q].astype(np.int32)

    _rewrite_tensors(model_dir, to_int)
    with pytest.raises(ModelFormatError, match=f"'{LAYER0_Q}' has dtype I32; needle loads "
                                               "weights stored as F32, F16, BF16"):
        load_pretrained(model_dir, device="cpu_numpy")


def _raw_safetensors(path, entries: dict, data: bytes):
    """Write a safetensors file byte by byte (to make layouts no library would write)."""
    header = json.dumps(entries).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def test_fp8_and_int8_weights_named_in_the_error(model_dir):
    """An FP8 or int8 (quantized) tensor is refused naming the tensor, its dtype and what is
    supported, even though numpy has no FP8 type."""
    tensors = load_file(model_dir / "model.safetensors")
    entries, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        code, raw = "F32", array.astype(np.float32).tobytes()
        if name == LAYER0_Q:
            code, raw = "F8_E4M3", np.zeros(array.size, np.uint8).tobytes()
        entries[name] = {"dtype": code, "shape": list(array.shape),
                         "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    _raw_safetensors(model_dir / "model.safetensors", entries, b"".join(blobs))
    with pytest.raises(ModelFormatError, match=f"'{LAYER0_Q}' has dtype F8_E4M3.*GPTQ"):
        load_pretrained(model_dir, device="cpu_numpy")


@pytest.mark.parametrize("layout,message", [
    ([[0, 16], [8, 24]], "overlaps the tensor before it"),
    ([[0, 16], [24, 40]], "leaves a gap"),
    ([[0, 16], [16, 32]], "8 bytes after the last tensor"),
])
def test_tensors_must_tile_the_data_section(tmp_path, layout, message):
    """Overlapping offsets would hand back another tensor's bytes; the reader checks that the
    tensors tile the data section exactly, as ``ndl.load`` does."""
    entries = {f"t{i}": {"dtype": "F32", "shape": [4], "data_offsets": span}
               for i, span in enumerate(layout)}
    path = tmp_path / "model.safetensors"
    _raw_safetensors(path, entries, bytes(40))
    from needle.models.checkpoint import Checkpoint

    with pytest.raises(ModelFormatError, match=message):
        Checkpoint(tmp_path)


def test_fractional_shape_refused(tmp_path):
    entries = {"t": {"dtype": "F32", "shape": [2.7], "data_offsets": [0, 8]}}
    _raw_safetensors(tmp_path / "model.safetensors", entries, bytes(8))
    from needle.models.checkpoint import Checkpoint

    with pytest.raises(ModelFormatError, match="malformed header entry"):
        Checkpoint(tmp_path)


def test_no_weights(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="neither model.safetensors nor"):
        load_pretrained(model_dir, device="cpu_numpy")


def test_sharded_index_errors(tmp_path):
    hf = build("llama", tmp_path / "src")
    directory = tmp_path / "sharded"
    hf.save_pretrained(directory, safe_serialization=True, max_shard_size="100KB")
    index = directory / "model.safetensors.index.json"
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    moved = tmp_path / shard.name
    shutil.move(shard, moved)
    with pytest.raises(ModelFormatError, match=f"{shard.name} is missing"):
        load_pretrained(directory, device="cpu_numpy")
    shutil.move(moved, shard)
    index.write_text("[]")
    with pytest.raises(ModelFormatError, match="not a valid safetensors index"):
        load_pretrained(directory, device="cpu_numpy")


def test_bad_dtype_and_length(model_dir):
    with pytest.raises(DTypeError, match="int32"):
        load_pretrained(model_dir, device="cpu_numpy", dtype="int32")
    with pytest.raises(ShapeError, match="max_seq_len"):
        load_pretrained(model_dir, device="cpu_numpy", max_seq_len=0)


def test_context_limit(model_dir):
    """Past max_position_embeddings (128 here) the rotary positions are untrained: a clear
    error at load, and generate says what to do."""
    with pytest.raises(ShapeError, match="exceeds the 128 positions this llama model was "
                                         "trained for"):
        load_pretrained(model_dir, device="cpu_numpy", max_seq_len=129)
    model = load_pretrained(model_dir, device="cpu_numpy")
    assert model.max_seq_len == 128
    with pytest.raises(GenerationError, match="trained for 128 positions"):
        model.generate([1, 2, 3], 126)


def test_too_big_for_the_device(model_dir):
    """A KV cache of 10^9 positions (512 GB here) is refused before anything is loaded."""
    _edit_config(model_dir, max_position_embeddings=2 * 10**9)
    with pytest.raises(OutOfMemoryError, match="KV cache .* smaller max_seq_len"):
        load_pretrained(model_dir, device="cpu_numpy", max_seq_len=10**9)


def test_config_reads_both_rope_layouts():
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                num_hidden_layers=1, num_attention_heads=4, vocab_size=10)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    old = LlamaConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": scaling})
    new = LlamaConfig.from_dict({**base, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    assert old.rope == new.rope
    assert old.rope.theta == 5e5 and old.rope.type == "llama3"
