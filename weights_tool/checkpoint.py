"""An HF checkpoint directory, read: config.json, tokenizer files, and where every tensor's bytes lie.

The one reader of safetensors directories: the packer (weights_tool/pack.py), the
runtime's loader (actors/checkpoint.py) and the loader benchmark all go through it.

Layout: a single `model.safetensors`, or `model.safetensors.index.json` whose
`weight_map` names the file of every tensor. Only the safetensors headers are parsed
(plain JSON; never `torch.load` or pickle, whose bytes can execute code), and every
tensor's byte range is checked against its dtype, its shape and its file before anyone
reads it. The bytes themselves are memory-mapped (`Weights.tensor_bytes`), so a bf16
tensor stays bit-exact and nothing is converted here.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weights_tool.architecture import CheckpointError
from weights_tool.dtypes import SAFETENSORS_SIZES

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Every tokenizer file a checkpoint may carry; the packer embeds whichever exist.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt",
)
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit

ReadAt = Callable[[int, int], bytes]  # (offset, n) -> up to n bytes of the file from offset


@dataclass(frozen=True)
class CheckpointTensor:
    """Where one tensor's bytes lie, and what its safetensors header says about it."""

    name: str
    dtype: str  # safetensors' name: "BF16", "F32", ...
    shape: tuple[int, ...]
    file: int  # index into `Weights.files`
    start: int  # absolute offset in that file
    size: int


@dataclass(frozen=True)
class WeightFile:
    path: Path
    metadata: dict[str, str] | None  # its `__metadata__`, as found
    tensors: tuple[str, ...]  # in the file's data order


@dataclass(frozen=True)
class Weights:
    """Every safetensors file of a checkpoint and every tensor in them; no tensor byte is read."""

    files: tuple[WeightFile, ...]  # in the order the index first names them
    index_metadata: dict[str, Any] | None  # None: a single model.safetensors, no index
    tensors: dict[str, CheckpointTensor]

    def tensor_bytes(self, *, mode: str = "r") -> dict[str, np.ndarray]:
        """Each tensor's bytes as a uint8 view of its memory-mapped file (`mode` as np.memmap's)."""
        maps = [np.memmap(f.path, dtype=np.uint8, mode=mode) for f in self.files]
        return {n: maps[t.file][t.start : t.start + t.size] for n, t in self.tensors.items()}


@dataclass(frozen=True)
class Checkpoint:
    config: dict[str, Any]  # config.json, as found
    tokenizer_files: dict[str, str]  # file name -> text
    weights: Weights


def read_checkpoint(hf_dir: str | os.PathLike[str]) -> Checkpoint:
    """config.json, tokenizer files and every tensor's place in an HF safetensors directory."""
    return Checkpoint(read_config(hf_dir), read_tokenizer_files(hf_dir), read_weights(hf_dir))


def read_config(hf_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The directory's config.json, unparsed (`ModelConfig.from_hf` parses it)."""
    path = Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a checkpoint directory needs a config.json")
    return _read_json(path)


def read_tokenizer_files(hf_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The text of each of TOKENIZER_FILES the directory holds."""
    root = Path(hf_dir)
    files = {}
    for name in TOKENIZER_FILES:
        if (root / name).is_file():
            try:
                files[name] = (root / name).read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                raise CheckpointError(f"{root / name} is not UTF-8 text") from None
    if (root / "tokenizer.model").is_file():
        log.warning("%s: tokenizer.model (sentencepiece, binary) is not embedded; tokenizer.json is", root)
    return files


def read_weights(hf_dir: str | os.PathLike[str]) -> Weights:
    """Every weight file's header, checked against the index: each tensor in exactly the file it names."""
    root = Path(hf_dir)
    index_path = root / INDEX_FILE
    weight_map: dict[str, str] | None = None
    index_metadata = None
    if index_path.is_file():
        index = _read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no 'weight_map' of tensor name -> shard file")
        for shard in weight_map.values():
            # A shard name is a plain file name next to the index, never a path out of the directory.
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise CheckpointError(f"{index_path} names an invalid shard file {shard!r}")
        index_metadata = index.get("metadata") or {}
        names = list(dict.fromkeys(weight_map.values()))
        missing = [s for s in names if not (root / s).is_file()]
        if missing:
            raise CheckpointError(f"{index_path} references missing shard file(s): {', '.join(missing)}")
    elif (root / SINGLE_FILE).is_file():
        names = [SINGLE_FILE]
    else:
        raise CheckpointError(
            f"{root} holds neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors weights are loaded)"
        )

    headers = [read_safetensors_header(root / name, k) for k, name in enumerate(names)]
    if weight_map is not None:
        held = {name: {t.name for t in entries} for name, (entries, _) in zip(names, headers, strict=True)}
        for tensor, shard in weight_map.items():
            if tensor not in held[shard]:
                raise CheckpointError(f"{index_path} places tensor {tensor} in {shard}, which does not hold it")
    files, tensors = [], {}
    for name, (entries, metadata) in zip(names, headers, strict=True):
        for t in entries:
            if t.name in tensors:
                raise CheckpointError(f"tensor {t.name} is stored twice ({names[tensors[t.name].file]} and {name})")
            if weight_map is not None and weight_map.get(t.name) != name:
                where = f"places in {weight_map[t.name]}" if t.name in weight_map else "does not list"
                raise CheckpointError(f"{name} holds tensor {t.name}, which {INDEX_FILE} {where}")
            tensors[t.name] = t
        files.append(WeightFile(root / name, metadata, tuple(t.name for t in entries)))
    return Weights(tuple(files), index_metadata, tensors)


def read_safetensors_header(
    path: Path, file_index: int = 0, read_at: ReadAt | None = None
) -> tuple[list[CheckpointTensor], dict[str, str] | None]:
    """The tensors of one safetensors file in data order, every offset checked against the file; and its
    `__metadata__`. `read_at` reads the file's bytes (default: plain reads); a benchmark passes a throttled one."""
    file_size = path.stat().st_size
    if read_at is None:
        with open(path, "rb") as f:
            return _parse_safetensors_header(path, file_index, file_size, lambda offset, n: os.pread(f.fileno(), n, offset))
    return _parse_safetensors_header(path, file_index, file_size, read_at)


def _parse_safetensors_header(
    path: Path, file_index: int, file_size: int, read_at: ReadAt
) -> tuple[list[CheckpointTensor], dict[str, str] | None]:
    # The layout: u64 header length, the JSON header, then the data its offsets are relative to.
    if file_size < 8:
        raise CheckpointError(f"{path} is too short ({file_size} bytes) for a safetensors header")
    (n,) = struct.unpack("<Q", read_at(0, 8))
    if n > MAX_SAFETENSORS_HEADER or 8 + n > file_size:
        raise CheckpointError(f"{path}: safetensors header size {n} is out of bounds")
    try:
        header = json.loads(read_at(8, n))
    except ValueError as e:
        raise CheckpointError(f"{path}: safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    data_start, data_size = 8 + n, file_size - 8 - n
    tensors = []
    for name, e in header.items():
        try:
            dtype, shape, (begin, end) = e["dtype"], tuple(int(d) for d in e["shape"]), e["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path}: malformed safetensors header entry for {name}") from None
        if dtype not in SAFETENSORS_SIZES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_size
                and end - begin == numel * SAFETENSORS_SIZES[dtype]):
            raise CheckpointError(f"{path}: tensor {name} has data_offsets {[begin, end]} inconsistent with "
                                  f"{dtype} x {list(shape)} in {data_size} data bytes")
        tensors.append(CheckpointTensor(name, dtype, shape, file_index, data_start + begin, end - begin))
    tensors.sort(key=lambda t: t.start)
    return tensors, metadata


def encode_safetensors_header(
    tensors: Iterable[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None
) -> tuple[bytes, int]:
    """What a safetensors file of `tensors` (name, safetensors dtype, shape), stored back to back in
    this order, starts with: u64 length, then the JSON header padded with spaces to 8 bytes, as the
    safetensors library writes it. Also the size of the data that follows."""
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in tensors:
        size = SAFETENSORS_SIZES[dtype]
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, offset


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data
