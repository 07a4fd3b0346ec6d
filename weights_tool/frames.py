"""Decoding one `.zqs` frame: its logical bytes, in order, straight into the caller's buffer.

`open_frame(fd, frame, label, check, read_ahead)` returns a reader whose `readinto(out)`
never writes more than asked or declared, and whose `finish()` raises `ShardFormatError`
(naming the frame) unless the frame decoded to exactly its declared size and passed its
checks. What is checked (`check`):

- `CHECK_ALL`: CRC-32 of the stored bytes of every frame, and libzstd's XXH64 content
  checksum of zstd frames (what `ShardReader.verify` does).
- `CHECK_LOAD` (loads with verification on): raw frames by CRC-32; zstd frames by their
  XXH64 content checksum, which libzstd checks as the frame ends and which covers every
  decoded byte, so a CRC-32 of the compressed bytes on top only costs CPU
  (benchmarks/results/loader.md gives zlib.crc32's rate beside the decoder's). A zstd
  frame without a content checksum gets the CRC-32.
- `CHECK_NONE`: no CRC-32 (a trusted local copy); sizes and bounds are still enforced and
  libzstd still checks the content checksums it finds.

zstd frames read their stored bytes one chunk ahead on `read_ahead` (a `ReadAhead`), so
a thread decodes chunk k while chunk k+1 is on its way: on slow storage the read and the
decode overlap instead of adding up.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import zstandard

from weights_tool.byte_group import byte_ungroup
from weights_tool.format import (
    CODEC_BYTEGROUP,
    CODEC_RAW,
    FrameEntry,
    GroupEntry,
    ShardFormatError,
    crc32,
)

MAX_WINDOW_BYTES = 1 << 27  # zstd's own default decoder limit, made explicit: bounds decoder memory
READ_CHUNK_BYTES = 4 << 20  # compressed bytes per pread; also how often a read checks for cancel
ZSTD_HEADER_BYTES = 18  # the longest zstd frame header

CHECK_NONE = "none"
CHECK_LOAD = "load"
CHECK_ALL = "all"


def frame_label(group: GroupEntry, k: int) -> str:
    names = [t.name for t in group.tensors if t.frame == k]
    held = f"{names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "") if names else "no tensors"
    return f"group {group.name} frame {k} ({held})"


def open_frame(
    fd: int, frame: FrameEntry, label: str, *, check: str = CHECK_LOAD, read_ahead: ReadAhead | None = None
) -> FrameReader:
    if frame.codec == CODEC_RAW:
        return RawFrame(fd, frame, label, check)
    if frame.codec == CODEC_BYTEGROUP:
        return ByteGroupFrame(fd, frame, label, check, read_ahead)
    return ZstdFrame(fd, frame, label, check, read_ahead)


class FrameReader:
    """A frame's decompressed bytes in order. `readinto` never returns more than asked or declared."""

    def __init__(self, fd: int, frame: FrameEntry, label: str) -> None:
        self.fd, self.frame, self.label = fd, frame, label
        self.pos = 0

    def readinto(self, out: np.ndarray) -> int:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what an abandoned frame holds (a read in flight); finish() does it too."""

    def error(self, what: str) -> ShardFormatError:
        return ShardFormatError(f"{self.label}: {what}")

    def check_crc(self, computed: int) -> None:
        if computed != self.frame.crc32:
            raise self.error(f"checksum mismatch (stored {self.frame.crc32:#010x}, computed {computed:#010x})")


class RawFrame(FrameReader):
    """Stored bytes are the logical bytes: `preadv` straight into the destination."""

    def __init__(self, fd: int, frame: FrameEntry, label: str, check: str) -> None:
        super().__init__(fd, frame, label)
        self._is_crc = check != CHECK_NONE
        self._crc = 0

    def readinto(self, out: np.ndarray) -> int:
        n = min(len(out), self.frame.size - self.pos)
        view = memoryview(out)[:n]
        got = 0
        while got < n:  # a short read means the file shrank under us
            k = os.preadv(self.fd, [view[got:]], self.frame.offset + self.pos + got)
            if k == 0:
                raise self.error(f"file ends inside the frame (at byte {self.pos + got} of {self.frame.size}): truncated")
            got += k
        if self._is_crc:
            self._crc = crc32(view, self._crc)
        self.pos += n
        return n

    def finish(self) -> None:
        if self.pos != self.frame.size:
            raise self.error(f"read {self.pos} of {self.frame.size} bytes")
        if self._is_crc:
            self.check_crc(self._crc)


class ReadAhead:
    """Threads that read compressed chunks ahead of the decoders, and the chunk buffers they fill.

    Buffers are reused across frames: a fresh 4 MiB buffer per read would cost a page
    fault per 4 KiB (loader.md's machine limits: memcpy into fresh memory runs at a
    fraction of its rate into prefaulted memory).
    """

    def __init__(self, max_threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="zqs-read-ahead")
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._pool.submit(fn, *args)

    def take_buffer(self) -> bytearray:
        with self._lock:
            return self._free.pop() if self._free else bytearray(READ_CHUNK_BYTES)

    def give_buffer(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)

    def shutdown(self) -> None:
        """Wait for the reads in flight (so none meets a closed, reused fd) and drop the buffers."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._free.clear()


class StoredBytes:
    """The stored bytes of one frame as a file-like source for zstd, one chunk read ahead.

    zstd asks for chunk k+1 only once it has consumed chunk k, so two buffers alternate:
    chunk k+1 is read into the one chunk k-1 used while zstd decodes chunk k. The CRC-32,
    when wanted, is chained in the read job (job k+1 starts after job k finished, so its
    running value is known) and costs the decoding thread nothing.
    """

    def __init__(self, fd: int, frame: FrameEntry, label: str, is_crc: bool, read_ahead: ReadAhead | None) -> None:
        self.fd, self.frame, self.label, self.is_crc = fd, frame, label, is_crc
        self.pos = 0  # stored bytes handed to zstd so far
        self.crc = 0
        self._read_ahead = read_ahead
        self._buffers: list[bytearray] = []
        self._turn = 0
        self._next: Future[tuple[memoryview, int]] | None = None

    def read(self, n: int = -1) -> memoryview:
        n = READ_CHUNK_BYTES if n < 0 else min(n, READ_CHUNK_BYTES)
        if self._next is not None:
            view, self.crc = self._next.result()
            self._next = None
        else:
            view, self.crc = self._fetch(self._buffer(self._turn), self.pos, n, self.crc)
        self.pos += len(view)
        self._turn ^= 1
        if self._read_ahead is not None and self.pos < self.frame.stored_size:
            self._next = self._read_ahead.submit(self._fetch, self._buffer(self._turn), self.pos, n, self.crc)
        return view

    def close(self) -> None:
        """Wait out a read still in flight (its bytes are dropped), then hand the buffers back."""
        if self._next is not None:
            if not self._next.cancel():
                self._next.exception()
            self._next = None
        if self._read_ahead is not None:
            for buf in self._buffers:
                self._read_ahead.give_buffer(buf)
        self._buffers = []

    def _buffer(self, k: int) -> bytearray:
        while len(self._buffers) <= k:
            ra = self._read_ahead
            self._buffers.append(ra.take_buffer() if ra is not None else bytearray(READ_CHUNK_BYTES))
        return self._buffers[k]

    def _fetch(self, buf: bytearray, pos: int, n: int, crc: int) -> tuple[memoryview, int]:
        n = min(n, self.frame.stored_size - pos)
        view = memoryview(buf)[: max(n, 0)]
        got = 0
        while got < n:
            k = os.preadv(self.fd, [view[got:]], self.frame.offset + pos + got)
            if k == 0:
                raise ShardFormatError(f"{self.label}: file ends inside the frame's stored bytes: truncated")
            got += k
        return view, crc32(view, crc) if self.is_crc else crc


class ZstdFrame(FrameReader):
    def __init__(self, fd: int, frame: FrameEntry, label: str, check: str, read_ahead: ReadAhead | None) -> None:
        super().__init__(fd, frame, label)
        has_checksum = self._check_header()
        is_crc = check == CHECK_ALL or (check == CHECK_LOAD and not has_checksum)
        self._source = StoredBytes(fd, frame, label, is_crc, read_ahead)
        # read_across_frames: a second zstd frame hidden behind the first must count
        # towards the declared size (it is how a crafted frame would smuggle in more bytes).
        self._zstd = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES).stream_reader(
            self._source, read_size=READ_CHUNK_BYTES, read_across_frames=True, closefd=False
        )

    def _check_header(self) -> bool:
        """Refuse a content size other than declared; True when the frame carries a content checksum."""
        head = os.pread(self.fd, min(ZSTD_HEADER_BYTES, self.frame.stored_size), self.frame.offset)
        try:
            params = zstandard.get_frame_parameters(head)
        except zstandard.ZstdError:
            return False  # not decodable as a header; the decoder will say so with context
        if params.content_size != zstandard.CONTENTSIZE_UNKNOWN and params.content_size != self.frame.size:
            raise self.error(f"zstd frame declares {params.content_size} bytes of content; "
                             f"the header declares {self.frame.size}")
        return bool(params.has_checksum)

    def readinto(self, out: np.ndarray) -> int:
        n = min(len(out), self.frame.size - self.pos)
        view = memoryview(out)[:n]
        got = 0
        while got < n:
            k = self._decode(view[got:])
            if k == 0:
                raise self.error(f"decompresses to {self.pos + got} bytes, fewer than the declared {self.frame.size}")
            got += k
        self.pos += n
        return n

    def finish(self) -> None:
        try:
            if self.pos != self.frame.size:
                raise self.error(f"read {self.pos} of {self.frame.size} bytes")
            # One byte more than declared is a bomb (or a corrupt frame); asking for one is bounded.
            if self._decode(memoryview(bytearray(1))):
                raise self.error(f"decompresses to more than the declared {self.frame.size} bytes")
            if self._source.pos != self.frame.stored_size:
                raise self.error(f"zstd stopped after {self._source.pos} of {self.frame.stored_size} stored bytes")
            if self._source.is_crc:
                self.check_crc(self._source.crc)
        finally:
            self._source.close()

    def close(self) -> None:
        self._source.close()

    def _decode(self, view: memoryview) -> int:
        try:
            return self._zstd.readinto(view)
        except zstandard.ZstdError as e:
            self._source.close()
            raise self.error(f"corrupt zstd data ({e})") from None


class ByteGroupFrame(FrameReader):
    """zstd over blocks whose bytes are grouped by position in the element; see weights_tool.byte_group."""

    def __init__(self, fd: int, frame: FrameEntry, label: str, check: str, read_ahead: ReadAhead | None) -> None:
        super().__init__(fd, frame, label)
        self._planes = ZstdFrame(fd, frame, label, check, read_ahead)
        self._scratch = np.empty(min(frame.block_size, frame.size), dtype=np.uint8)
        self._block = np.empty(0, dtype=np.uint8)  # the decoded block `out` did not fully take
        self._block_pos = 0

    def readinto(self, out: np.ndarray) -> int:
        n = min(len(out), self.frame.size - self.pos)
        written = 0
        while written < n:
            if self._block_pos < len(self._block):
                k = min(n - written, len(self._block) - self._block_pos)
                out[written : written + k] = self._block[self._block_pos : self._block_pos + k]
                self._block_pos += k
                written += k
                continue
            block_len = min(self.frame.block_size, self.frame.size - (self.pos + written))
            planes = self._scratch[:block_len]
            self._planes.readinto(planes)
            if n - written >= block_len:  # the whole block fits: interleave straight into `out`
                byte_ungroup(planes, out[written : written + block_len], self.frame.element_size)
                written += block_len
            else:
                self._block = np.empty(block_len, dtype=np.uint8) if len(self._block) != block_len else self._block
                byte_ungroup(planes, self._block, self.frame.element_size)
                self._block_pos = 0
        self.pos += n
        return n

    def finish(self) -> None:
        if self.pos != self.frame.size:
            raise self.error(f"read {self.pos} of {self.frame.size} bytes")
        self._planes.finish()

    def close(self) -> None:
        self._planes.close()
