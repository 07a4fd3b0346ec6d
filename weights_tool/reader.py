"""Reading a `.zqs` shard file: validate the header up front, then decode any group on its own.

`ShardReader(path)` reads and checks the preamble and header and touches no frame.
`read_group` / `read_layer` decode one group straight into caller-owned buffers: raw
frames are read with `os.preadv` into the destination, zstd frames stream through
`stream_reader.readinto` into it, byte-grouped frames decode one block (1 MiB by default)
at a time and interleave into it. Memory beyond the destinations is a few blocks.

All reads are `pread`s on one file descriptor, so any number of threads may read
different groups at once (zstd, zlib.crc32 and numpy copies release the GIL).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from weights_tool.format import (
    CODEC_BYTEGROUP,
    CODEC_RAW,
    PREAMBLE,
    FrameEntry,
    GroupEntry,
    Header,
    ShardFormatError,
    TensorEntry,
    byte_ungroup,
    crc32,
    decode_preamble,
    group_name,
    parse_header,
)

log = logging.getLogger(__name__)

MAX_WINDOW_BYTES = 1 << 27  # zstd's own default decoder limit, made explicit: bounds decoder memory
READ_CHUNK_BYTES = 4 << 20  # compressed bytes per pread; also how often a read checks for cancel


class ReadCancelled(Exception):
    """`read_group` stopped because its cancel event was set."""


class ShardReader:
    """An open, validated `.zqs` file. Thread-safe for reads; close it after every reader thread is done."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self.file_size = os.fstat(self._fd).st_size
            preamble = os.pread(self._fd, PREAMBLE.size, 0)
            header_size, header_crc = decode_preamble(preamble, self.file_size)
            raw = _pread_exact(self._fd, header_size, PREAMBLE.size, "header")
            self.header: Header = parse_header(raw, header_crc, file_size=self.file_size)
        except BaseException:
            os.close(self._fd)
            raise
        self._groups = {g.name: g for g in self.header.groups}
        self.tensors: dict[str, TensorEntry] = {t.name: t for g in self.header.groups for t in g.tensors}

    # ---- header ---------------------------------------------------------------------

    @property
    def config(self) -> dict[str, Any]:
        return self.header.config

    @property
    def tokenizer_files(self) -> dict[str, str]:
        return self.header.tokenizer_files

    @property
    def num_layers(self) -> int:
        return self.header.num_layers

    @property
    def groups(self) -> tuple[GroupEntry, ...]:
        return self.header.groups

    def group(self, name: str) -> GroupEntry:
        try:
            return self._groups[name]
        except KeyError:
            raise KeyError(f"{self.path} has no group {name!r}; groups are embed, layer.0..layer.{self.num_layers - 1}, final") from None

    # ---- reading --------------------------------------------------------------------

    def read_layer(
        self, i: int, into: Mapping[str, Any] | None = None, *, verify: bool = True
    ) -> dict[str, np.ndarray]:
        """Decoder layer i (group `layer.{i}`); see read_group."""
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} outside 0..{self.num_layers - 1}")
        return self.read_group(f"layer.{i}", into, verify=verify)

    def read_index(
        self, index: int, into: Mapping[str, Any] | None = None, *, verify: bool = True
    ) -> dict[str, np.ndarray]:
        """By the runtime's numbering: -1 embeddings, 0..L-1 layers, L final norm + lm_head."""
        return self.read_group(group_name(index, self.num_layers), into, verify=verify)

    def read_group(
        self,
        name: str,
        into: Mapping[str, Any] | None = None,
        *,
        verify: bool = True,
        cancel: threading.Event | None = None,
    ) -> dict[str, np.ndarray]:
        """Decode every tensor of group `name`; returns name -> flat uint8 view of its bytes.

        `into` maps tensor names to writable, C-contiguous buffers of exactly the tensor's
        byte size (numpy arrays of any dtype, or uint8 views such as
        `t.view(torch.uint8).numpy()`); names not in this group are ignored. Without
        `into`, fresh arrays are allocated. A failure raises ShardFormatError naming the
        group and frame; the destinations then hold partial bytes.
        """
        group = self.group(name)
        dests = self.destinations(group, into)
        stream = GroupStream(self, group, verify=verify)
        for t in group.tensors:
            view = dests[t.name]
            pos = 0
            while pos < t.size:
                if cancel is not None and cancel.is_set():
                    raise ReadCancelled(f"reading group {name} was cancelled")
                n = stream.readinto(view[pos : pos + READ_CHUNK_BYTES])
                if n == 0:
                    raise ShardFormatError(f"group {name}: frames end inside tensor {t.name}")
                pos += n
        stream.finish()
        return dests

    def destinations(self, group: GroupEntry, into: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
        """Flat uint8 views of the caller's buffers for `group`, checked before any byte is read."""
        if into is None:
            return {t.name: np.empty(t.size, dtype=np.uint8) for t in group.tensors}
        missing = [t.name for t in group.tensors if t.name not in into]
        if missing:
            raise ValueError(f"no destination buffer for tensor {missing[0]} (group {group.name})")
        return {t.name: writable_bytes(into[t.name], t.size, t.name) for t in group.tensors}

    def verify(self, progress: Callable[[int], None] | None = None) -> None:
        """Decode every frame and check every checksum and declared size; raise naming every bad frame."""
        scratch = np.empty(READ_CHUNK_BYTES, dtype=np.uint8)
        problems: list[str] = []
        for g in self.groups:
            for k, frame in enumerate(g.frames):
                try:
                    reader = open_frame(self._fd, frame, frame_label(g, k), verify=True)
                    left = frame.size
                    while left:
                        n = reader.readinto(scratch[: min(left, len(scratch))])
                        left -= n
                    reader.finish()
                except ShardFormatError as e:
                    problems.append(str(e))
                if progress is not None:
                    progress(frame.stored_size)
        if problems:
            raise ShardFormatError(f"{self.path}: {len(problems)} bad frame(s): " + "; ".join(problems))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def fd(self) -> int:
        return self._fd


class GroupStream:
    """A group's tensor bytes, back to back in table order, read front to back with `readinto`.

    Each frame is checked (declared size, no extra output, crc32) the moment its last
    byte is delivered, so a bad frame raises before the group can be called complete.
    """

    def __init__(self, reader: ShardReader, group: GroupEntry, *, verify: bool = True) -> None:
        self.group = group
        self._fd = reader.fd
        self._verify = verify
        self._next_frame = 0
        self._frame: _FrameReader | None = None
        self._left = 0  # bytes left in the current frame

    @property
    def tensors(self) -> tuple[TensorEntry, ...]:
        return self.group.tensors

    def readinto(self, out: Any) -> int:
        """Fill `out` (a writable uint8 buffer) as far as the group goes; returns bytes written."""
        out = np.frombuffer(out, dtype=np.uint8) if not isinstance(out, np.ndarray) else out
        written = 0
        while written < len(out):
            if self._left == 0 and not self._open_next():
                break
            n = self._frame.readinto(out[written : written + self._left])
            written += n
            self._left -= n
            if self._left == 0:
                self._frame.finish()
        return written

    def finish(self) -> None:
        """Check that every frame was read to its end (and so checked)."""
        if self._left or self._open_next():
            raise ShardFormatError(f"group {self.group.name}: finished with {self._left} bytes of a frame unread")

    def _open_next(self) -> bool:
        while self._next_frame < len(self.group.frames):
            k = self._next_frame
            self._next_frame += 1
            frame = self.group.frames[k]
            self._frame = open_frame(self._fd, frame, frame_label(self.group, k), verify=self._verify)
            self._left = frame.size
            if self._left:
                return True
            self._frame.finish()
        return False


# ---- frames ------------------------------------------------------------------------


def frame_label(group: GroupEntry, k: int) -> str:
    names = [t.name for t in group.tensors if t.frame == k]
    held = f"{names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "") if names else "no tensors"
    return f"group {group.name} frame {k} ({held})"


def open_frame(fd: int, frame: FrameEntry, label: str, *, verify: bool) -> _FrameReader:
    if frame.codec == CODEC_RAW:
        return _RawFrame(fd, frame, label, verify)
    if frame.codec == CODEC_BYTEGROUP:
        return _ByteGroupFrame(fd, frame, label, verify)
    return _ZstdFrame(fd, frame, label, verify)


class _FrameReader:
    """A frame's decompressed bytes in order. `readinto` never returns more than asked or declared."""

    def __init__(self, fd: int, frame: FrameEntry, label: str, verify: bool) -> None:
        self.fd, self.frame, self.label, self.verify = fd, frame, label, verify
        self.pos = 0

    def readinto(self, out: np.ndarray) -> int:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def error(self, what: str) -> ShardFormatError:
        return ShardFormatError(f"{self.label}: {what}")


class _RawFrame(_FrameReader):
    def __init__(self, fd: int, frame: FrameEntry, label: str, verify: bool) -> None:
        super().__init__(fd, frame, label, verify)
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
        if self.verify:
            self._crc = crc32(view, self._crc)
        self.pos += n
        return n

    def finish(self) -> None:
        if self.pos != self.frame.size:
            raise self.error(f"read {self.pos} of {self.frame.size} bytes")
        if self.verify and self._crc != self.frame.crc32:
            raise self.error(f"checksum mismatch (stored {self.frame.crc32:#010x}, computed {self._crc:#010x})")


class _StoredBytes:
    """The stored bytes of one frame as a file-like source for zstd, crc32 computed on the way."""

    def __init__(self, fd: int, frame: FrameEntry, label: str, verify: bool) -> None:
        self.fd, self.frame, self.label, self.verify = fd, frame, label, verify
        self.pos = 0
        self.crc = 0

    def read(self, n: int = -1) -> bytes:
        left = self.frame.stored_size - self.pos
        n = left if n < 0 else min(n, left)
        data = os.pread(self.fd, n, self.frame.offset + self.pos) if n else b""
        if len(data) < n:
            raise ShardFormatError(f"{self.label}: file ends inside the frame's stored bytes: truncated")
        self.pos += len(data)
        if self.verify:
            self.crc = crc32(data, self.crc)
        return data


class _ZstdFrame(_FrameReader):
    def __init__(self, fd: int, frame: FrameEntry, label: str, verify: bool) -> None:
        super().__init__(fd, frame, label, verify)
        self._source = _StoredBytes(fd, frame, label, verify)
        self._check_declared_size()
        # read_across_frames: a second zstd frame hidden behind the first must count
        # towards the declared size (it is how a crafted frame would smuggle in more bytes).
        self._zstd = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES).stream_reader(
            self._source, read_size=READ_CHUNK_BYTES, read_across_frames=True, closefd=False
        )

    def _check_declared_size(self) -> None:
        head = os.pread(self.fd, min(18, self.frame.stored_size), self.frame.offset)  # max zstd frame header
        try:
            content_size = zstandard.frame_content_size(head)
        except zstandard.ZstdError:
            return  # not decodable as a header; the decoder will say so with context
        if content_size >= 0 and content_size != self.frame.size:
            raise self.error(f"zstd frame declares {content_size} bytes of content; the header declares {self.frame.size}")

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
        if self.pos != self.frame.size:
            raise self.error(f"read {self.pos} of {self.frame.size} bytes")
        # One byte more than declared is a bomb (or a corrupt frame); asking for one is bounded.
        if self._decode(memoryview(bytearray(1))):
            raise self.error(f"decompresses to more than the declared {self.frame.size} bytes")
        if self._source.pos != self.frame.stored_size:
            raise self.error(f"zstd stopped after {self._source.pos} of {self.frame.stored_size} stored bytes")
        if self.verify and self._source.crc != self.frame.crc32:
            raise self.error(f"checksum mismatch (stored {self.frame.crc32:#010x}, computed {self._source.crc:#010x})")

    def _decode(self, view: memoryview) -> int:
        try:
            return self._zstd.readinto(view)
        except zstandard.ZstdError as e:
            raise self.error(f"corrupt zstd data ({e})") from None


class _ByteGroupFrame(_FrameReader):
    """zstd over blocks whose bytes are grouped by position in the element; see format.byte_group."""

    def __init__(self, fd: int, frame: FrameEntry, label: str, verify: bool) -> None:
        super().__init__(fd, frame, label, verify)
        self._planes = _ZstdFrame(fd, frame, label, verify)
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


# ---- buffers -----------------------------------------------------------------------


def writable_bytes(buf: Any, size: int, name: str) -> np.ndarray:
    """A flat uint8 numpy view of `buf`, which must be writable, C-contiguous and exactly `size` bytes."""
    if isinstance(buf, np.ndarray):
        arr = buf
    else:
        try:
            mv = memoryview(buf)
        except TypeError:
            raise TypeError(
                f"destination for {name} is a {type(buf).__name__}, not a buffer; pass a numpy array "
                "(for a torch tensor: t.view(torch.uint8).numpy())"
            ) from None
        if mv.readonly:
            raise ValueError(f"destination for {name} is read-only")
        if not mv.c_contiguous:
            raise ValueError(f"destination for {name} is not C-contiguous")
        arr = np.frombuffer(mv.cast("B"), dtype=np.uint8)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError(f"destination for {name} must be a writable, C-contiguous array")
    if arr.nbytes != size:
        raise ValueError(f"destination for {name} holds {arr.nbytes} bytes; the tensor is {size} bytes")
    return arr.reshape(-1).view(np.uint8)


def _pread_exact(fd: int, n: int, offset: int, what: str) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise ShardFormatError(f"{what}: file ends after {len(data)} of {n} bytes: truncated")
    return data
