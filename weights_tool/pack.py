"""HF safetensors checkpoint directory -> `.zqs` shard file (the way back is `weights_tool.unpack`).

`pack` reads tensor bytes straight from the safetensors files by their header offsets
(memory-mapped, so bf16 stays bit-exact and nothing is converted), groups them by layer,
compresses each group's frames on a thread pool and writes the file atomically (tmp +
rename).

Codec choice, per tensor then per frame: a float tensor is byte-grouped when a sample
of it compresses at least 3% smaller that way; a frame whose compression saves under 2%
is stored raw (decoding it would only cost).

The embedding table is stored raw by default (`raw_embeddings`): a cold actor then reads
just its prompt's rows before layer 0 instead of decoding the whole table first, and
loads the rest after the decoder layers (actors/layer_loader.py). It costs the table's
compression saving in file size.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zstandard
from tqdm import tqdm

from weights_tool.architecture import ModelConfig
from weights_tool.byte_group import byte_group
from weights_tool.checkpoint import Checkpoint, CheckpointTensor, read_checkpoint
from weights_tool.dtypes import SAFETENSORS_FLOATS, SAFETENSORS_SIZES
from weights_tool.format import (
    CODEC_BYTEGROUP,
    CODEC_RAW,
    CODEC_ZSTD,
    DEFAULT_BLOCK_BYTES,
    FRAME_ALIGN,
    PREAMBLE,
    FrameEntry,
    GroupEntry,
    Header,
    SourceFile,
    TensorEntry,
    crc32,
    encode_header,
    encode_preamble,
)
from weights_tool.groups import EMBED, group_names, group_of

log = logging.getLogger(__name__)

# Measured on normal(0, 0.02) bf16 weights (docs/zqs-format.md): level 1 byte-grouped
# compresses better (1.46x) than level 3 (1.40x) and twice as fast; zstd's LZ search
# finds nothing in mantissas, so higher levels only cost.
DEFAULT_LEVEL = 1
DEFAULT_MAX_FRAME_BYTES = 64 << 20
_SAMPLE_BYTES = DEFAULT_BLOCK_BYTES  # one transposed block, as the frame will see it
_BYTEGROUP_MIN_GAIN = 0.97
_RAW_IF_SAVING_BELOW = 0.02


@dataclass(frozen=True)
class _FramePlan:
    codec: str  # CODEC_RAW, CODEC_ZSTD or CODEC_BYTEGROUP (may fall back to raw after compressing)
    element_size: int
    tensors: tuple[CheckpointTensor, ...]

    @property
    def size(self) -> int:
        return sum(t.size for t in self.tensors)


# ---- pack --------------------------------------------------------------------------


def pack(
    hf_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    level: int = DEFAULT_LEVEL,
    threads: int = 2,
    byte_group: bool | str = True,
    codec: str = CODEC_ZSTD,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    raw_embeddings: bool = True,
    progress: bool = False,
) -> Path:
    """Pack an HF safetensors checkpoint directory into `out_path`; returns `out_path`.

    `level=0` or `codec="raw"` stores every frame raw. `byte_group`: True groups float
    tensors where a sample shows it pays, "always" wherever the dtype allows, False never.
    `raw_embeddings`: store the embedding group raw, so its rows can be read one by one.
    """
    if codec not in (CODEC_ZSTD, CODEC_RAW):
        raise ValueError(f"codec must be {CODEC_ZSTD!r} or {CODEC_RAW!r}, got {codec!r}")
    if byte_group not in (True, False, "always"):
        raise ValueError(f"byte_group must be True, False or 'always', got {byte_group!r}")
    if not -7 <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise ValueError(f"level {level} outside -7..{zstandard.MAX_COMPRESSION_LEVEL}")
    if threads < 1 or max_frame_bytes < 1:
        raise ValueError("threads and max_frame_bytes must be positive")
    codec = CODEC_RAW if level == 0 else codec
    out = Path(out_path)
    ckpt = read_checkpoint(hf_dir)
    model = ModelConfig.from_hf(ckpt.config)
    model.check_tensors({n: t.shape for n, t in ckpt.weights.tensors.items()})
    views = ckpt.weights.tensor_bytes()

    plans = _plan_frames(ckpt, model, views, codec, byte_group, level, max_frame_bytes, raw_embeddings)
    packer = {"tool": "zeroqueue weights_tool", "level": level, "codec": codec, "byte_group": byte_group,
              "raw_embeddings": raw_embeddings}
    reserve = len(_worst_case_header(ckpt, model.num_layers, plans, packer))
    data_start = _align(PREAMBLE.size + reserve)
    total = sum(p.size for frames in plans.values() for p in frames)
    log.info("packing %s: %d tensors, %.1f MiB, codec %s level %d", hf_dir, len(views), total / 2**20, codec, level)

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f, ThreadPoolExecutor(threads) as pool, tqdm(
            total=total, unit="B", unit_scale=True, desc="pack", disable=None if progress else True
        ) as bar:
            pos, groups = data_start, []
            for name, frame_plans in plans.items():
                frames, tensors = [], []
                encoded = pool.map(lambda p: _encode(p, views, level), frame_plans)
                for k, (plan, (frame_codec, chunks)) in enumerate(zip(frame_plans, encoded, strict=True)):
                    pos = _align(pos)
                    f.seek(pos)
                    stored, crc = 0, 0
                    for chunk in chunks:
                        f.write(chunk)
                        stored += memoryview(chunk).nbytes
                        crc = crc32(chunk, crc)
                    is_grouped = frame_codec == CODEC_BYTEGROUP
                    frames.append(FrameEntry(pos, stored, plan.size, frame_codec, crc,
                                             plan.element_size if is_grouped else 0,
                                             DEFAULT_BLOCK_BYTES if is_grouped else 0))
                    offset = 0
                    for t in plan.tensors:
                        tensors.append(TensorEntry(t.name, t.dtype, t.shape, name, k, offset, t.size))
                        offset += t.size
                    pos += stored
                    bar.update(plan.size)
                groups.append(GroupEntry(name, tuple(frames), tuple(tensors)))
            header = _header(ckpt, model.num_layers, tuple(groups), packer)
            raw_header = encode_header(header)
            if PREAMBLE.size + len(raw_header) > data_start:
                raise AssertionError("header outgrew its reserved space")  # _worst_case_header is wrong
            f.seek(0)
            f.write(encode_preamble(raw_header))
            f.write(raw_header)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("wrote %s (%.1f MiB)", out, out.stat().st_size / 2**20)
    return out


def _plan_frames(
    ckpt: Checkpoint, model: ModelConfig, views: dict[str, np.ndarray], codec: str, byte_group: bool | str,
    level: int, max_frame_bytes: int, raw_embeddings: bool,
) -> dict[str, list[_FramePlan]]:
    """Per group, in load order: frames of tensors that share a codec, each at most max_frame_bytes
    (a bigger tensor gets a frame of its own)."""
    expected = list(model.tensor_shapes())
    order = expected + sorted(set(ckpt.weights.tensors) - set(expected))
    members: dict[str, list[CheckpointTensor]] = {g: [] for g in group_names(model.num_layers)}
    for name in order:
        if name in ckpt.weights.tensors:  # a tied model's lm_head may be absent
            members[group_of(name)].append(ckpt.weights.tensors[name])
    plans: dict[str, list[_FramePlan]] = {}
    for g, tensors in members.items():
        buckets: dict[tuple[str, int], list[CheckpointTensor]] = {}
        group_codec = CODEC_RAW if raw_embeddings and g == EMBED else codec
        widths = _byte_grouped_widths(tensors, views, group_codec, byte_group, level)
        for t in tensors:
            width = SAFETENSORS_SIZES[t.dtype]
            key = (CODEC_BYTEGROUP, width) if t.dtype in SAFETENSORS_FLOATS and width in widths else (group_codec, 0)
            buckets.setdefault(key, []).append(t)
        plans[g] = [p for (c, width), ts in buckets.items() for p in _split_frames(c, width, ts, max_frame_bytes)]
    return plans


def _byte_grouped_widths(
    tensors: list[CheckpointTensor], views: dict[str, np.ndarray], codec: str, byte_group: bool | str, level: int
) -> set[int]:
    """Element widths whose float tensors in this group get byte-grouped.

    Decided per width on the group's largest tensor of that width: Huffman coding ignores
    byte order, so grouping only pays once a plane fills whole zstd blocks (128 KiB), which
    small tensors never do alone; in a frame they share blocks with the big ones.
    """
    if codec != CODEC_ZSTD or not byte_group:
        return set()
    largest: dict[int, CheckpointTensor] = {}
    for t in tensors:
        width = SAFETENSORS_SIZES[t.dtype]
        if t.dtype in SAFETENSORS_FLOATS and (width not in largest or t.size > largest[width].size):
            largest[width] = t
    if byte_group == "always":
        return set(largest)
    return {w for w, t in largest.items() if _byte_grouping_pays(views[t.name], w, level)}


def _split_frames(codec: str, width: int, tensors: list[CheckpointTensor], max_frame_bytes: int) -> list[_FramePlan]:
    frames: list[_FramePlan] = []
    current: list[CheckpointTensor] = []
    current_bytes = 0
    for t in tensors:
        if current and current_bytes + t.size > max_frame_bytes:
            frames.append(_FramePlan(codec, width, tuple(current)))
            current, current_bytes = [], 0
        current.append(t)
        current_bytes += t.size
    frames.append(_FramePlan(codec, width, tuple(current)))
    return frames


def _byte_grouping_pays(view: np.ndarray, width: int, level: int) -> bool:
    n = min(len(view), _SAMPLE_BYTES) // width * width
    if n == 0:
        return False
    start = (len(view) - n) // 2 // width * width
    sample = np.ascontiguousarray(view[start : start + n])
    cctx = zstandard.ZstdCompressor(level=level)
    plain = len(cctx.compress(sample))
    grouped = len(cctx.compress(byte_group(sample, width, DEFAULT_BLOCK_BYTES)))
    return grouped < plain * _BYTEGROUP_MIN_GAIN


def _encode(plan: _FramePlan, views: dict[str, np.ndarray], level: int) -> tuple[str, list[Any]]:
    """(codec, stored chunks) for one frame; falls back to raw when compression does not pay."""
    raw = [views[t.name] for t in plan.tensors]
    if plan.codec == CODEC_RAW:
        return CODEC_RAW, raw
    cobj = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True).compressobj(
        size=plan.size
    )
    if plan.codec == CODEC_BYTEGROUP:
        pieces: Iterator[Any] = (
            byte_group(b, plan.element_size, DEFAULT_BLOCK_BYTES) for b in _blocks(raw, DEFAULT_BLOCK_BYTES)
        )
    else:
        pieces = iter(raw)
    chunks = [cobj.compress(p) for p in pieces]
    chunks.append(cobj.flush())
    if sum(len(c) for c in chunks) > plan.size * (1 - _RAW_IF_SAVING_BELOW):
        return CODEC_RAW, raw
    return plan.codec, chunks


def _blocks(views: list[np.ndarray], block: int) -> Iterator[np.ndarray]:
    """The concatenation of `views` in pieces of exactly `block` bytes (the last may be short)."""
    pending: list[np.ndarray] = []
    num_pending = 0
    for v in views:
        pos = 0
        while pos < len(v):
            if not pending and len(v) - pos >= block:
                yield v[pos : pos + block]
                pos += block
                continue
            take = min(block - num_pending, len(v) - pos)
            pending.append(v[pos : pos + take])
            num_pending += take
            pos += take
            if num_pending == block:
                yield np.concatenate(pending)
                pending, num_pending = [], 0
    if pending:
        yield np.concatenate(pending)


def _worst_case_header(
    ckpt: Checkpoint, num_layers: int, plans: dict[str, list[_FramePlan]], packer: dict[str, Any]
) -> bytes:
    """The header with every number at its widest, to reserve its space before the frames are written."""
    big, crc = 2**63 - 1, 2**32 - 1
    groups = []
    for name, frame_plans in plans.items():
        frames = tuple(FrameEntry(big, big, big, p.codec, crc, p.element_size, big) for p in frame_plans)
        tensors = tuple(TensorEntry(t.name, t.dtype, t.shape, name, big, big, big)
                        for p in frame_plans for t in p.tensors)
        groups.append(GroupEntry(name, frames, tensors))
    return encode_header(_header(ckpt, num_layers, tuple(groups), packer))


def _header(ckpt: Checkpoint, num_layers: int, groups: tuple[GroupEntry, ...], packer: dict[str, Any]) -> Header:
    source_files = tuple(SourceFile(f.path.name, f.metadata, f.tensors) for f in ckpt.weights.files)
    return Header(num_layers, ckpt.config, ckpt.tokenizer_files, source_files, ckpt.weights.index_metadata,
                  groups, packer)


def _align(n: int) -> int:
    return -(-n // FRAME_ALIGN) * FRAME_ALIGN
