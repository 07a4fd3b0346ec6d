"""Accelerator telemetry: one agent per node reports memory, utilisation and fragmentation.

A `TelemetryAgent` polls its node every `poll_interval_s` (200 ms by default): pynvml
for each GPU, or psutil on a CPU-only node. Request actors send it an
`ActorMemoryReport` (what they account for, and what their allocator holds), and
`snapshot()` combines the last reading with those reports into a `NodeTelemetry` for
the registry. Snapshots are cheap: they recombine the last poll with the current
reports and never touch NVML.

This module holds the messages and pure math (`ewma`, `fragmentation`, `combine`) —
no Ray, no torch, so the decision policy and the simulator can import these types
freely — and the sources: `NvmlSource`, `CpuSource`, and `open_source()` which picks
one. The agent, `allocator_report()` and the Ray helpers live in `telemetry_agent.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import psutil

log = logging.getLogger(__name__)

DeviceKind = Literal["cuda", "cpu"]
DEVICE_KINDS = ("cuda", "cpu")


# ---------------------------------------------------------------- messages


@dataclass(frozen=True)
class TelemetryConfig:
    poll_interval_s: float = 0.2
    # Weight of the newest utilisation sample. 0.2 at 200 ms polls gives a time
    # constant of -0.2 / ln(0.8) ≈ 0.9 s: one busy poll does not swing the figure.
    ewma_alpha: float = 0.2

    def __post_init__(self) -> None:
        if not self.poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {self.poll_interval_s}")
        _check_alpha(self.ewma_alpha)


@dataclass(frozen=True)
class DeviceReading:
    """One raw sample of one device, before the actors' reports are folded in."""

    device_index: int  # NVML index on a GPU node; 0 for the CPU
    kind: DeviceKind
    total_bytes: int
    free_bytes: int  # NVML `free`; psutil `available` on the CPU
    driver_reserved_bytes: int  # NVML v2 `reserved` (driver/firmware); 0 on the CPU or NVML v1
    utilization: float  # 0..1, this sample only

    def __post_init__(self) -> None:
        _check_kind(self.kind)
        if not 0 <= self.free_bytes <= self.total_bytes:
            raise ValueError(f"device {self.device_index}: free {self.free_bytes} outside 0..total {self.total_bytes}")
        if not 0 <= self.driver_reserved_bytes <= self.total_bytes - self.free_bytes:
            raise ValueError(
                f"device {self.device_index}: driver reserved {self.driver_reserved_bytes} "
                f"outside 0..total-free {self.total_bytes - self.free_bytes}"
            )
        _check_fraction("utilization", self.utilization)


@dataclass(frozen=True)
class ActorMemoryReport:
    """What one request actor holds on one device (see `allocator_report`)."""

    actor_name: str
    device_index: int  # NVML index of the GPU it runs on; 0 for the CPU
    accounted_bytes: int  # weights + KV + workspace, from the model config (exact)
    allocator_reserved_bytes: int  # memory its allocator took from the driver
    allocator_allocated_bytes: int  # the part of that held by live tensors
    largest_free_block_bytes: int  # largest block cached in its allocator, free to it alone
    # The reporting process (same node as the agent) and its start time, so the agent can
    # drop the report of an actor killed before it could withdraw it; 0: not known.
    pid: int = 0
    process_start: float = 0.0

    def __post_init__(self) -> None:
        for field in ("accounted_bytes", "allocator_reserved_bytes", "allocator_allocated_bytes",
                      "largest_free_block_bytes", "device_index", "pid"):
            if getattr(self, field) < 0:
                raise ValueError(f"{self.actor_name}: {field} must be >= 0, got {getattr(self, field)}")
        cached = self.allocator_reserved_bytes - self.allocator_allocated_bytes
        if cached < 0:
            raise ValueError(
                f"{self.actor_name}: allocator allocated {self.allocator_allocated_bytes} "
                f"exceeds reserved {self.allocator_reserved_bytes}"
            )
        if self.largest_free_block_bytes > cached:
            raise ValueError(
                f"{self.actor_name}: largest free block {self.largest_free_block_bytes} "
                f"exceeds cached memory {cached} (reserved - allocated)"
            )


@dataclass(frozen=True)
class DeviceTelemetry:
    """One device as the registry sees it. Invariants: free + used = total; reserved ≤ used."""

    node_id: str
    device_index: int
    kind: DeviceKind
    total_bytes: int
    used_bytes: int  # total - free: everything a new actor cannot allocate
    free_bytes: int  # what a newly started actor can allocate (driver free / psutil available)
    reserved_bytes: int  # the part of used held by none of our actors: driver, CUDA contexts, other processes
    accounted_bytes: int  # Σ accounted_bytes of our request actors on this device
    utilization_ewma: float  # 0..1
    fragmentation: float  # 0..1, see `fragmentation`
    sampled_at: float  # epoch seconds of the device reading

    def __post_init__(self) -> None:
        _check_kind(self.kind)
        if self.free_bytes < 0 or self.used_bytes < 0 or self.free_bytes + self.used_bytes != self.total_bytes:
            raise ValueError(f"device {self.device_index}: free {self.free_bytes} + used {self.used_bytes} "
                             f"must equal total {self.total_bytes}")
        if not 0 <= self.reserved_bytes <= self.used_bytes:
            raise ValueError(f"device {self.device_index}: reserved {self.reserved_bytes} outside 0..used")
        _check_fraction("utilization_ewma", self.utilization_ewma)
        _check_fraction("fragmentation", self.fragmentation)


@dataclass(frozen=True)
class NodeTelemetry:
    node_id: str
    devices: tuple[DeviceTelemetry, ...]
    sampled_at: float  # epoch seconds of the poll the devices come from


def _check_kind(kind: str) -> None:
    if kind not in DEVICE_KINDS:
        raise ValueError(f"device kind must be one of {DEVICE_KINDS}, got {kind!r}")


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"ewma alpha must be in (0, 1], got {alpha}")


# ---------------------------------------------------------------- pure math


def ewma(prev: float | None, sample: float, alpha: float) -> float:
    """alpha * sample + (1 - alpha) * prev; the first sample (prev None) is taken as is."""
    _check_alpha(alpha)
    if prev is None:
        return sample
    return alpha * sample + (1.0 - alpha) * prev


def fragmentation(largest_free_block: int, total_free: int) -> float:
    """1 - largest_free_block / total_free, in [0, 1].

    0 when nothing is free: there is nothing to fragment, and "nothing fits" is
    already told by free bytes, so it is not counted twice here. 0 when all free
    memory is one block; near 1 when it is many small blocks.
    """
    if largest_free_block < 0 or total_free < 0:
        raise ValueError(f"negative free memory: largest block {largest_free_block}, total {total_free}")
    if largest_free_block > total_free:
        raise ValueError(f"largest free block {largest_free_block} exceeds total free {total_free}")
    if total_free == 0:
        return 0.0
    return 1.0 - largest_free_block / total_free


def combine(
    node_id: str,
    reading: DeviceReading,
    reports: Iterable[ActorMemoryReport],
    utilization_ewma: float,
    sampled_at: float,
) -> DeviceTelemetry:
    """Fold the actors' reports for `reading.device_index` into one `DeviceTelemetry`.

    Memory an actor's allocator caches (reserved − allocated) is free to that
    process only and split into blocks, so it counts towards fragmentation but not
    towards `free_bytes`, which is what a new actor (a new process) can get.

    GPU: the driver maps physical pages into any virtual range, so driver free
    memory serves one allocation of its whole size — one block. Hence
      total free    = driver free + Σ (allocator reserved − allocated)
      largest block = max(driver free, max actor largest free block).
    CPU: virtual memory does not fragment the way device memory does (the kernel
    backs any mapping with any free pages), so only the actors' own caches count:
      total free    = Σ (allocator reserved − allocated)
      largest block = max actor largest free block.
    `free_bytes` is psutil `available` as is: our actors are resident processes, so
    it already excludes what they hold and subtracting accounted bytes would count
    them twice. (Accounted memory not yet touched, e.g. layers still streaming in,
    still shows as available until it is.)

    `reserved_bytes` = driver reserved + whatever of the rest of `used` our actors'
    allocators do not hold (CUDA contexts, other processes, the OS). Reports and
    readings are taken at different instants, so if the actors claim more than the
    reading shows as used, that difference is clamped to 0 rather than negative.
    """
    mine = [r for r in reports if r.device_index == reading.device_index]
    held = sum(r.allocator_reserved_bytes for r in mine)
    cached = sum(r.allocator_reserved_bytes - r.allocator_allocated_bytes for r in mine)
    largest_cached = max((r.largest_free_block_bytes for r in mine), default=0)
    if reading.kind == "cuda":
        total_free = reading.free_bytes + cached
        largest_block = max(reading.free_bytes, largest_cached)
    else:
        total_free = cached
        largest_block = largest_cached

    used = reading.total_bytes - reading.free_bytes
    unheld = max(0, used - reading.driver_reserved_bytes - held)
    return DeviceTelemetry(
        node_id=node_id,
        device_index=reading.device_index,
        kind=reading.kind,
        total_bytes=reading.total_bytes,
        used_bytes=used,
        free_bytes=reading.free_bytes,
        reserved_bytes=reading.driver_reserved_bytes + unheld,
        accounted_bytes=sum(r.accounted_bytes for r in mine),
        utilization_ewma=min(1.0, max(0.0, utilization_ewma)),  # float rounding may step past 1 by an ulp
        fragmentation=fragmentation(largest_block, total_free),
        sampled_at=sampled_at,
    )


def largest_inactive_block(segments: Iterable[Mapping[str, Any]], device: int) -> int:
    """Largest free ("inactive") block in a `torch.cuda.memory_snapshot()` for `device`.

    Whole cached segments appear as one inactive block, so this covers both free
    segments and the free tails of split ones.
    """
    return max(
        (
            int(block["size"])
            for segment in segments
            if segment.get("device", device) == device
            for block in segment.get("blocks", ())
            if block.get("state") == "inactive"
        ),
        default=0,
    )


# ---------------------------------------------------------------- sources


class Source(Protocol):
    kind: DeviceKind

    def read(self) -> tuple[DeviceReading, ...]: ...

    def close(self) -> None: ...


class NvmlSource:
    """Every GPU NVML sees on this node (NVML ignores CUDA_VISIBLE_DEVICES)."""

    kind: DeviceKind = "cuda"

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        # The v2 struct splits the driver's own reservation out of `used`; old
        # drivers lack the call, and we fall back to v1 (reserved counted as 0).
        self._is_v2 = hasattr(pynvml, "nvmlMemory_v2")
        self._is_utilization_supported = True

    @property
    def num_devices(self) -> int:
        return len(self._handles)

    def read(self) -> tuple[DeviceReading, ...]:
        return tuple(self._read_one(index, handle) for index, handle in enumerate(self._handles))

    def _read_one(self, index: int, handle: Any) -> DeviceReading:
        nvml = self._nvml
        total, free, reserved = self._memory(handle)
        utilization = 0.0
        if self._is_utilization_supported:
            try:
                utilization = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            except nvml.NVMLError_NotSupported:
                # MIG and some virtualised GPUs do not report it; memory still works.
                log.warning("GPU %d does not report utilisation; reporting 0", index)
                self._is_utilization_supported = False
        return DeviceReading(index, "cuda", total, free, reserved, min(1.0, utilization))

    def _memory(self, handle: Any) -> tuple[int, int, int]:
        nvml = self._nvml
        if self._is_v2:
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
                return int(memory.total), int(memory.free), int(memory.reserved)
            except nvml.NVMLError as error:
                log.info("NVML memory info v2 unavailable (%s); using v1", error)
                self._is_v2 = False
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        return int(memory.total), int(memory.free), 0

    def close(self) -> None:
        self._nvml.nvmlShutdown()


class CpuSource:
    """The node's RAM as one device, index 0."""

    kind: DeviceKind = "cpu"

    def __init__(self) -> None:
        # cpu_percent(None) measures since the previous call; this first one only
        # sets the baseline (it returns a meaningless 0.0).
        psutil.cpu_percent(interval=None)

    def read(self) -> tuple[DeviceReading, ...]:
        memory = psutil.virtual_memory()
        utilization = psutil.cpu_percent(interval=None) / 100.0
        return (DeviceReading(0, "cpu", memory.total, min(memory.available, memory.total), 0,
                              min(1.0, utilization)),)

    def close(self) -> None:
        pass


def open_source() -> Source:
    """NVML when it initialises and finds at least one GPU, else the CPU. Never raises for a missing GPU."""
    try:
        import pynvml
    except ImportError:
        log.info("pynvml is not installed; reporting CPU telemetry")
        return CpuSource()
    try:
        source = NvmlSource()
    except (pynvml.NVMLError, OSError) as error:
        log.info("NVML unavailable (%s); reporting CPU telemetry", error)
        return CpuSource()
    if source.num_devices == 0:
        source.close()
        log.info("NVML found no GPU; reporting CPU telemetry")
        return CpuSource()
    return source


def is_process_alive(pid: int, process_start: float) -> bool:
    """True while process `pid` on this node runs and is the one that started at `process_start`.

    The start time guards against a reused pid; pid 0 means "unknown" and counts as alive.
    """
    if pid == 0:
        return True
    try:
        return abs(psutil.Process(pid).create_time() - process_start) < 1.0
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True

