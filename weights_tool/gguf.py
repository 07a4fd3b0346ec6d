"""GGUF (llama.cpp) file -> HF checkpoint directory -> `.zqs` shard file: `zq-weights pack model.gguf`.

`convert_gguf` writes the HF directory a llama-architecture GGUF file describes:
config.json from the `llama.*` metadata, model.safetensors with HF tensor names,
tokenizer.json + tokenizer_config.json from `tokenizer.*` (weights_tool/gguf_tokenizer.py)
and generation_config.json. `pack_gguf` packs that directory with `pack()` and deletes it.

The reference is transformers' own GGUF loader (modeling_gguf_pytorch_utils.py,
`load_gguf_checkpoint`), so a packed GGUF computes what transformers computes from the
same file:

- Every tensor is dequantized to float32 by `gguf.quants.dequantize` (llama.cpp's own
  Python reference), then cast to the chosen dtype with torch, as transformers casts it.
- llama.cpp's converter permutes the rows of attn_q / attn_k so each head's rotary pairs are
  interleaved (its rope rotates adjacent pairs; HF's `rotate_half` rotates the two halves).
  `_reverse_permute` undoes it exactly as transformers' `LlamaTensorProcessor` does.
- The model is tied (`tie_word_embeddings`) when the file has no `output.weight`.

Only tensor types with a tested dequantizer are accepted (`SUPPORTED_TYPES`); the others are
refused by name. Everything about the file is checked before anything is dequantized, and
its layout (`check_layout`) before `gguf.GGUFReader` parses it: the reader trusts every count
and length in the header, so a corrupt array length would have it loop or allocate without
bound.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

from weights_tool.architecture import CheckpointError, ModelConfig, UnsupportedArchitectureError
from weights_tool.checkpoint import encode_safetensors_header
from weights_tool.dtypes import MODEL_DTYPE_BYTES, MODEL_DTYPES
from weights_tool.gguf_tokenizer import tokenizer_files

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
GGUF_MAGIC = b"GGUF"
_READABLE_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32

# llama.cpp name -> HF name (gguf's tensor_mapping.py, the llama rows).
_MODEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Defaults where a key is absent: transformers' LlamaConfig defaults, which its GGUF loader falls back on.
_DEFAULT_CONTEXT = 2048
_DEFAULT_RMS_EPS = 1e-6
_DEFAULT_ROPE_THETA = 10000.0


def pack_gguf(
    gguf_path: str | os.PathLike[str], out_path: str | os.PathLike[str], *, dtype: str = "bfloat16",
    progress: bool = False, **pack_kwargs: Any,
) -> Path:
    """Pack a llama GGUF file into `out_path` (dequantized to `dtype`); `pack_kwargs` go to `pack()`."""
    from weights_tool.pack import pack

    out = Path(out_path)
    # Next to the output, not in /tmp: the dequantized weights are several times the GGUF's size.
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.gguf-") as tmp:
        hf_dir = convert_gguf(gguf_path, tmp, dtype=dtype, progress=progress)
        return pack(hf_dir, out, progress=progress, **pack_kwargs)


def convert_gguf(
    gguf_path: str | os.PathLike[str], hf_dir: str | os.PathLike[str], *, dtype: str = "bfloat16",
    progress: bool = False,
) -> Path:
    """Write the HF checkpoint directory a llama GGUF file describes into `hf_dir`; returns it.

    Raises CheckpointError, before any tensor is dequantized, for a file that is not GGUF,
    is cut short or inconsistent, or holds something other than a llama model in supported types.
    """
    if dtype not in MODEL_DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(MODEL_DTYPE_BYTES)}, got {dtype!r}")
    path = Path(gguf_path)
    check_layout(path)
    reader = _open(path)
    metadata = _metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    config = hf_config(metadata, tuple(tensors), dtype)
    model = ModelConfig.from_hf(config)
    names = _hf_names(tensors, model)
    files = tokenizer_files(metadata)

    out = Path(hf_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps(_generation_config(config), indent=2), encoding="utf-8")
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    order = [(hf, tensors[names[hf]]) for hf in model.tensor_shapes()]
    _write_safetensors(out / "model.safetensors", order, model, dtype, progress)
    log.info("converted %s (%d tensors) to %s in %s", path, len(order), out, dtype)
    return out


# ---- config ----------------------------------------------------------------------------


def hf_config(metadata: dict[str, Any], tensor_names: tuple[str, ...], dtype: str) -> dict[str, Any]:
    """The HF config.json of a llama GGUF file: the keys transformers' GGUF loader reads, its defaults."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise UnsupportedArchitectureError(f"GGUF architecture {arch!r} is not supported; supported: llama")
    if metadata.get("llama.rope.scaling.type", "none") != "none" or "rope_freqs.weight" in tensor_names:
        raise CheckpointError("GGUF file uses rope scaling (llama.rope.scaling.* or rope_freqs.weight), "
                              "which zq-weights does not convert")
    num_heads = _int(metadata, "llama.attention.head_count")
    hidden = _int(metadata, "llama.embedding_length")
    tokens = metadata.get("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": _int(metadata, "llama.feed_forward_length"),
        "num_hidden_layers": _int(metadata, "llama.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _int(metadata, "llama.attention.head_count_kv", num_heads),
        "head_dim": _int(metadata, "llama.rope.dimension_count", hidden // num_heads),
        "max_position_embeddings": _int(metadata, "llama.context_length", _DEFAULT_CONTEXT),
        "rms_norm_eps": _float(metadata, "llama.attention.layer_norm_rms_epsilon", _DEFAULT_RMS_EPS),
        "rope_theta": _float(metadata, "llama.rope.freq_base", _DEFAULT_ROPE_THETA),
        "vocab_size": _int(metadata, "llama.vocab_size", len(tokens) if isinstance(tokens, list) else None),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if (token_id := metadata.get(f"tokenizer.ggml.{key}")) is not None:
            config[name] = token_id
    return config


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}


def _int(metadata: dict[str, Any], key: str, default: int | None = None) -> int:
    value = metadata.get(key, default)
    if value is None:
        raise CheckpointError(f"GGUF file lacks required metadata {key}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"GGUF metadata {key}={value!r} is not a positive integer")
    return value


def _float(metadata: dict[str, Any], key: str, default: float) -> float:
    value = metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CheckpointError(f"GGUF metadata {key}={value!r} is not a positive number")
    return float(value)


# ---- tensors ---------------------------------------------------------------------------


def _hf_names(tensors: dict[str, Any], model: ModelConfig) -> dict[str, str]:
    """HF name -> GGUF name for every tensor, after checking names, types and shapes against the config."""
    names: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for gguf_name, t in tensors.items():
        hf = hf_tensor_name(gguf_name)
        if hf is None:
            raise CheckpointError(f"GGUF tensor {gguf_name} is not part of a llama model that zq-weights converts")
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            raise CheckpointError(f"tensor {gguf_name} has type {type_name}, which zq-weights does not dequantize; "
                                  f"supported: {', '.join(SUPPORTED_TYPES)}")
        names[hf] = gguf_name
        shapes[hf] = tuple(reversed([int(d) for d in t.shape]))  # GGUF lists dims fastest-first
    model.check_tensors(shapes)
    return names


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for a name llama does not have."""
    if gguf_name in _MODEL_NAMES:
        return _MODEL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _reverse_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order on a q or k weight [num_heads * head_dim, hidden].

    llama.cpp stores each head's rows as [head_dim/2, 2] (pairs interleaved); HF wants [2, head_dim/2].
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantized(t: Any, hf_name: str, model: ModelConfig) -> np.ndarray:
    """One GGUF tensor as float32 in HF layout (q / k rows un-permuted)."""
    w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
    if hf_name.endswith("self_attn.q_proj.weight"):
        w = _reverse_permute(w, model.num_heads)
    elif hf_name.endswith("self_attn.k_proj.weight"):
        w = _reverse_permute(w, model.num_kv_heads)
    # An F32 tensor comes back as a read-only view of the file; torch wants memory of its own.
    return w if w.flags.writeable and w.flags.c_contiguous else np.array(w, dtype=np.float32, order="C")


def _write_safetensors(path: Path, tensors: list[tuple[str, Any]], model: ModelConfig, dtype: str,
                       progress: bool) -> None:
    """Write model.safetensors one tensor at a time: the header first (shapes are known), then each
    tensor dequantized, cast and written, so at most one tensor is held in memory."""
    import torch  # imported here: reading a GGUF's header needs none of it

    torch_dtype = getattr(torch, dtype)
    raw, size = encode_safetensors_header(
        ((name, MODEL_DTYPES[dtype], tuple(int(d) for d in reversed(t.shape))) for name, t in tensors),
        {"format": "pt"})
    with open(path, "wb") as f, tqdm(total=size, unit="B", unit_scale=True, desc="dequantize",
                                     disable=None if progress else True) as bar:
        f.write(raw)
        for name, t in tensors:
            w = torch.from_numpy(_dequantized(t, name, model)).to(torch_dtype)
            data = w.view(torch.uint8).numpy()
            f.write(memoryview(data))
            bar.update(data.nbytes)


# ---- reading the file --------------------------------------------------------------------


def _open(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError / KeyError / IndexError on bad files
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from e


def _metadata(reader: GGUFReader, path: Path) -> dict[str, Any]:
    try:
        return {key: field.contents() for key, field in reader.fields.items()}
    except (UnicodeDecodeError, ValueError, IndexError) as e:
        raise CheckpointError(f"{path}: GGUF metadata cannot be decoded: {e}") from e


# ---- the layout check -------------------------------------------------------------------

# GGUF value type -> size of one value; 8 (string) and 9 (array) are variable.
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Bounds-checked little-endian reads over the file's bytes."""

    def __init__(self, buf: Any, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def skip(self, n: int, what: str) -> int:
        if n > len(self.buf) - self.pos:
            raise CheckpointError(f"{self.path}: truncated GGUF file: {what} at byte {self.pos} needs {n} bytes, "
                                  f"the file has {len(self.buf) - self.pos} left")
        start, self.pos = self.pos, self.pos + n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.skip(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.skip(8, what))[0]

    def string(self, what: str) -> bytes:
        n = self.u64(what)
        start = self.skip(n, what)
        return bytes(self.buf[start : start + n])

    def value(self, value_type: int, what: str) -> Any:
        """Skip one value; a scalar is returned as an unsigned integer (all that is read is general.alignment)."""
        if value_type == _STRING:
            self.string(what)
        elif value_type == _ARRAY:
            item_type, count = self.u32(what), self.u64(what)
            if item_type in _VALUE_SIZES:
                self.skip(count * _VALUE_SIZES[item_type], what)  # one bounds check, however large the count
            else:
                for _ in range(count):  # every item takes at least 8 bytes, so a bad count soon runs out of file
                    self.value(item_type, what)
        elif value_type in _VALUE_SIZES:
            start = self.skip(_VALUE_SIZES[value_type], what)
            return int.from_bytes(self.buf[start : start + _VALUE_SIZES[value_type]], "little")
        else:
            raise CheckpointError(f"{self.path}: {what} has unknown GGUF value type {value_type}")
        return None


def check_layout(path: Path) -> None:
    """Check a GGUF file's structure against its size before anything parses it.

    Magic, version, every metadata length, every tensor's type and its byte range: each
    tensor's shape and type give its size, which must fit in the file and end before the next.
    """
    if not path.is_file():
        raise CheckpointError(f"{path} not found")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8 or head[:4] != GGUF_MAGIC:
            raise CheckpointError(f"{path} is not a GGUF file (starts with {head[:4]!r}, expected {GGUF_MAGIC!r})")
        version = struct.unpack_from("<I", head, 4)[0]
        if version not in _READABLE_VERSIONS:
            raise CheckpointError(f"{path}: GGUF version {version} is not supported (big-endian or unknown); "
                                  f"supported: {', '.join(map(str, _READABLE_VERSIONS))}")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(buf, path)
    cursor.skip(8, "magic and version")
    num_tensors, num_fields = cursor.u64("tensor count"), cursor.u64("metadata count")
    alignment = _DEFAULT_ALIGNMENT
    for i in range(num_fields):
        key = cursor.string(f"metadata key {i}").decode("utf-8", "replace")
        value = cursor.value(cursor.u32(f"metadata {key}"), f"metadata {key}")
        if key == "general.alignment":
            if not value or value & (value - 1):
                raise CheckpointError(f"{path}: general.alignment={value} is not a power of two")
            alignment = value
    infos = [_tensor_info(cursor, i) for i in range(num_tensors)]
    data_start = -(-cursor.pos // alignment) * alignment
    _check_ranges(path, infos, data_start, len(buf))


def _tensor_info(cursor: _Cursor, index: int) -> tuple[str, str, list[int], int, int]:
    """(name, type name, dims, offset, size in bytes) of one tensor info record."""
    name = cursor.string(f"tensor {index} name").decode("utf-8", "replace")
    num_dims = cursor.u32(f"tensor {name}")
    if num_dims > _MAX_DIMS:
        raise CheckpointError(f"{cursor.path}: tensor {name} has {num_dims} dimensions; GGUF allows {_MAX_DIMS}")
    dims = [cursor.u64(f"tensor {name}") for _ in range(num_dims)]
    type_id, offset = cursor.u32(f"tensor {name}"), cursor.u64(f"tensor {name}")
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise CheckpointError(f"{cursor.path}: tensor {name} has unknown ggml type id {type_id}") from None
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if dims and dims[0] % block:
        raise CheckpointError(f"{cursor.path}: tensor {name} of type {qtype.name} has rows of {dims[0]} values, "
                              f"not a multiple of its block of {block}")
    size = int(np.prod(dims, dtype=object)) // block * block_bytes
    return name, qtype.name, dims, offset, size


def _check_ranges(path: Path, infos: list[tuple[str, str, list[int], int, int]], data_start: int,
                  file_size: int) -> None:
    ordered = sorted(infos, key=lambda info: info[3])
    for k, (name, type_name, dims, offset, size) in enumerate(ordered):
        end = data_start + offset + size
        what = f"tensor {name} ({type_name} x {dims[::-1]}, {size} bytes at {data_start + offset})"
        if end > file_size:
            raise CheckpointError(f"{path}: {what} runs past the end of the file ({file_size} bytes): "
                                  "the file is truncated or the tensor's size disagrees with its shape and type")
        if k + 1 < len(ordered) and offset + size > ordered[k + 1][3]:
            raise CheckpointError(f"{path}: {what} overlaps tensor {ordered[k + 1][0]}: its size disagrees "
                                  "with its shape and type")
