"""Reading a `.zqs` shard file: validate the header up front, then decode any group on its own.

`ShardReader(path)` reads and checks the preamble and header and touches no frame.
`read_group` / `read_layer` decode one group straight into caller-owned buffers: raw
frames are read with `os.preadv` into the destination, zstd frames stream through
`stream_reader.readinto` into it, byte-grouped frames decode one block (1 MiB by default)
at a time and interleave into it (weights_tool/frames.py). Memory beyond the destinations
is a few blocks and, per reading thread, one compressed chunk read ahead.

All reads are `pread`s on one file descriptor, so any number of threads may read
different groups at once (zstd, zlib.crc32 and numpy copies release the GIL). The
read-ahead runs on a small thread pool the reader owns; `close()` waits for it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from weights_tool.format import (
    CODEC_RAW,
    PREAMBLE,
    GroupEntry,
    Header,
    ShardFormatError,
    TensorEntry,
    decode_preamble,
)
from weights_tool.frames import (
    CHECK_ALL,
    CHECK_LOAD,
    CHECK_NONE,
    READ_CHUNK_BYTES,
    FrameReader,
    ReadAhead,
    frame_label,
    open_frame,
)
from weights_tool.groups import group_name
from weights_tool.header import parse_header

log = logging.getLogger(__name__)

# Reads in flight ahead of the decoding threads; each only waits on storage, so a few
# more threads than cores cost nothing.
MAX_READ_AHEAD_THREADS = 8


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
        self._read_ahead: ReadAhead | None = None
        self._read_ahead_lock = threading.Lock()

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
        return self.read_group(group_name(i, self.num_layers), into, verify=verify)

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
        with GroupStream(self, group, verify=verify) as stream:
            self._read_into(stream, dests, cancel)
        return dests

    def _read_into(self, stream: GroupStream, dests: dict[str, np.ndarray], cancel: threading.Event | None) -> None:
        group, name = stream.group, stream.group.name
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

    def destinations(self, group: GroupEntry, into: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
        """Flat uint8 views of the caller's buffers for `group`, checked before any byte is read."""
        if into is None:
            return {t.name: np.empty(t.size, dtype=np.uint8) for t in group.tensors}
        missing = [t.name for t in group.tensors if t.name not in into]
        if missing:
            raise ValueError(f"no destination buffer for tensor {missing[0]} (group {group.name})")
        return {t.name: writable_bytes(into[t.name], t.size, t.name) for t in group.tensors}

    def read_rows(self, name: str, rows: Sequence[int]) -> np.ndarray:
        """Rows `rows` of the 2-D tensor `name`, in that order: [len(rows), row bytes] uint8.

        Reads only those rows, so the tensor must sit in a raw frame (`pack(raw_embeddings=True)`
        stores the embedding table so). Not checked: the frame's CRC-32 covers the whole
        frame, so a caller that computes with these rows must also load the tensor's group
        (which checks it) before it trusts the result.
        """
        t = self.tensors.get(name)
        if t is None:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        frame = self.group(t.group).frames[t.frame]
        if len(t.shape) != 2 or frame.codec != CODEC_RAW:
            raise ValueError(f"{name}: rows can be read one by one only from a 2-D tensor in a raw frame; "
                             f"it is {len(t.shape)}-D in a {frame.codec} frame")
        num_rows = t.shape[0]
        row_bytes = t.size // num_rows
        out = np.empty((len(rows), row_bytes), dtype=np.uint8)
        base = frame.offset + t.offset  # inside the file: parse_header bounds-checked both
        for k, r in enumerate(rows):
            if not 0 <= r < num_rows:
                raise IndexError(f"{name}: row {r} outside 0..{num_rows - 1}")
            if os.preadv(self._fd, [out[k]], base + r * row_bytes) != row_bytes:
                raise ShardFormatError(f"{name}: file ends inside row {r}: truncated")
        return out

    def verify(self, progress: Callable[[int], None] | None = None) -> None:
        """Decode every frame and check every checksum and declared size; raise naming every bad frame."""
        scratch = np.empty(READ_CHUNK_BYTES, dtype=np.uint8)
        problems: list[str] = []
        for g in self.groups:
            for k, frame in enumerate(g.frames):
                reader: FrameReader | None = None
                try:
                    reader = open_frame(self._fd, frame, frame_label(g, k), check=CHECK_ALL,
                                        read_ahead=self.read_ahead())
                    left = frame.size
                    while left:
                        n = reader.readinto(scratch[: min(left, len(scratch))])
                        left -= n
                    reader.finish()
                except ShardFormatError as e:
                    problems.append(str(e))
                finally:
                    if reader is not None:
                        reader.close()
                if progress is not None:
                    progress(frame.stored_size)
        if problems:
            raise ShardFormatError(f"{self.path}: {len(problems)} bad frame(s): " + "; ".join(problems))

    def read_ahead(self) -> ReadAhead:
        """The threads and buffers that read compressed chunks ahead of the decoders, started on first use."""
        with self._read_ahead_lock:
            if self._fd < 0:
                raise ValueError(f"{self.path}: reader is closed")
            if self._read_ahead is None:
                self._read_ahead = ReadAhead(MAX_READ_AHEAD_THREADS)
            return self._read_ahead

    def close(self) -> None:
        """Close the file once reads in flight have finished (so no pread meets a reused fd)."""
        with self._read_ahead_lock:
            pool, self._read_ahead = self._read_ahead, None
        if pool is not None:
            pool.shutdown()
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

    Each frame is checked (declared size, no extra output, its checksum: see frames.py)
    the moment its last byte is delivered, so a bad frame raises before the group can be
    called complete. `verify=False` skips the CRC-32s, never the sizes.
    """

    def __init__(self, reader: ShardReader, group: GroupEntry, *, verify: bool = True) -> None:
        self.group = group
        self._fd = reader.fd
        self._check = CHECK_LOAD if verify else CHECK_NONE
        self._read_ahead = reader.read_ahead()
        self._next_frame = 0
        self._frame: FrameReader | None = None
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

    def close(self) -> None:
        """Drop the current frame's read-ahead, if the group was abandoned part way."""
        if self._frame is not None:
            self._frame.close()

    def __enter__(self) -> GroupStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_next(self) -> bool:
        while self._next_frame < len(self.group.frames):
            k = self._next_frame
            self._next_frame += 1
            frame = self.group.frames[k]
            self._frame = open_frame(self._fd, frame, frame_label(self.group, k), check=self._check,
                                     read_ahead=self._read_ahead)
            self._left = frame.size
            if self._left:
                return True
            self._frame.finish()
        return False


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
