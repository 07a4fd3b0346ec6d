"""Synthetic checkpoints: shapes, determinism, sharding, tokenizer, presets."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open

from actors.tokenizer import Message, Tokenizer
from weights_tool.architecture import ModelConfig
from weights_tool.dtypes import torch_dtype
from weights_tool.synth import (
    EOS_TOKEN_IDS,
    PRESETS,
    SPECIAL_TOKENS,
    preset_config,
    split_shards,
    synthesize,
    tokenizer_json,
    train_tokenizer,
)

TINY_PRESETS = [name for name in PRESETS if name == "tiny" or name.startswith("tiny-")]


def _load(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor in a checkpoint directory, failing on a tensor stored twice."""
    files = sorted(path.glob("model*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                assert name not in tensors, f"{name} stored twice"
                tensors[name] = f.get_tensor(name)
    return tensors


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_parses_with_token_ids_inside_the_vocabulary(name):
    model = ModelConfig.from_hf(PRESETS[name])
    assert model.bos_token_id == 0
    assert model.eos_token_ids == EOS_TOKEN_IDS
    assert max(model.eos_token_ids) < model.vocab_size
    assert model.dtype == "bfloat16"


def test_real_shapes_carry_their_features():
    llama32 = ModelConfig.from_hf(PRESETS["llama-3.2-1b"])
    assert (llama32.rope_scaling.rope_type, llama32.rope_scaling.factor) == ("llama3", 32.0)
    assert llama32.tie_word_embeddings and llama32.vocab_size == 128256
    qwen25 = ModelConfig.from_hf(PRESETS["qwen2.5-0.5b"])
    assert qwen25.has_qkv_bias and qwen25.tie_word_embeddings and qwen25.sliding_window is None
    qwen3 = ModelConfig.from_hf(PRESETS["qwen3-0.6b"])
    assert qwen3.has_qk_norm and qwen3.head_dim == 128 != qwen3.hidden_size // qwen3.num_heads
    tinyllama = ModelConfig.from_hf(PRESETS["tinyllama-1.1b"])
    assert (tinyllama.hidden_size, tinyllama.num_layers, tinyllama.num_kv_heads) == (2048, 22, 4)
    assert abs(tinyllama.num_params() - 1.1e9) / 1.1e9 < 0.01
    assert abs(ModelConfig.from_hf(PRESETS["llama-3-8b"]).num_params() - 8.03e9) / 8.03e9 < 0.01


def test_small_preset_is_about_100m_parameters():
    num_params = ModelConfig.from_hf(PRESETS["small"]).num_params()
    assert abs(num_params - 100e6) / 100e6 < 0.02


def test_unknown_preset_lists_the_presets(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'nope'.*tinyllama-1.1b"):
        synthesize("nope", tmp_path)
    with pytest.raises(ValueError, match="tiny-qwen3"):
        preset_config("llama-9000")


def test_preset_config_is_a_copy():
    preset_config("tiny")["hidden_size"] = 1
    assert PRESETS["tiny"]["hidden_size"] == 64


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_presets_match_tensor_shapes_exactly(tmp_path, name):
    start = time.perf_counter()
    out = synthesize(name, tmp_path / name)
    assert time.perf_counter() - start < 5.0
    config = json.loads((out / "config.json").read_text())
    model = ModelConfig.from_hf(config)
    tensors = _load(out)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == model.tensor_shapes()
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    model.check_tensors({n: tuple(t.shape) for n, t in tensors.items()})
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_weight_statistics_resemble_a_trained_model(tmp_path):
    tensors = _load(synthesize("tiny", tmp_path))
    embed = tensors["model.embed_tokens.weight"].float()
    assert abs(embed.mean().item()) < 0.002 and abs(embed.std().item() - 0.02) < 0.002
    norms = torch.cat([t.float() for n, t in tensors.items() if n.endswith("norm.weight")])
    assert abs(norms.mean().item() - 1.0) < 0.01 and 0.01 < norms.std().item() < 0.03


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_dtype_and_context_overrides(tmp_path, dtype):
    out = synthesize("tiny-qwen2", tmp_path, dtype=dtype, max_position_embeddings=128)
    config = json.loads((out / "config.json").read_text())
    assert (config["torch_dtype"], config["max_position_embeddings"]) == (dtype, 128)
    assert {t.dtype for t in _load(out).values()} == {torch_dtype(dtype)}


def test_same_seed_same_bytes_different_seed_different(tmp_path):
    a = synthesize("tiny", tmp_path / "a", seed=7)
    b = synthesize("tiny", tmp_path / "b", seed=7)
    c = synthesize("tiny", tmp_path / "c", seed=8)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    ta, tc = _load(a), _load(c)
    assert not any(torch.equal(ta[n], tc[n]) for n in ta)


@pytest.mark.parametrize("num_shards", [2, 5])
def test_sharded_index_covers_every_tensor_once(tmp_path, num_shards):
    single = _load(synthesize("tiny-qwen3", tmp_path / "single"))
    out = synthesize("tiny-qwen3", tmp_path / "sharded", num_shards=num_shards)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert files == [f"model-{k:05d}-of-{num_shards:05d}.safetensors" for k in range(1, num_shards + 1)]
    assert not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == set(files)
    for file in files:
        with safe_open(str(out / file), framework="pt") as f:
            assert set(f.keys()) == {n for n, fn in index["weight_map"].items() if fn == file}
    sharded = _load(out)
    assert index["weight_map"].keys() == sharded.keys() == single.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sharded.values())
    assert index["metadata"]["total_parameters"] == ModelConfig.from_hf(PRESETS["tiny-qwen3"]).num_params()
    # A tensor's bytes depend on the seed and its name, not on the shard layout.
    assert all(torch.equal(single[n], sharded[n]) for n in single)


def test_resynthesising_removes_stale_shards(tmp_path):
    synthesize("tiny", tmp_path, num_shards=3)
    synthesize("tiny", tmp_path)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_bad_arguments_fail_before_writing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="num_shards"):
        synthesize("tiny", out, num_shards=1000)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        synthesize("tiny", out, dtype="int8")
    with pytest.raises(ValueError, match="vocab_size 100"):
        synthesize({**PRESETS["tiny"], "vocab_size": 100}, out)
    with pytest.raises(ValueError, match="hidden_act"):
        synthesize({**PRESETS["tiny"], "hidden_act": "gelu"}, out)
    assert not out.exists()


@given(sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=40), data=st.data())
def test_split_is_contiguous_nonempty_and_complete(sizes, data):
    num_shards = data.draw(st.integers(1, len(sizes)))
    shards = split_shards(sizes, num_shards)
    assert len(shards) == num_shards
    assert all(shards) and [i for shard in shards for i in shard] == list(range(len(sizes)))


def test_synthetic_tokenizer_round_trips_and_renders_chat(tmp_path):
    out = synthesize("tiny", tmp_path)
    config = json.loads((out / "config.json").read_text())
    tok = Tokenizer.from_dir(out)
    assert tok.vocab_size == config["vocab_size"] == 512
    assert tok.bos_token_id == config["bos_token_id"]
    assert tok.eos_token_ids == frozenset(config["eos_token_id"])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))

    text = "Tell me about queues — ünïcödé 東京 🦀, 42!"
    assert tok.decode(tok.encode(text)) == text
    prompt = tok.render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                              {"role": "user", "content": "why?"}], system="Be brief.")
    assert prompt == ("<|begin_of_text|><|system|>\nBe brief.<|end|>\n<|user|>\nhi<|end|>\n"
                      "<|assistant|>\nhello<|end|>\n<|user|>\nwhy?<|end|>\n<|assistant|>\n")
    assert tok.render_chat([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith("<|end|>\n")
    ids = tok.encode_chat([Message("user", "hi")])
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_large_vocabularies_get_a_32000_token_tokenizer():
    tok = Tokenizer.from_files({"tokenizer.json": tokenizer_json(151936)})
    assert tok.vocab_size == 32000
    text = "Tell me about queues, please."
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text.encode()) / 2  # real merges, not bytes


def test_tokenizer_training_is_deterministic():
    assert train_tokenizer(600) == train_tokenizer(600)
