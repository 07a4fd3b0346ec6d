"""Random-weight HF checkpoints of named shapes, so nothing needs a model hub.

`synthesize("tinyllama-1.1b", out_dir)` writes a directory that any HF loader (and this
project's packer) reads like a downloaded model: config.json, safetensors weights
(single file or HF's sharded index layout), tokenizer.json, tokenizer_config.json with
a chat template, generation_config.json.

Presets carry the real models' shapes (sizes, GQA, rope scaling, biases, q/k norm, tied
embeddings); their bos/eos ids are those of the synthetic tokenizer written beside the
weights, a byte-level BPE trained here on a generated corpus. Models with more than
32000 ids get a 32000-token tokenizer; the higher ids have no text.

Weights are normal(0, 0.02) (norm gains 1 + normal(0, 0.02)), so bf16 byte statistics
resemble a trained model's. Each tensor is drawn from its own generator seeded by
(seed, tensor name) and written straight to the file, so memory holds one tensor at a
time and the bytes of a tensor do not depend on the shard layout.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from weights_tool.architecture import ModelConfig
from weights_tool.checkpoint import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, encode_safetensors_header
from weights_tool.dtypes import MODEL_DTYPE_BYTES, MODEL_DTYPES, torch_dtype

log = logging.getLogger(__name__)

SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)
# The trainer gives special tokens the first ids, in order.
BOS_TOKEN_ID = 0
END_OF_TEXT_ID = 1
END_TOKEN_ID = 5  # ends every chat turn, so it is the first eos
EOS_TOKEN_IDS = (END_TOKEN_ID, END_OF_TEXT_ID)
MAX_TOKENIZER_VOCAB = 32000
_MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # special tokens + one token per byte

CHAT_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ('system', 'user', 'assistant') %}
        {{- raise_exception('unsupported role ' + message['role'] + '; expected system, user or assistant') }}
    {%- endif %}
    {%- if message['role'] == 'system' and not loop.first %}
        {{- raise_exception('a system message may only come first') }}
    {%- endif %}
    {{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\\n' }}
{%- endif %}
"""

_WEIGHT_STD = 0.02

# ---- presets -------------------------------------------------------------------

_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
              "mlp_bias": False, "rms_norm_eps": 1e-5},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None,
                "rms_norm_eps": 1e-5},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
              "sliding_window": 32768, "rms_norm_eps": 1e-6},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
              "use_sliding_window": False, "sliding_window": None, "rms_norm_eps": 1e-6},
}


def _config(family: str, *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
            vocab: int, max_pos: int, rope_theta: float, tie: bool, head_dim: int | None = None,
            rope_scaling: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        **_FAMILIES[family],
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim or hidden // heads,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "max_position_embeddings": max_pos,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie,
        "torch_dtype": "bfloat16",
        "initializer_range": _WEIGHT_STD,
        "use_cache": True,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": list(EOS_TOKEN_IDS),
    }


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512, "max_pos": 2048}

PRESETS: dict[str, dict[str, Any]] = {
    # Tests: each builds in milliseconds; one per architecture feature.
    "tiny": _config("llama", **_TINY, rope_theta=10000.0, tie=False),
    # original_max_position_embeddings=256 puts head_dim 16's wavelengths (6 .. 4e5) in all three
    # llama3 bands: kept (< 64), smoothed (64 .. 256), scaled (> 256).
    "tiny-llama3": _config("llama", **_TINY, rope_theta=500000.0, tie=True,
                           rope_scaling={**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 256}),
    "tiny-mistral": _config("mistral", **_TINY, rope_theta=1e6, tie=False),
    "tiny-qwen2": _config("qwen2", **_TINY, rope_theta=1e6, tie=True),
    "tiny-qwen3": _config("qwen3", **_TINY, rope_theta=1e6, tie=True, head_dim=32),  # head_dim != hidden/heads
    # 100,093,440 parameters (tied embeddings): a CPU-sized model for benchmarks.
    "small": _config("llama", hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=32000,
                     max_pos=4096, rope_theta=10000.0, tie=True),
    # Real shapes.
    "tinyllama-1.1b": _config("llama", hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632,
                              vocab=32000, max_pos=2048, rope_theta=10000.0, tie=False),
    "llama-3.2-1b": _config("llama", hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192,
                            vocab=128256, max_pos=131072, rope_theta=500000.0, tie=True,
                            rope_scaling=dict(_LLAMA3_ROPE)),
    "llama-3-8b": _config("llama", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                          vocab=128256, max_pos=8192, rope_theta=500000.0, tie=False),
    "mistral-7b": _config("mistral", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                          vocab=32768, max_pos=32768, rope_theta=1e6, tie=False),  # v0.3
    "qwen2.5-0.5b": _config("qwen2", hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
                            vocab=151936, max_pos=32768, rope_theta=1e6, tie=True),
    "qwen3-0.6b": _config("qwen3", hidden=1024, layers=28, heads=16, kv_heads=8, intermediate=3072,
                          vocab=151936, max_pos=40960, rope_theta=1e6, tie=True, head_dim=128),
}


def preset_config(name: str) -> dict[str, Any]:
    """A copy of a preset's config.json dict; ValueError naming the presets if unknown."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


# ---- the checkpoint ------------------------------------------------------------


def synthesize(
    preset: str | dict[str, Any],
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    num_shards: int = 1,
    max_position_embeddings: int | None = None,
) -> Path:
    """Write a random-weight HF checkpoint of a preset (or a config.json dict) into out_dir.

    config.json is written last, so its presence means the directory is complete.
    Returns out_dir as a Path.
    """
    config = preset_config(preset) if isinstance(preset, str) else copy.deepcopy(dict(preset))
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(MODEL_DTYPES)}")
    if max_position_embeddings is not None:
        if max_position_embeddings <= 0:
            raise ValueError(f"max_position_embeddings must be positive, got {max_position_embeddings}")
        config["max_position_embeddings"] = max_position_embeddings
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    config.pop("dtype", None)  # transformers 5's name for torch_dtype; one source of truth
    config.update(torch_dtype=dtype, bos_token_id=BOS_TOKEN_ID, eos_token_id=list(EOS_TOKEN_IDS))
    model = ModelConfig.from_hf(config)
    if model.vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size {model.vocab_size} is below {_MIN_VOCAB}, the synthetic tokenizer's minimum")
    shapes = model.tensor_shapes()
    if not 1 <= num_shards <= len(shapes):
        raise ValueError(f"num_shards must be between 1 and {len(shapes)} (the tensor count), got {num_shards}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / CONFIG_FILE, out / INDEX_FILE, *out.glob("model*.safetensors")]:
        stale.unlink(missing_ok=True)
    label = preset if isinstance(preset, str) else model.architecture
    log.info("synthesising %s: %.2f GB of %s in %d shard(s) -> %s",
             label, model.weight_bytes(dtype) / 1e9, dtype, num_shards, out)

    _write_tokenizer(out, model.vocab_size, model.max_position_embeddings)
    _write_json(out / "generation_config.json", {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": list(EOS_TOKEN_IDS)})
    _write_weights(out, shapes, dtype, seed, num_shards)
    tmp = out / f"{CONFIG_FILE}.tmp"
    _write_json(tmp, config)
    tmp.replace(out / CONFIG_FILE)
    return out


def _write_weights(out: Path, shapes: dict[str, tuple[int, ...]], dtype: str, seed: int, num_shards: int) -> None:
    names = list(shapes)
    nbytes = [_numel(shapes[n]) * MODEL_DTYPE_BYTES[dtype] for n in names]
    if num_shards == 1:
        _write_safetensors(out / SINGLE_FILE, {n: shapes[n] for n in names}, dtype, seed)
        return
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(split_shards(nbytes, num_shards)):
        filename = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        _write_safetensors(out / filename, {names[i]: shapes[names[i]] for i in shard}, dtype, seed)
        weight_map.update(dict.fromkeys((names[i] for i in shard), filename))
        log.info("wrote %s (%d tensors)", filename, len(shard))
    # HF's own index layout (transformers save_pretrained): sorted keys, two-space indent.
    index = {
        "metadata": {"total_parameters": sum(_numel(s) for s in shapes.values()), "total_size": sum(nbytes)},
        "weight_map": weight_map,
    }
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def split_shards(nbytes: list[int], num_shards: int) -> list[list[int]]:
    """How `num_shards` files share tensors of `nbytes` bytes each: contiguous runs of tensor indices,
    about equal in bytes, none empty."""
    total = sum(nbytes)
    shards: list[list[int]] = [[]]
    done = 0  # bytes in finished shards and the current one
    for i, size in enumerate(nbytes):
        k = len(shards) - 1
        is_full = done >= total * (k + 1) / num_shards
        must_move = len(nbytes) - i <= num_shards - 1 - k  # every later shard needs a tensor
        if shards[-1] and k < num_shards - 1 and (is_full or must_move):
            shards.append([])
        shards[-1].append(i)
        done += size
    return shards


def _write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str, seed: int) -> None:
    # Streamed: the header (shapes are known), then each tensor as it is drawn.
    head, _ = encode_safetensors_header(((n, MODEL_DTYPES[dtype], s) for n, s in shapes.items()), {"format": "pt"})
    with open(path, "wb") as f:
        f.write(head)
        for name, shape in shapes.items():
            f.write(_random_tensor(name, shape, dtype, seed).view(torch.uint8).numpy())


def _random_tensor(name: str, shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    tensor = torch.empty(shape, dtype=torch_dtype(dtype))
    mean = 1.0 if name.endswith("norm.weight") else 0.0  # RMSNorm gains sit near 1
    return tensor.normal_(mean, _WEIGHT_STD, generator=generator)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# ---- the tokenizer -------------------------------------------------------------


def _write_tokenizer(out: Path, model_vocab_size: int, max_len: int) -> None:
    (out / "tokenizer.json").write_text(tokenizer_json(model_vocab_size), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": {
            str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, tok in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
        "eos_token": SPECIAL_TOKENS[END_TOKEN_ID],
        "pad_token": SPECIAL_TOKENS[END_OF_TEXT_ID],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })


def tokenizer_json(model_vocab_size: int) -> str:
    """The synthetic tokenizer.json for a model of this vocabulary size (at most 32000 tokens)."""
    return _cached_tokenizer(min(model_vocab_size, MAX_TOKENIZER_VOCAB))


def train_tokenizer(vocab_size: int) -> str:
    """A byte-level BPE tokenizer.json of `vocab_size` tokens, trained afresh; the same text every time."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Distinct words bound the number of merges; a small vocabulary needs only a few.
    tokenizer.train_from_iterator(_corpus(num_words=min(60000, 2 * vocab_size + 1000)), trainer)
    bos = SPECIAL_TOKENS[BOS_TOKEN_ID]
    # encode(add_special_tokens=True) prepends BOS, like Llama tokenizers.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_TOKEN_ID)]
    )
    if [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError("the BPE trainer did not give the special tokens the first ids")
    return tokenizer.to_str()


# Training takes a second or more; every model of one vocabulary size shares a tokenizer.
_cached_tokenizer = functools.cache(train_tokenizer)

_ENGLISH = (
    "A request is either computing within a few milliseconds of arrival, or it is refused at once. "
    "It never waits in a queue: not in the proxy, not in the scheduler, not inside an actor. "
    "The quick brown fox jumps over the lazy dog. Tell me about queues, please! "
    "What is the time? It is 10:45, and the weather is 21 degrees. "
    "def main(): return {\"key\": [1, 2, 3]}  # code, numbers and brackets 0123456789 "
    "Café, naïve, über, straße, façade, déjà vu; 東京 日本語 привет мир γειά σου. "
)
_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "cl", "dr", "fl", "gr", "pl", "st", "th", "sh", "ch", "tr", "sp")
_NUCLEI = ("a", "e", "i", "o", "u", "y", "ai", "ea", "ou", "io")
_CODAS = ("", "n", "r", "s", "t", "l", "m", "x", "nd", "st", "ck", "ng")


def _corpus(num_words: int):
    """Deterministic text: English-ish sentences plus Zipf-distributed pseudo-words (only random.random,
    whose stream is stable across Python versions)."""
    yield from [_ENGLISH] * 50
    rng = random.Random(20240601)

    def pick(options: tuple[str, ...]) -> str:
        return options[int(rng.random() * len(options))]

    seen: set[str] = set()
    while len(seen) < num_words:
        word = "".join(pick(_ONSETS) + pick(_NUCLEI) + pick(_CODAS) for _ in range(1 + int(rng.random() * 3)))
        if word not in seen:
            seen.add(word)
            yield " ".join([word] * max(1, 3000 // len(seen)))
