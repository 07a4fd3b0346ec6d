"""The `.zqs` shard file: the one definition of its byte layout (docs/zqs-format.md explains it).

    offset 0   preamble, 24 bytes, little-endian:
               magic (8) "\\x89ZQS\\r\\n\\x1a\\n" | version u32 | header crc32 u32 | header size u64
    offset 24  header: UTF-8 JSON, at most MAX_HEADER_BYTES
               then zero padding up to the first frame
    frames     one or more independent frames per group, at absolute offsets the header gives

Groups, in file and load order, are `embed`, `layer.0` .. `layer.{L-1}`, `final`; which
tensor is in which is `weights_tool.groups`. A frame's decompressed bytes are its tensors'
bytes back to back; a group's tensors are listed in that stream order, so a group decodes
front to back into its tensors.

Everything in a header is untrusted: `weights_tool.header.parse_header` checks every type,
length and offset against the file before a reader uses it, and raises `ShardFormatError`
naming the group, frame or tensor at fault. Only json, struct and zlib are used here; the
bytegroup transform itself is in `weights_tool.byte_group`.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

MAGIC = b"\x89ZQS\r\n\x1a\n"  # PNG-style: a high byte, then line endings that text-mode copies mangle
VERSION = 1
PREAMBLE = struct.Struct("<8sIIQ")  # magic, version, header crc32, header size
MAX_HEADER_BYTES = 64 << 20
MAX_FRAME_BYTES = 1 << 40  # decompressed; far above any real tensor, far below int overflow
MAX_BLOCK_BYTES = 64 << 20
MAX_NDIM = 8
MAX_NAME_CHARS = 512
FRAME_ALIGN = 4096  # the writer's choice; readers accept any offset

CODEC_RAW = "raw"
CODEC_ZSTD = "zstd"
CODEC_BYTEGROUP = "zstd-bytegroup"
CODECS = (CODEC_RAW, CODEC_ZSTD, CODEC_BYTEGROUP)
BYTEGROUP_ELEMENT_SIZES = (2, 4, 8)
DEFAULT_BLOCK_BYTES = 1 << 20


class ShardFormatError(ValueError):
    """A `.zqs` file that is not what it claims; the message names the group, frame or tensor."""


@dataclass(frozen=True)
class FrameEntry:
    offset: int  # absolute file offset of the stored bytes
    stored_size: int  # bytes on disk
    size: int  # decompressed bytes, declared and enforced
    codec: str
    crc32: int  # of the stored bytes
    element_size: int = 0  # zstd-bytegroup only: bytes per element (2 for bf16/fp16)
    block_size: int = 0  # zstd-bytegroup only: logical bytes per transposed block

    @property
    def end(self) -> int:
        return self.offset + self.stored_size


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors' name: "BF16", "F32", ...
    shape: tuple[int, ...]
    group: str
    frame: int  # index into its group's frames
    offset: int  # inside the frame's decompressed bytes
    size: int


@dataclass(frozen=True)
class GroupEntry:
    name: str
    frames: tuple[FrameEntry, ...]
    tensors: tuple[TensorEntry, ...]  # in stream order: by frame, then by offset

    @property
    def size(self) -> int:
        return sum(f.size for f in self.frames)

    @property
    def stored_size(self) -> int:
        return sum(f.stored_size for f in self.frames)


@dataclass(frozen=True)
class SourceFile:
    """One safetensors file of the packed checkpoint, so unpack can rebuild the same layout."""

    name: str
    metadata: dict[str, str] | None  # its `__metadata__`, as found
    tensors: tuple[str, ...]  # in the file's data order


@dataclass(frozen=True)
class Header:
    num_layers: int
    config: dict[str, Any]
    tokenizer_files: dict[str, str]
    source_files: tuple[SourceFile, ...]
    index_metadata: dict[str, Any] | None  # None: the checkpoint had no model.safetensors.index.json
    groups: tuple[GroupEntry, ...]
    packer: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "config": self.config,
            "tokenizer_files": self.tokenizer_files,
            "source": {
                "index_metadata": self.index_metadata,
                "files": [{"name": f.name, "metadata": f.metadata, "tensors": list(f.tensors)}
                          for f in self.source_files],
            },
            "groups": [{"name": g.name, "frames": [_frame_json(f) for f in g.frames],
                        "tensors": [_tensor_json(t) for t in g.tensors]} for g in self.groups],
            "packer": self.packer,
        }


# ---- bytes ------------------------------------------------------------------------


def crc32(data: Any, value: int = 0) -> int:
    return zlib.crc32(data, value) & 0xFFFFFFFF


def encode_preamble(header_bytes: bytes) -> bytes:
    return PREAMBLE.pack(MAGIC, VERSION, crc32(header_bytes), len(header_bytes))


def encode_header(header: Header) -> bytes:
    return json.dumps(header.to_json(), ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def decode_preamble(raw: bytes, file_size: int) -> tuple[int, int]:
    """(header size, header crc32) from the first PREAMBLE.size bytes, checked against the file size."""
    if len(raw) < PREAMBLE.size:
        raise ShardFormatError(
            f"file is {file_size} bytes, shorter than the {PREAMBLE.size}-byte preamble: "
            f"truncated or not a .zqs file{_guess_kind(raw)}"
        )
    magic, version, header_crc, header_size = PREAMBLE.unpack(raw[: PREAMBLE.size])
    if magic != MAGIC:
        raise ShardFormatError(f"not a .zqs file: bad magic {magic!r}{_guess_kind(raw)}")
    if version != VERSION:
        raise ShardFormatError(f"unsupported .zqs version {version}; this reader reads version {VERSION}")
    if header_size > MAX_HEADER_BYTES:
        raise ShardFormatError(f"header size {header_size} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if PREAMBLE.size + header_size > file_size:
        raise ShardFormatError(
            f"header ({header_size} bytes) runs past the end of the file ({file_size} bytes): truncated"
        )
    return header_size, header_crc


def _guess_kind(raw: bytes) -> str:
    if raw[:1] == b"\x80":
        return " (this looks like a pickle; pickles are never loaded)"
    if raw[:4] == b"PK\x03\x04":
        return " (this looks like a zip archive, e.g. a torch.save file; those are never loaded)"
    if raw[8:9] == b"{":
        return " (this looks like a safetensors file; pack its checkpoint directory first)"
    return ""


def _frame_json(f: FrameEntry) -> dict[str, Any]:
    d: dict[str, Any] = {"offset": f.offset, "stored_size": f.stored_size, "size": f.size,
                         "codec": f.codec, "crc32": f.crc32}
    if f.codec == CODEC_BYTEGROUP:
        d.update(element_size=f.element_size, block_size=f.block_size)
    return d


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    return {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "frame": t.frame,
            "offset": t.offset, "size": t.size}
