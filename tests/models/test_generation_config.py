"""generation_config.json as transformers writes it: its eos ids stop generation, its
sampling defaults apply when the caller gives none, and bad values are clear errors."""

from __future__ import annotations

import json
import shutil

import pytest

from needle.errors import ModelFormatError
from needle.models import GenerationConfig, load_pretrained

PROMPT = [1, 17, 99, 3, 250, 42, 7, 128]


@pytest.fixture
def model_dir(checkpoints, tmp_path):
    directory, _ = checkpoints("llama")
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _write(directory, **entries):
    path = directory / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config.update(entries)
    path.write_text(json.dumps(config))


def test_transformers_writes_it_and_needle_reads_it(model_dir):
    import transformers
    transformers.GenerationConfig(eos_token_id=[2, 200], do_sample=True, temperature=0.6,
                                  top_p=0.9, bos_token_id=1).save_pretrained(model_dir)
    config = GenerationConfig.read(model_dir, (2,))
    assert config.eos_token_ids == (2, 200)
    assert (config.do_sample, config.temperature, config.top_p) == (True, 0.6, 0.9)


def test_list_of_eos_ids_ends_generation(model_dir):
    """Llama 3 ships eos_token_id [128001, 128009]: either one stops, config.json's too."""
    model = load_pretrained(model_dir, device="cpu_numpy", max_seq_len=64)
    greedy = model.generate(PROMPT, 12, stop=())
    _write(model_dir, eos_token_id=[255, greedy[4]])
    model = load_pretrained(model_dir, device="cpu_numpy", max_seq_len=64)
    assert model.generation_config.eos_token_ids == (2, 255, greedy[4])
    assert model.generate(PROMPT, 12) == greedy[:greedy.index(greedy[4]) + 1]
    assert model.generate(PROMPT, 12, stop=()) == greedy


def test_sampling_defaults_apply_when_the_caller_gives_none(model_dir):
    _write(model_dir, do_sample=True, temperature=0.9, top_k=40, top_p=0.8)
    model = load_pretrained(model_dir, device="cpu_numpy", max_seq_len=64)
    by_file = model.generate(PROMPT, 12, seed=5, stop=())
    explicit = model.generate(PROMPT, 12, seed=5, stop=(), temperature=0.9, top_k=40, top_p=0.8)
    greedy = model.generate(PROMPT, 12, stop=(), temperature=0)
    assert by_file == explicit and by_file != greedy
    # a caller's setting wins over the file's; the others still come from the file
    assert model.generate(PROMPT, 12, seed=5, stop=(), top_k=1) == greedy
    params = model.generation_config.sampling(temperature=0.5)
    assert (params.temperature, params.top_k, params.top_p) == (0.5, 40, 0.8)


def test_do_sample_false_means_greedy(model_dir):
    _write(model_dir, do_sample=False, temperature=0.9, top_p=0.5)
    model = load_pretrained(model_dir, device="cpu_numpy", max_seq_len=64)
    params = model.generation_config.sampling()
    assert params.greedy and params.top_p is None
    assert model.generate(PROMPT, 8, stop=()) == model.generate(PROMPT, 8, stop=(),
                                                                 temperature=0)


@pytest.mark.parametrize("entries,message", [
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"do_sample": "yes"}, "do_sample must be true or false"),
    ({"do_sample": True, "top_p": 3}, "top_p must be in"),
    ({"eos_token_id": ["x"]}, "eos_token_id must be a token id"),
])
def test_bad_values_name_the_file(model_dir, entries, message):
    _write(model_dir, **entries)
    with pytest.raises(ModelFormatError, match=f"generation_config.json: {message}"):
        load_pretrained(model_dir, device="cpu_numpy", max_seq_len=64)
