"""The process heap a CPU prefill runs in: kept between layers, on huge pages, trimmed when idle;
and `huge_page_arena`, memory of its own on huge pages (the model's weights live in one).

A prefill allocates and frees the same activation buffers once per layer (tens of MB for
long prompts). With glibc's defaults, blocks that large are mmap'd and unmapped on free,
so every layer page-faults its buffers in again, and on 4 KiB pages.
benchmarks/results/heap.md (`python -m benchmarks.bench_heap`) measures the three heaps
side by side: faults per prefill and time per layer.

`retain_freed_memory()` makes glibc serve allocations without mmap, keep what is freed,
and advises the first `huge_page_bytes` of the main heap to be backed by transparent
huge pages (virtual until touched). `release_freed_memory()` hands free pages back to the
kernel. Both are no-ops where the C library is not glibc.

`IdleTrimmer` decides when: a hot actor releases its freed heap once it has been idle
for `delay_s`, so back-to-back requests reuse the pages without faulting them in again,
and an idle actor holds its weights and little else. Releasing at once would cost the
next request its whole working set again: glibc's malloc_trim gives back every free
page of a thread's arena (Ray's actor threads each get their own), keeping none.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library, with malloc / free / madvise / malloc_trim typed; None where it is not glibc."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not all(hasattr(lib, f) for f in ("mallopt", "malloc_trim", "madvise")):
        return None
    lib.malloc.restype = ctypes.c_void_p
    lib.malloc.argtypes = [ctypes.c_size_t]
    lib.free.argtypes = [ctypes.c_void_p]
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.malloc_trim.argtypes = [ctypes.c_size_t]
    return lib


_huge_page_bytes = 0  # of the main heap advised for huge pages; set by retain_freed_memory


def _advise_huge_pages(lib: ctypes.CDLL) -> None:
    """Extend the main heap by _huge_page_bytes (untouched) and advise THP on it; the free keeps it."""
    n = _huge_page_bytes
    if n < 2 * _HUGE_PAGE:
        return
    p = lib.malloc(n)  # with mmap off this moves the heap's end (brk): no page is touched
    if not p:
        return
    start, end = -(-p // _HUGE_PAGE) * _HUGE_PAGE, (p + n) // _HUGE_PAGE * _HUGE_PAGE
    if lib.madvise(start, end - start, _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused: the heap stays on 4 KiB pages")
    lib.free(p)  # the top chunk, below the trim threshold: kept, still advised


def retain_freed_memory(huge_page_bytes: int = 1 << 30) -> bool:
    """Serve allocations without mmap, keep freed pages, THP-advise the main heap; True if applied."""
    global _huge_page_bytes
    lib = glibc()
    if lib is None:
        log.info("no glibc mallopt here: freed memory goes back to the kernel as usual")
        return False
    # No mmap'd chunks: their free is a munmap. The heap's top is trimmed only past the
    # advised region, so a free never undoes it. Threads keep the arenas glibc gave them
    # (in a Ray actor the request's thread does not use the main heap; see IdleTrimmer).
    ok = lib.mallopt(_M_MMAP_MAX, 0) == 1
    ok &= lib.mallopt(_M_TRIM_THRESHOLD, huge_page_bytes + (64 << 20)) == 1
    if not ok:
        log.warning("mallopt refused a setting: freed memory may still go back to the kernel")
        return False
    _huge_page_bytes = huge_page_bytes
    _advise_huge_pages(lib)
    return True


def release_freed_memory(keep_bytes: int = 0) -> None:
    """Give free pages back to the kernel, all but `keep_bytes` at the main heap's top (malloc_trim)."""
    lib = glibc()
    if lib is None:
        return
    lib.malloc_trim(keep_bytes)
    _advise_huge_pages(lib)  # the trimmed part of the heap was unmapped, and its advice with it


def huge_page_arena(nbytes: int) -> torch.Tensor:
    """nbytes of CPU memory (uint8), 2 MB aligned, advised to be backed by transparent huge pages.

    A private anonymous mmap (a shared one would be shmem, which THP skips): nothing
    is resident until written. Where the kernel has no transparent huge pages the
    advice is a no-op and ordinary pages are used.
    """
    import torch  # imported here: the glibc settings need none, and their tests measure a process without it

    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(buf, dtype=torch.uint8)  # keeps buf alive
    skip = -arena.data_ptr() % _HUGE_PAGE
    return arena[skip : skip + nbytes]


class IdleTrimmer:
    """Calls `trim` once `delay_s` has passed since the last request ended with none started since."""

    def __init__(self, delay_s: float, trim: Callable[[], None] = release_freed_memory) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self._delay_s = delay_s
        self._trim = trim
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def request_started(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def request_ended(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self._delay_s, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._timer is None or threading.current_thread() is not self._timer:
                return  # cancelled, or replaced by a later request's end
            self._timer = None
        self._trim()
