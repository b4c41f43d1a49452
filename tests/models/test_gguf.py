"""GGUF files (written here with gguf's writer and quantizer) load in needle with the logits
of transformers' model read from the same file (transformers dequantizes through gguf), every
block type repacks exactly, tokenizer ids agree with transformers', and bad files are clear
errors naming tensor and type."""

from __future__ import annotations

import numpy as np
import pytest

from needle.errors import ModelFormatError
from needle.models import load_pretrained
from needle.quant import gguf_repack
from needle.quant.format import dequantize
from tests.models.gguf_files import (
    T,
    gguf,
    llama_vocab,
    quants,
    random_blocks,
    write_gguf,
    write_llama_gguf,
)
from tests.models.hf_models import build, torch, transformers

# k a multiple of 256, as the K-quant blocks need
SIZE = dict(hidden_size=256, intermediate_size=512, vocab_size=len(llama_vocab()[0]),
            num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05)
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    return build("llama", tmp_path_factory.mktemp("hf"), **SIZE)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_every_block_type_repacks_exactly(kind):
    rng = np.random.default_rng(3)
    t = T[kind]
    raw = (quants.quantize(rng.standard_normal((6, 512)).astype(np.float32), t)
           if kind in ("Q8_0", "Q4_0") else random_blocks(t, 6, 512, rng))
    q, s, b, spec = gguf_repack.REPACK[kind](raw, 512)
    np.testing.assert_array_equal(dequantize(q, s, b, spec.bits, spec.group_size, 512),
                                  quants.dequantize(raw, t))
    assert spec.bits == (4 if kind in ("Q4_0", "Q4_K") else 8)


def test_mixed_types_are_fused_in_one_exact_format():
    rng = np.random.default_rng(4)
    a, c = random_blocks(T.Q4_K, 4, 256, rng), random_blocks(T.Q6_K, 4, 256, rng)
    parts = gguf_repack.to_common([gguf_repack.q4_k(a, 256), gguf_repack.q6_k(c, 256)])
    assert parts[0][3] == parts[1][3] and parts[0][3].bits == 8
    for (q, s, b, spec), raw, t in zip(parts, (a, c), (T.Q4_K, T.Q6_K)):
        np.testing.assert_array_equal(dequantize(q, s, b, spec.bits, spec.group_size, 256),
                                      quants.dequantize(raw, t))


def _reference(directory, name):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                              dtype=torch.float32)
    return model.eval()


IDS = [[1, 40, 7, 200, 13, 99, 286]]


def _reference_logits(directory, name):
    """transformers' float32 logits of IDS from the GGUF file it reads itself."""
    with torch.no_grad():
        return _reference(directory, name)(torch.tensor(IDS)).logits.numpy()


@pytest.mark.parametrize("kind", ["F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K",
                                  "Q4_K_M"])
def test_logits_match_transformers_reading_the_same_file(hf_llama, tmp_path, kind, device):
    rng = np.random.default_rng(0)
    types = None
    if kind == "Q4_K_M":  # llama.cpp's mix: Q6_K for some v and down projections
        types = {n: T.Q6_K for n in hf_llama.state_dict()
                 if n.endswith(("v_proj.weight", "down_proj.weight")) and ".0." in n}
    write_llama_gguf(hf_llama, tmp_path / "m.gguf", T[kind.removesuffix("_M")], rng,
                     types=types)
    model = load_pretrained(tmp_path / "m.gguf", device=device, dtype="float32")
    if kind not in ("F32", "F16"):  # the block types run packed
        assert type(model.weights.layers[0].gate_up.weight).__name__ == "QuantizedMatrix"
    got = model(IDS).numpy()
    want = _reference_logits(tmp_path, "m.gguf")
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_K"])
def test_bfloat16_activations_match_transformers(hf_llama, tmp_path, kind, device):
    """The same files run with bf16 activations: where x is bf16 the CPU multiplies the
    packed values by x as 16-bit integers (kernels/quant_intx.h), another path than the
    float32 test's; the logits within bf16's rounding of transformers' float32 ones."""
    write_llama_gguf(hf_llama, tmp_path / "m.gguf", T[kind], np.random.default_rng(0))
    model = load_pretrained(tmp_path / "m.gguf", device=device, dtype="bfloat16")
    got = model(IDS).numpy().astype(np.float32)
    want = _reference_logits(tmp_path, "m.gguf")
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 3e-2, f"{kind}: logits {err:.2e} of their largest apart"


# architecture -> the hf_models variant and its sizes: heads of 256 (Gemma 3's, so that its
# query_pre_attn_scalar is what GGUF readers assume), six layers (its five-to-one window
# pattern, which GGUF does not record), the local rotary base llama.cpp assumes
OTHER_ARCHS = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 128}),  # transformers reads no key_length for qwen3
    "gemma3": ("gemma3", {"head_dim": 256, "query_pre_attn_scalar": 256,
                          "num_hidden_layers": 6, "sliding_window_pattern": 6,
                          "sliding_window": 4,
                          "rope_parameters": {
                              "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": 10000.0}}}),
}


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", list(OTHER_ARCHS))
def test_qwen_and_gemma3_files_match_transformers(tmp_path, arch, kind, device):
    """Qwen2 (q/k/v biases), Qwen3 (q/k norms) and Gemma 3 (norms stored as 1 + w, sandwich
    norms, windows binding, two rotary bases) as llama.cpp's converter writes them: no q/k
    interleaving (their rotary layout is Hugging Face's). An F32 file gives the original
    model's logits; every file gives the logits of transformers reading it."""
    variant, extra = OTHER_ARCHS[arch]
    hf = build(variant, tmp_path / "hf", **{**SIZE, **extra})
    write_gguf(hf, tmp_path / "m.gguf", T[kind], np.random.default_rng(0), arch)
    model = load_pretrained(tmp_path / "m.gguf", device=device, dtype="float32")
    assert model.config.family == hf.config.model_type
    if arch == "gemma3":
        assert model.config.layer_windows == (4,) * 5 + (None,)
        assert model.config.rope_local.theta == 10000.0 and model.config.rope.theta == 1e6
    ids = [[1, 40, 7, 200, 13, 99, 286, 5, 17, 3]]
    got = model(ids).numpy()
    with torch.no_grad():
        want = _reference(tmp_path, "m.gguf")(torch.tensor(ids)).logits.numpy()
        original = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    if kind == "F32":
        np.testing.assert_allclose(got, original, rtol=1e-4, atol=1e-4 * np.abs(original).max())


def test_gemma3_linear_rope_scaling_is_read(tmp_path):
    """Gemma 3 4B-27B files carry rope.scaling.type linear and its factor (the global layers'
    scaling): read, the F32 file gives the original model's logits. (transformers' own GGUF
    reader drops the scaling, so it is not the reference here.)"""
    variant, extra = OTHER_ARCHS["gemma3"]
    scaled = {**extra, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    hf = build(variant, tmp_path / "hf", **{**SIZE, **scaled})
    write_gguf(hf, tmp_path / "m.gguf", T.F32, np.random.default_rng(0), "gemma3")
    model = load_pretrained(tmp_path / "m.gguf", device="cpu_numpy", dtype="float32")
    assert (model.config.rope.type, model.config.rope.factor) == ("linear", 4.0)
    ids = [[1, 40, 7, 200, 13, 99, 286, 5, 17, 3] * 3]
    with torch.no_grad():
        original = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(model(ids).numpy(), original, rtol=1e-4,
                               atol=1e-4 * np.abs(original).max())


TEXTS = ["Hello world!", "the cat sits on the mat.", " the  cat", "unknown ß ü 字 tokens", ""]


def test_llama_tokenizer_ids_and_template_match_transformers(hf_llama, tmp_path):
    write_llama_gguf(hf_llama, tmp_path / "m.gguf", T.Q8_0, np.random.default_rng(0),
                     chat_template=TEMPLATE)
    model = load_pretrained(tmp_path / "m.gguf", device="cpu_numpy")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in TEXTS:
        assert model.tokenizer.encode(text) == ref(text)["input_ids"], text
        ids = model.tokenizer.encode(text)
        assert model.tokenizer.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "Hello world!"}]
    assert model.tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                               tokenize=False) == \
        "<|user|>Hello world!</s><|assistant|>"


def test_gpt2_tokenizer_ids_match_transformers(hf_llama, tmp_path):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "Ġ c", "a t", "Ġc at", "i n", "Ġ in"]
    tokens = ["<|begin|>", "<|end|>"] + alphabet + ["Ġt", "he", "Ġthe", "Ġc", "at", "Ġcat",
                                                    "in", "Ġin"]
    path = tmp_path / "b.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    cfg = hf_llama.config
    for key, value in (("context_length", 64), ("embedding_length", cfg.hidden_size),
                       ("block_count", 1), ("feed_forward_length", cfg.intermediate_size),
                       ("head_count", 4), ("head_count_kv", 2)):
        getattr(w, f"add_{key}")(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), cfg.hidden_size), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from needle.models.gguf import GGUFFile
    from needle.models.gguf_tokenizer import gguf_tokenizer

    tok = gguf_tokenizer(GGUFFile(path))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="b.gguf")
    for text in ["the cat in the hat", "<|end|> the", "ünïcödé  spaces"]:
        assert tok.encode(text) == ref(text)["input_ids"], text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_unsupported_type_and_truncated_file_are_clear_errors(hf_llama, tmp_path):
    rng = np.random.default_rng(0)
    name = "model.layers.1.mlp.up_proj.weight"
    path = write_llama_gguf(hf_llama, tmp_path / "q41.gguf", T.Q8_0, rng, types={name: T.Q4_1})
    with pytest.raises(ModelFormatError, match=r"'blk\.1\.ffn_up\.weight' has GGUF type Q4_1"):
        load_pretrained(path, device="cpu_numpy")
    good = write_llama_gguf(hf_llama, tmp_path / "ok.gguf", T.Q8_0, rng)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ModelFormatError, match="truncated"):
        load_pretrained(cut, device="cpu_numpy")
    header_cut = tmp_path / "header.gguf"
    header_cut.write_bytes(data[:200])
    with pytest.raises(ModelFormatError, match="not a readable GGUF file"):
        load_pretrained(header_cut, device="cpu_numpy")


def test_needle_generate_runs_a_gguf_file(hf_llama, tmp_path, capsys):
    from needle import cli

    path = write_llama_gguf(hf_llama, tmp_path / "m.gguf", T.Q4_K, np.random.default_rng(1),
                            chat_template=TEMPLATE)
    model = load_pretrained(path, device="cpu", dtype="float32")
    prompt = model.tokenizer.encode("the cat")
    expected = model.generate(prompt, 5, temperature=0)  # stops after the eos token
    assert cli.main(["generate", str(path), "--prompt", "the cat", "--max-tokens", "5",
                     "--temperature", "0", "--device", "cpu", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out  # the prompt, then the answer
    assert out.rstrip("\n") == "the cat" + model.tokenizer.decode(expected)
    assert cli.main(["generate", str(path), "--chat", "--prompt", "hi", "--max-tokens", "3",
                     "--device", "cpu"]) == 0


def test_qwen2_files_split_digits_as_qwen2s_tokenizer(tmp_path):
    """A Qwen GGUF file (gpt2 tokenizer, tokenizer.ggml.pre "qwen2") splits text as Qwen2's
    tokenizer does: digits one at a time, so a merge of two digits never applies (GPT-2's and
    Llama 3's rules would merge them). The reference: transformers' Qwen2Tokenizer built
    from the same vocabulary and merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from needle.models.gguf import GGUFFile
    from needle.models.gguf_tokenizer import gguf_tokenizer

    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "12 3", "' s", "Ġ 1"]
    words = ["Ġt", "he", "Ġthe", "12", "123", "'s", "Ġ1"]
    tokens = alphabet + words + ["<|endoftext|>"]
    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in (("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 16), ("head_count", 2), ("head_count_kv", 1)):
        getattr(w, f"add_{key}")(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = transformers.Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)},
                                      merges=[tuple(m.split()) for m in merges])
    tok = gguf_tokenizer(GGUFFile(path))
    for text in ["the 123 it's 1234", "12 and 123123", "  the\n\n12"]:
        assert tok.encode(text) == ref(text)["input_ids"], text
    assert tok.encode("123") == [tokens.index(c) for c in "123"]  # no digit merges
