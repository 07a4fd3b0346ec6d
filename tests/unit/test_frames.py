"""Frame decoding details that the format tests do not see: read-ahead and buffer reuse."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard

from weights_tool import frames as frames_module
from weights_tool.format import CODEC_ZSTD, FrameEntry, crc32
from weights_tool.frames import CHECK_LOAD, READ_CHUNK_BYTES, ReadAhead, open_frame

NUM_CHUNKS = 3


def _zstd_frame_file(tmp_path: Path) -> tuple[Path, FrameEntry, bytes]:
    """One incompressible zstd frame of about NUM_CHUNKS read chunks (stored blocks: each decodes on its own)."""
    content = np.random.default_rng(0).integers(0, 256, NUM_CHUNKS * READ_CHUNK_BYTES - 1000, dtype=np.uint8).tobytes()
    stored = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(content)
    path = tmp_path / "frame.bin"
    path.write_bytes(b"\0" * 100 + stored)
    return path, FrameEntry(100, len(stored), len(content), CODEC_ZSTD, crc32(stored)), content


def test_next_chunk_is_read_while_the_first_is_decoded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, frame, content = _zstd_frame_file(tmp_path)
    reads: list[tuple[int, str]] = []
    real_preadv = os.preadv

    def preadv(fd: int, buffers: list, offset: int) -> int:
        reads.append((offset - frame.offset, threading.current_thread().name))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(frames_module.os, "preadv", preadv)
    read_ahead = ReadAhead(2)
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = open_frame(fd, frame, "frame", check=CHECK_LOAD, read_ahead=read_ahead)
        out = np.empty(frame.size, dtype=np.uint8)
        assert reader.readinto(out[:1]) == 1  # needs only chunk 0
        deadline = time.monotonic() + 5
        while len(reads) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Chunk 1 was asked for before the decoder wanted it, and not on the decoding thread.
        assert [pos for pos, _ in reads[:2]] == [0, READ_CHUNK_BYTES]
        assert reads[1][1].startswith("zqs-read-ahead")
        reader.readinto(out[1:])
        reader.finish()
        assert out.tobytes() == content
    finally:
        read_ahead.shutdown()
        os.close(fd)


def test_chunk_buffers_are_reused_across_frames(tmp_path: Path) -> None:
    path, frame, content = _zstd_frame_file(tmp_path)
    read_ahead = ReadAhead(2)
    fd = os.open(path, os.O_RDONLY)
    seen: set[int] = set()
    try:
        for _ in range(3):
            reader = open_frame(fd, frame, "frame", check=CHECK_LOAD, read_ahead=read_ahead)
            out = np.empty(frame.size, dtype=np.uint8)
            reader.readinto(out)
            reader.finish()
            assert out.tobytes() == content
            seen.update(id(b) for b in read_ahead._free)
        assert len(seen) == 2  # two alternating buffers, handed back after each frame
    finally:
        read_ahead.shutdown()
        os.close(fd)


def test_abandoned_frame_waits_out_its_read_before_reusing_the_buffer(tmp_path: Path) -> None:
    path, frame, content = _zstd_frame_file(tmp_path)
    read_ahead = ReadAhead(2)
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = open_frame(fd, frame, "frame", check=CHECK_LOAD, read_ahead=read_ahead)
        reader.readinto(np.empty(10, dtype=np.uint8))
        reader.close()  # mid-frame: the read in flight finishes before its buffer is free again
        again = open_frame(fd, frame, "frame", check=CHECK_LOAD, read_ahead=read_ahead)
        out = np.empty(frame.size, dtype=np.uint8)
        again.readinto(out)
        again.finish()
        assert out.tobytes() == content
    finally:
        read_ahead.shutdown()
        os.close(fd)
