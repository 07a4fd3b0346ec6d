"""Loading a shard file's groups in order on background threads, so compute can start early.

Groups are numbered as the runtime numbers them: -1 the embeddings, 0..L-1 the decoder
layers, L the final norm + lm_head. They are started in that order (or in `order`: a
loader that reads the prompt's embedding rows on its own streams the layers first) on
`num_threads` threads; `wait(i)` returns once group i is in place (and only group i's error is raised
there: the other groups still load). `close()` stops the threads within one 4 MiB read.

`after_group(i)` runs on the loading thread once group i's bytes are in, before its
waiters go (the loader widens a 16-bit file's weights to fp32 there); what it raises is
group i's error.

`hold_after=k` loads only the first k groups of the order, then holds until `resume()`:
a warm actor keeps the embeddings and its first layers resident, ahead of any request,
and streams the rest only once a request is bound to it.

`LayerStream` decodes into caller-owned host buffers and needs no torch.
`CudaLayerStream` decodes into a small ring of pinned staging buffers and copies them to
caller-owned CUDA tensors on a side stream; `wait(i)` then makes the caller's current
stream wait on group i's event instead of blocking the host.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from weights_tool.format import ShardFormatError
from weights_tool.groups import group_name
from weights_tool.reader import GroupStream, ReadCancelled, ShardReader

log = logging.getLogger(__name__)

THREAD_NAME = "zqs-layer-stream"


class LayerStreamClosed(RuntimeError):
    """The stream was closed before the group being waited on was loaded."""


class LayerStream:
    """Load every group of `reader` into `destinations` (tensor name -> writable host buffer)."""

    def __init__(
        self,
        reader: ShardReader,
        destinations: Mapping[str, Any],
        *,
        num_threads: int = 2,
        verify: bool = True,
        order: Sequence[int] | None = None,
        hold_after: int | None = None,
        after_group: Callable[[int], None] | None = None,
    ) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {num_threads}")
        self.reader = reader
        self.num_layers = reader.num_layers
        self._verify = verify
        self._after_group = after_group
        self._order = list(range(-1, self.num_layers + 1))
        if order is not None:
            if sorted(order) != self._order:
                raise ValueError(f"order must list each group -1..{self.num_layers} once, got {list(order)}")
            self._order = list(order)
        if hold_after is not None and not 0 <= hold_after <= len(self._order):
            raise ValueError(f"hold_after must be in 0..{len(self._order)}, got {hold_after}")
        self._groups = {i: reader.group(group_name(i, self.num_layers)) for i in self._order}
        self._prepare(destinations)  # checks every destination before any thread starts

        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._resumed = threading.Condition(self._lock)
        self._next = 0
        self._limit = len(self._order) if hold_after is None else hold_after  # groups a thread may start
        self._held_s = 0.0  # how long the threads were held with nothing to load
        self._done = {i: threading.Event() for i in self._order}
        self._errors: dict[int, BaseException] = {}
        self._ready_at: dict[int, float] = {}
        self._start = time.perf_counter()
        self.started_at = time.time()  # epoch seconds of the same instant, for callers' timelines
        self._threads = [
            threading.Thread(target=self._work, name=f"{THREAD_NAME}-{k}", daemon=True) for k in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    # ---- the caller's side ------------------------------------------------------------

    def wait(self, index: int, timeout: float | None = None) -> None:
        """Block until group `index` is loaded; raise its error, TimeoutError, or LayerStreamClosed."""
        self._wait_host(index, timeout)

    def is_ready(self, index: int) -> bool:
        return self._done[self._check_index(index)].is_set() and index not in self._errors

    def ready_times(self) -> dict[int, float]:
        """Seconds from the stream's start to each loaded group's completion."""
        with self._lock:
            return dict(self._ready_at)

    def resume(self) -> None:
        """Load the groups held back by `hold_after`; a no-op once everything may load."""
        with self._lock:
            held = self._order[: self._limit]
            if self._limit < len(self._order) and all(i in self._ready_at for i in held):
                # The threads stood still from the last held group's arrival until now: not load time.
                last = max((self._ready_at[i] for i in held), default=0.0)
                self._held_s = time.perf_counter() - self._start - last
            self._limit = len(self._order)
            self._resumed.notify_all()

    def resident_fraction(self) -> float:
        """Share of the file's decompressed bytes loaded so far."""
        with self._lock:
            total = sum(g.size for g in self._groups.values())
            loaded = sum(self._groups[i].size for i in self._ready_at if i not in self._errors)
        return loaded / total if total else 1.0

    def throughput(self) -> float:
        """Bytes per second over the groups loaded so far (decompressed bytes delivered)."""
        with self._lock:
            if not self._ready_at:
                return 0.0
            loaded = sum(self._groups[i].size for i in self._ready_at)
            last = max(self._ready_at.values())
            return loaded / max(last - self._held_s if last > self._held_s else last, 1e-9)

    def close(self) -> None:
        """Stop the threads (each finishes at most its current read) and fail unfinished waits."""
        with self._lock:
            self._stop.set()
            self._resumed.notify_all()  # held threads wake to see the stop
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        with self._lock:
            for i, done in self._done.items():
                if not done.is_set():
                    self._errors[i] = LayerStreamClosed(f"layer stream closed before group {i} was loaded")
                    done.set()
        self._release()

    def __enter__(self) -> LayerStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- loading ----------------------------------------------------------------------

    def _prepare(self, destinations: Mapping[str, Any]) -> None:
        self._dests: dict[str, np.ndarray] = {}
        for g in self._groups.values():
            self._dests.update(self.reader.destinations(g, destinations))

    def _load(self, index: int) -> None:
        self.reader.read_group(self._groups[index].name, self._dests, verify=self._verify, cancel=self._stop)

    def _finish(self, index: int) -> None:
        """Group `index` is loaded: note when, then let its waiters go."""
        with self._lock:
            self._ready_at[index] = time.perf_counter() - self._start
        self._done[index].set()

    def _release(self) -> None:
        """Free what `_prepare` allocated, once every thread has stopped."""

    def _work(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                while self._next == self._limit < len(self._order) and not self._stop.is_set():
                    self._resumed.wait()
                if self._next == len(self._order) or self._stop.is_set():
                    return
                index = self._order[self._next]
                self._next += 1
            try:
                self._load(index)
                if self._after_group is not None:
                    self._after_group(index)
            except ReadCancelled:
                return  # close() marks the unfinished groups
            except BaseException as e:  # kept for wait(index); the other groups still load
                if not isinstance(e, ShardFormatError):
                    log.exception("loading group %d failed", index)
                with self._lock:
                    self._errors[index] = e
                self._done[index].set()
                continue
            self._finish(index)

    def _wait_host(self, index: int, timeout: float | None) -> None:
        if not self._done[self._check_index(index)].wait(timeout):
            raise TimeoutError(f"group {index} ({self._groups[index].name}) not loaded within {timeout} s")
        error = self._errors.get(index)
        if error is not None:
            raise error

    def _check_index(self, index: int) -> int:
        if index not in self._done:
            raise IndexError(f"group index {index} outside -1..{self.num_layers} (-1 embed, {self.num_layers} final)")
        return index


class CudaLayerStream(LayerStream):
    """Load into CUDA tensors (name -> contiguous tensor of the tensor's byte size) via pinned staging.

    Extra host memory is `num_slots * slot_bytes` of pinned staging (default: num_threads + 1
    slots of at most 32 MiB), reused round-robin: a slot is refilled only after the copy
    out of it has completed.
    """

    def __init__(
        self,
        reader: ShardReader,
        destinations: Mapping[str, Any],
        *,
        num_threads: int = 2,
        verify: bool = True,
        order: Sequence[int] | None = None,
        hold_after: int | None = None,
        slot_bytes: int = 32 << 20,
        num_slots: int | None = None,
    ) -> None:
        self._slot_bytes = slot_bytes
        self._num_slots = num_slots or num_threads + 1
        if slot_bytes < 1 or self._num_slots < 1:
            raise ValueError("slot_bytes and num_slots must be positive")
        super().__init__(reader, destinations, num_threads=num_threads, verify=verify, order=order,
                         hold_after=hold_after)

    def wait(self, index: int, timeout: float | None = None) -> None:
        """Return once group `index`'s copies are queued; the caller's current stream then waits on them."""
        import torch

        self._wait_host(index, timeout)
        torch.cuda.current_stream(self._device).wait_event(self._events[index])

    def is_ready(self, index: int) -> bool:
        return super().is_ready(index) and self._events[index].query()

    def _prepare(self, destinations: Mapping[str, Any]) -> None:
        import torch

        self._dests_cuda: dict[str, Any] = {}
        devices = set()
        for g in self._groups.values():
            for t in g.tensors:
                d = destinations.get(t.name)
                if d is None:
                    raise ValueError(f"no destination tensor for {t.name} (group {g.name})")
                if not (isinstance(d, torch.Tensor) and d.is_cuda and d.is_contiguous()):
                    raise ValueError(f"destination for {t.name} must be a contiguous CUDA tensor")
                if d.numel() * d.element_size() != t.size:
                    raise ValueError(f"destination for {t.name} holds {d.numel() * d.element_size()} bytes; "
                                     f"the tensor is {t.size} bytes")
                self._dests_cuda[t.name] = d.reshape(-1).view(torch.uint8)
                devices.add(d.device)
        if len(devices) != 1:
            raise ValueError(f"destinations must all be on one CUDA device, got {sorted(map(str, devices))}")
        self._device = devices.pop()
        largest = max(g.size for g in self._groups.values())
        slot_bytes = max(1, min(self._slot_bytes, largest))
        self._copy_stream = torch.cuda.Stream(self._device)
        # The destinations may still be being written (zeroed, say) on the caller's stream.
        self._copy_stream.wait_stream(torch.cuda.current_stream(self._device))
        self._slots: queue.Queue[tuple[Any, np.ndarray, Any]] = queue.Queue()
        for _ in range(self._num_slots):
            host = torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True)
            self._slots.put((host, host.numpy(), torch.cuda.Event()))
        self._events: dict[int, Any] = {}

    def _load(self, index: int) -> None:
        import torch

        group = self._groups[index]
        with GroupStream(self.reader, group, verify=self._verify) as stream:
            tensors, ti, t_pos = group.tensors, 0, 0
            left = group.size
            while left:
                host, host_np, event = self._take_slot()
                try:
                    n = min(left, len(host_np))
                    filled = 0
                    while filled < n:
                        if self._stop.is_set():
                            raise ReadCancelled(f"loading group {group.name} was cancelled")
                        k = stream.readinto(host_np[filled:n])
                        if k == 0:
                            raise ShardFormatError(f"group {group.name}: frames end {left - filled} bytes early")
                        filled += k
                    with torch.cuda.stream(self._copy_stream):
                        s = 0
                        while s < n:  # the slot holds the tail of one tensor, whole tensors, the head of another
                            t = tensors[ti]
                            k = min(t.size - t_pos, n - s)
                            if k:
                                self._dests_cuda[t.name][t_pos : t_pos + k].copy_(host[s : s + k], non_blocking=True)
                            s, t_pos = s + k, t_pos + k
                            if t_pos == t.size:
                                ti, t_pos = ti + 1, 0
                        event.record(self._copy_stream)
                finally:
                    self._slots.put((host, host_np, event))
                left -= n
            stream.finish()
        done = torch.cuda.Event()
        done.record(self._copy_stream)
        self._events[index] = done

    def _finish(self, index: int) -> None:
        # Waiters go as soon as the copies are queued (their stream waits on the event); the
        # ready time is when the bytes are on the device.
        self._done[index].set()
        self._events[index].synchronize()
        with self._lock:
            self._ready_at[index] = time.perf_counter() - self._start

    def _take_slot(self) -> tuple[Any, np.ndarray, Any]:
        while True:
            if self._stop.is_set():
                raise ReadCancelled("layer stream closed")
            try:
                slot = self._slots.get(timeout=0.05)
            except queue.Empty:
                continue
            slot[2].synchronize()  # the copy out of this slot's last fill has finished
            return slot

    def _release(self) -> None:
        self._copy_stream.synchronize()  # no copy may still read a staging slot as it is freed
