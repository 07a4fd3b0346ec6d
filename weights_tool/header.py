"""Reading a `.zqs` header: `parse_header` checks an untrusted one completely before any reader uses it.

Every type, length and offset is checked against the file (weights_tool/format.py gives
the layout): groups are embed, layer.0.., final in order; each group's tensors tile its
frames exactly, in stream order; frames lie inside the file, after the header, without
overlap, and the last one ends the file; every tensor is in exactly one source file, and
its size is its dtype times its shape. A failure raises `ShardFormatError` naming the
group, frame or tensor at fault.
"""

from __future__ import annotations

import json
import re
from typing import Any

from weights_tool.dtypes import SAFETENSORS_SIZES
from weights_tool.format import (
    BYTEGROUP_ELEMENT_SIZES,
    CODEC_BYTEGROUP,
    CODEC_RAW,
    CODECS,
    MAX_BLOCK_BYTES,
    MAX_FRAME_BYTES,
    MAX_NAME_CHARS,
    MAX_NDIM,
    PREAMBLE,
    FrameEntry,
    GroupEntry,
    Header,
    ShardFormatError,
    SourceFile,
    TensorEntry,
    crc32,
)
from weights_tool.groups import group_names, group_of

_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")

_TOP_KEYS = {"num_layers", "config", "tokenizer_files", "source", "groups"}
_TOP_OPTIONAL_KEYS = {"packer"}
_FRAME_KEYS = {"offset", "stored_size", "size", "codec", "crc32"}
_BYTEGROUP_KEYS = {"element_size", "block_size"}
_TENSOR_KEYS = {"name", "dtype", "shape", "frame", "offset", "size"}


def parse_header(raw: bytes, header_crc: int, *, file_size: int) -> Header:
    """Validate the header bytes completely against a file of `file_size` bytes."""
    if crc32(raw) != header_crc:
        raise ShardFormatError(f"header checksum mismatch (stored {header_crc:#010x}, computed {crc32(raw):#010x})")
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ShardFormatError(f"header is not valid JSON: {e}") from None
    data_start = PREAMBLE.size + len(raw)
    d = _obj(doc, "header", _TOP_KEYS, _TOP_OPTIONAL_KEYS)

    num_layers = _int(d["num_layers"], "header num_layers", lo=1, hi=1 << 20)
    config = _obj(d["config"], "header config")
    if config.get("num_hidden_layers") != num_layers or type(config.get("num_hidden_layers")) is not int:
        raise ShardFormatError(
            f"header num_layers={num_layers} but config num_hidden_layers={config.get('num_hidden_layers')!r}"
        )
    tokenizer_files = _obj(d["tokenizer_files"], "header tokenizer_files")
    for name, text in tokenizer_files.items():
        _file_name(name, "tokenizer file")
        if not isinstance(text, str):
            raise ShardFormatError(f"tokenizer file {name!r} is not a string")
    packer = _obj(d.get("packer", {}), "header packer")

    expected = group_names(num_layers)
    groups_doc = d["groups"]
    if not isinstance(groups_doc, list) or len(groups_doc) != len(expected):
        got = len(groups_doc) if isinstance(groups_doc, list) else type(groups_doc).__name__
        raise ShardFormatError(f"header groups: expected {len(expected)} groups (embed, {num_layers} layers, final), got {got}")
    groups = tuple(_parse_group(g, name, file_size) for g, name in zip(groups_doc, expected, strict=True))
    _check_names_unique(groups)
    _check_frames_disjoint(groups, data_start, file_size)
    source_files, index_metadata = _parse_source(d["source"], groups)
    return Header(num_layers, config, tokenizer_files, source_files, index_metadata, groups, packer)


def _parse_group(doc: Any, name: str, file_size: int) -> GroupEntry:
    g = _obj(doc, f"group {name}", {"name", "frames", "tensors"})
    if g["name"] != name:
        raise ShardFormatError(f"group {name}: header names it {g['name']!r}; groups must be embed, layer.0.., final in order")
    frames_doc, tensors_doc = g["frames"], g["tensors"]
    if not isinstance(frames_doc, list) or not frames_doc or len(frames_doc) > 1 << 20:
        raise ShardFormatError(f"group {name}: frames must be a non-empty list")
    if not isinstance(tensors_doc, list) or not tensors_doc:
        raise ShardFormatError(f"group {name}: tensors must be a non-empty list")
    frames = tuple(_parse_frame(f, f"group {name} frame {k}", file_size) for k, f in enumerate(frames_doc))
    tensors = tuple(_parse_tensor(t, name, len(frames)) for t in tensors_doc)

    # Tensors tile their frames exactly, in list order: frame by frame, offset by offset.
    frame_index, pos = 0, 0
    for t in tensors:
        while t.frame > frame_index:
            if pos != frames[frame_index].size:
                raise ShardFormatError(_tiling_error(name, frame_index, frames[frame_index], pos, t))
            frame_index, pos = frame_index + 1, 0
        if t.frame != frame_index or t.offset != pos:
            raise ShardFormatError(
                f"tensor {t.name} (group {name}): slice at frame {t.frame} offset {t.offset} is out of order; "
                f"expected frame {frame_index} offset {pos}"
            )
        frame = frames[t.frame]
        if t.offset + t.size > frame.size:
            raise ShardFormatError(
                f"tensor {t.name} (group {name}): slice [{t.offset}, {t.offset + t.size}) lies outside "
                f"frame {t.frame} ({frame.size} bytes)"
            )
        if frame.codec == CODEC_BYTEGROUP and (t.offset % frame.element_size or t.size % frame.element_size):
            raise ShardFormatError(
                f"tensor {t.name} (group {name}): slice is not a whole number of "
                f"{frame.element_size}-byte elements of byte-grouped frame {t.frame}"
            )
        pos += t.size
    if frame_index != len(frames) - 1 or pos != frames[-1].size:
        raise ShardFormatError(_tiling_error(name, frame_index, frames[frame_index], pos, None))
    return GroupEntry(name, frames, tensors)


def _parse_frame(doc: Any, where: str, file_size: int) -> FrameEntry:
    if not isinstance(doc, dict):
        raise ShardFormatError(f"{where} must be a JSON object, got {type(doc).__name__}")
    codec = doc.get("codec")
    if codec not in CODECS:
        raise ShardFormatError(f"{where}: codec {codec!r} is not one of {', '.join(CODECS)}")
    is_bytegroup = codec == CODEC_BYTEGROUP
    f = _obj(doc, where, _FRAME_KEYS | (_BYTEGROUP_KEYS if is_bytegroup else set()))
    offset = _int(f["offset"], f"{where} offset", hi=file_size)
    stored_size = _int(f["stored_size"], f"{where} stored_size", hi=file_size)
    size = _int(f["size"], f"{where} size", hi=MAX_FRAME_BYTES)
    crc = _int(f["crc32"], f"{where} crc32", hi=0xFFFFFFFF)
    if offset + stored_size > file_size:
        raise ShardFormatError(
            f"{where}: stored bytes [{offset}, {offset + stored_size}) run past the end of the file "
            f"({file_size} bytes): truncated or corrupt"
        )
    if codec == CODEC_RAW and stored_size != size:
        raise ShardFormatError(f"{where}: raw frame stores {stored_size} bytes but declares {size}")
    element_size = block_size = 0
    if is_bytegroup:
        element_size = _int(f["element_size"], f"{where} element_size")
        block_size = _int(f["block_size"], f"{where} block_size", lo=1, hi=MAX_BLOCK_BYTES)
        if element_size not in BYTEGROUP_ELEMENT_SIZES:
            raise ShardFormatError(f"{where}: element_size {element_size} is not one of {BYTEGROUP_ELEMENT_SIZES}")
        if block_size % element_size or size % element_size:
            raise ShardFormatError(
                f"{where}: block_size {block_size} and size {size} must be multiples of element_size {element_size}"
            )
    return FrameEntry(offset, stored_size, size, codec, crc, element_size, block_size)


def _parse_tensor(doc: Any, group: str, num_frames: int) -> TensorEntry:
    t = _obj(doc, f"group {group} tensor", _TENSOR_KEYS)
    name = t["name"]
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise ShardFormatError(f"group {group}: tensor name {str(name)[:80]!r} is not a 1..{MAX_NAME_CHARS} character string")
    where = f"tensor {name} (group {group})"
    if group_of(name) != group:
        raise ShardFormatError(f"{where}: belongs to group {group_of(name)}")
    dtype = t["dtype"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_SIZES:
        raise ShardFormatError(f"{where}: dtype {dtype!r} is not one of {', '.join(SAFETENSORS_SIZES)}")
    shape_doc = t["shape"]
    if not isinstance(shape_doc, list) or len(shape_doc) > MAX_NDIM:
        raise ShardFormatError(f"{where}: shape must be a list of at most {MAX_NDIM} dimensions")
    shape = tuple(_int(n, f"{where} shape", hi=MAX_FRAME_BYTES) for n in shape_doc)
    frame = _int(t["frame"], f"{where} frame", hi=num_frames - 1)
    offset = _int(t["offset"], f"{where} offset", hi=MAX_FRAME_BYTES)
    size = _int(t["size"], f"{where} size", hi=MAX_FRAME_BYTES)
    expected = SAFETENSORS_SIZES[dtype] * _product(shape)
    if size != expected:
        raise ShardFormatError(f"{where}: size {size} != {dtype} x {list(shape)} = {expected} bytes")
    return TensorEntry(name, dtype, shape, group, frame, offset, size)


def _parse_source(doc: Any, groups: tuple[GroupEntry, ...]) -> tuple[tuple[SourceFile, ...], dict[str, Any] | None]:
    s = _obj(doc, "header source", {"index_metadata", "files"})
    index_metadata = s["index_metadata"]
    if index_metadata is not None:
        index_metadata = _obj(index_metadata, "header source index_metadata")
    files_doc = s["files"]
    if not isinstance(files_doc, list) or not files_doc:
        raise ShardFormatError("header source files must be a non-empty list")
    if len(files_doc) > 1 and index_metadata is None:
        raise ShardFormatError("header source lists several files but no index_metadata")
    unplaced = {t.name for g in groups for t in g.tensors}
    files, seen_names = [], set()
    for k, f_doc in enumerate(files_doc):
        f = _obj(f_doc, f"header source file {k}", {"name", "metadata", "tensors"})
        name = _file_name(f["name"], "source file")
        if not name.endswith(".safetensors") or name in seen_names:
            raise ShardFormatError(f"source file {name!r}: must end in .safetensors and be listed once")
        seen_names.add(name)
        metadata = f["metadata"]
        if metadata is not None:
            metadata = _obj(metadata, f"source file {name} metadata")
            if not all(isinstance(v, str) for v in metadata.values()):
                raise ShardFormatError(f"source file {name}: metadata values must be strings")
        tensors = f["tensors"]
        if not isinstance(tensors, list):
            raise ShardFormatError(f"source file {name}: tensors must be a list")
        for t in tensors:
            if not isinstance(t, str) or t not in unplaced:
                raise ShardFormatError(f"source file {name}: tensor {str(t)[:80]!r} is unknown or listed twice")
            unplaced.remove(t)
        files.append(SourceFile(name, metadata, tuple(tensors)))
    if unplaced:
        raise ShardFormatError(f"tensor {sorted(unplaced)[0]} is in no source file")
    return tuple(files), index_metadata


def _check_names_unique(groups: tuple[GroupEntry, ...]) -> None:
    seen: set[str] = set()
    for g in groups:
        for t in g.tensors:
            if t.name in seen:
                raise ShardFormatError(f"tensor {t.name} (group {g.name}) is listed twice")
            seen.add(t.name)


def _check_frames_disjoint(groups: tuple[GroupEntry, ...], data_start: int, file_size: int) -> None:
    spans = sorted((f.offset, f.end, f"group {g.name} frame {k}") for g in groups for k, f in enumerate(g.frames))
    prev_end, prev_label = data_start, "the header"
    for start, end, label in spans:
        if start < prev_end and end > start:
            raise ShardFormatError(f"{label}: stored bytes [{start}, {end}) overlap {prev_label}")
        if end >= prev_end:
            prev_end, prev_label = end, label
    if prev_end != file_size:
        raise ShardFormatError(f"file has {file_size - prev_end} bytes after the last frame ({prev_label})")


def _tiling_error(group: str, k: int, frame: FrameEntry, pos: int, nxt: TensorEntry | None) -> str:
    after = f"; next is tensor {nxt.name}" if nxt else ""
    return f"group {group} frame {k}: tensors cover {pos} of its {frame.size} bytes{after}"


# ---- typed JSON access -------------------------------------------------------------


def _obj(v: Any, where: str, required: set[str] | None = None, optional: set[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ShardFormatError(f"{where} must be a JSON object, got {type(v).__name__}")
    if required is not None:
        missing = required - v.keys()
        if missing:
            raise ShardFormatError(f"{where} lacks {sorted(missing)[0]!r}")
        extra = v.keys() - required - optional
        if extra:
            raise ShardFormatError(f"{where} has unknown key {sorted(extra)[0]!r}")
    return v


def _int(v: Any, where: str, *, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int:  # bool is an int subclass, and floats must not pass as sizes
        raise ShardFormatError(f"{where} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ShardFormatError(f"{where} = {v} is outside [{lo}, {hi}]")
    return v


def _file_name(v: Any, what: str) -> str:
    # These names become paths on unpack: no separators, no "..", no hidden files.
    if not isinstance(v, str) or not _FILE_NAME_RE.match(v) or ".." in v:
        raise ShardFormatError(f"{what} name {str(v)[:80]!r} is not a plain file name")
    return v


def _product(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return d


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
