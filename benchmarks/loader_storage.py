"""Storage as the loader benchmark sees it: a rate-limited link, page-cache eviction and residency.

`Throttle` stands in for a network volume or object store: every read the benchmark
makes (and, through `throttled_reader`, every read `weights_tool.reader` makes) waits
for its turn on one shared link of a fixed rate. `evict` drops a file from the page
cache with posix_fadvise(DONTNEED) and `resident_pages` checks with mincore(2) that it
is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import mmap
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from weights_tool import frames as frames_module
from weights_tool import reader as reader_module

CHUNK_BYTES = 4 << 20  # every method reads in pieces of this size (as the .zqs reader does)
PAGE = mmap.PAGESIZE


class Throttle:
    """One storage link of `rate` bytes/s, shared by every thread that reads through it.

    A virtual clock: a read of n bytes is due n/rate after the later of now and the
    previous read's due time, and returns no sooner. The link banks no credit while idle
    (no read-ahead), so a reader that decodes between reads overlaps nothing unless
    another thread reads meanwhile. The bytes themselves come from the page cache.
    """

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive bytes/s, got {rate}")
        self.rate = rate
        self.num_bytes = 0
        self._due = 0.0
        self._lock = threading.Lock()

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        due = self._reserve(n)
        data = os.pread(fd, n, offset)
        _sleep_until(due)
        return data

    def preadv(self, fd: int, buffers: list[Any], offset: int) -> int:
        due = self._reserve(sum(memoryview(b).nbytes for b in buffers))
        n = os.preadv(fd, buffers, offset)
        _sleep_until(due)
        return n

    def _reserve(self, n: int) -> float:
        with self._lock:
            self._due = max(time.perf_counter(), self._due) + n / self.rate
            self.num_bytes += n
            return self._due


def _sleep_until(due: float) -> None:
    left = due - time.perf_counter()
    if left > 0:
        time.sleep(left)


class _ThrottledOs:
    """Stands in for the `os` module inside weights_tool.reader and .frames: their preads go through a Throttle."""

    def __init__(self, throttle: Throttle) -> None:
        self.pread, self.preadv = throttle.pread, throttle.preadv

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def throttled_reader(throttle: Throttle | None) -> contextlib.AbstractContextManager[Any]:
    """While active, every pread of `weights_tool.reader` and `.frames` (ShardReader, LayerStream) goes through `throttle`.

    They call `os.pread` / `os.preadv` by module attribute, so swapping their `os` is the
    whole hook; callers check `throttle.num_bytes` afterwards, so a reader that stops
    reading that way fails the benchmark instead of going silently unthrottled.
    """
    stack = contextlib.ExitStack()
    if throttle is not None:
        for module in (reader_module, frames_module):
            stack.enter_context(mock.patch.object(module, "os", _ThrottledOs(throttle)))
    return stack


def read_exact(fd: int, view: memoryview | np.ndarray, offset: int, throttle: Throttle | None = None) -> None:
    """Fill `view` (writable bytes) from `fd` at `offset`, CHUNK_BYTES per pread, through `throttle` if given."""
    view = memoryview(view).cast("B")
    preadv = throttle.preadv if throttle is not None else os.preadv
    pos = 0
    while pos < len(view):
        n = preadv(fd, [view[pos : pos + CHUNK_BYTES]], offset + pos)
        if n == 0:
            raise EOFError(f"file ends {len(view) - pos} bytes early")
        pos += n


def read_all(path: Path, throttle: Throttle | None = None) -> bytearray:
    buf = bytearray(path.stat().st_size)
    with open_fd(path) as fd:
        read_exact(fd, buf, 0, throttle)
    return buf


class PreadFile(io.RawIOBase):
    """A file read front to back with preads, through a Throttle if given (for tarfile's stream mode)."""

    def __init__(self, path: Path, throttle: Throttle | None) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._size, self._pos, self._throttle = os.fstat(self._fd).st_size, 0, throttle

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")[: self._size - self._pos]
        read_exact(self._fd, view, self._pos, self._throttle)
        self._pos += len(view)
        return len(view)

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


@contextlib.contextmanager
def open_fd(path: Path) -> Iterator[int]:
    """A read-only file descriptor, closed on exit."""
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_pages(path: Path) -> tuple[int, int]:
    """(pages of `path` in the page cache, pages in the file), by mincore(2) over a fresh mapping."""
    size = path.stat().st_size
    num_pages = -(-size // PAGE)
    if size == 0:
        return 0, 0
    with open_fd(path) as fd:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = np.zeros(num_pages, dtype=np.uint8)
            if _libc.mincore(addr, size, vec.ctypes.data) != 0:
                raise OSError(ctypes.get_errno(), f"mincore on {path} failed")
        finally:
            _libc.munmap(addr, size)
    return int(np.count_nonzero(vec & 1)), num_pages


def evict(path: Path) -> int:
    """Drop `path` from the page cache; returns the pages still resident (0 unless something holds them)."""
    with open_fd(path) as fd:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return resident_pages(path)[0]


def read_through(path: Path) -> None:
    """Read `path` front to back into one reused buffer (so it ends up in the page cache)."""
    buf = np.empty(CHUNK_BYTES, dtype=np.uint8)
    with open_fd(path) as fd:
        for offset in range(0, path.stat().st_size, CHUNK_BYTES):
            os.preadv(fd, [buf], offset)


def warm(path: Path) -> int:
    """Read `path` into the page cache; returns the pages resident afterwards."""
    read_through(path)
    return resident_pages(path)[0]
