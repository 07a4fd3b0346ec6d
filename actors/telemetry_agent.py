"""The per-node telemetry agent, the request actors' allocator report, and Ray helpers.

Ray and torch are imported lazily, so importing this module stays cheap.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import cache
from typing import Any

import psutil

from actors.actor_names import agent_name
from actors.remote_call import call_unparented
from actors.telemetry import (
    ActorMemoryReport,
    DeviceReading,
    NodeTelemetry,
    Source,
    TelemetryConfig,
    combine,
    ewma,
    is_process_alive,
    largest_inactive_block,
    open_source,
)

log = logging.getLogger(__name__)


class TelemetryAgent:
    """Polls one node in a background thread; `ensure_agents` runs it as a Ray actor.

    A plain class so it runs (and is tested) without Ray. `snapshot()` recombines
    the last reading with the current reports, so a `report` shows at once, and it
    never waits on the source.
    """

    def __init__(self, node_id: str, config: TelemetryConfig, source: Source | None = None) -> None:
        self._node_id = node_id
        self._config = config
        self._source = source if source is not None else open_source()
        self._lock = threading.Lock()  # guards the fields below, written by the poll thread
        self._readings: tuple[DeviceReading, ...] = ()
        self._utilization: dict[int, float] = {}  # device index -> EWMA
        self._sampled_at = 0.0
        self._reports: dict[str, ActorMemoryReport] = {}
        self._is_failing = False
        self._stop_event = threading.Event()
        self._poll()  # so the first snapshot already has data; a source that cannot read fails here
        self._thread = threading.Thread(target=self._run, name="zq-telemetry-poll", daemon=True)
        self._thread.start()
        log.info("telemetry agent on node %s: %s source, %d device(s), every %.3f s",
                 node_id, self._source.kind, len(self._readings), config.poll_interval_s)

    def snapshot(self) -> NodeTelemetry:
        with self._lock:
            readings, utilization = self._readings, dict(self._utilization)
            reports, sampled_at = tuple(self._reports.values()), self._sampled_at
        devices = tuple(
            combine(self._node_id, r, reports, utilization[r.device_index], sampled_at) for r in readings
        )
        return NodeTelemetry(self._node_id, devices, sampled_at)

    def report(self, report: ActorMemoryReport) -> None:
        if not isinstance(report, ActorMemoryReport):
            raise TypeError(f"expected an ActorMemoryReport, got {type(report).__name__}")
        with self._lock:
            known = {r.device_index for r in self._readings}
            if report.device_index not in known:
                raise ValueError(f"{report.actor_name}: node {self._node_id} has no {self._source.kind} "
                                 f"device {report.device_index} (has {sorted(known)})")
            self._reports[report.actor_name] = report

    def forget(self, actor_name: str) -> bool:
        """Drop an actor's report; False if it had none."""
        with self._lock:
            return self._reports.pop(actor_name, None) is not None

    def stop(self) -> None:
        """Stop polling and release the source. Idempotent; snapshots keep the last poll."""
        if self._stop_event.is_set():
            return
        self._stop_event.set()
        self._thread.join(timeout=self._config.poll_interval_s + 5.0)
        if self._thread.is_alive():
            # Stuck inside the source; closing NVML under a live call is unsafe, and
            # the daemon thread dies with the process.
            log.warning("telemetry poll thread on %s did not stop within its deadline", self._node_id)
            return
        self._source.close()

    def _run(self) -> None:
        # Fixed-rate schedule: sleeping a full interval after each poll would drift
        # by the poll's own duration.
        interval = self._config.poll_interval_s
        next_poll = time.monotonic() + interval
        while not self._stop_event.wait(max(0.0, next_poll - time.monotonic())):
            next_poll = max(next_poll + interval, time.monotonic())
            try:
                self._poll()
            except Exception:
                # A transient NVML error must not kill the agent; the snapshot's
                # sampled_at stops advancing, which the registry can see.
                if not self._is_failing:
                    log.exception("telemetry poll failed on %s; keeping the last reading", self._node_id)
                self._is_failing = True
            else:
                if self._is_failing:
                    log.info("telemetry polling recovered on %s", self._node_id)
                self._is_failing = False

    def _poll(self) -> None:
        readings = self._source.read()
        sampled_at = time.time()
        alpha = self._config.ewma_alpha
        with self._lock:
            self._utilization = {
                r.device_index: ewma(self._utilization.get(r.device_index), r.utilization, alpha) for r in readings
            }
            self._readings, self._sampled_at = readings, sampled_at
            reports = list(self._reports.values())
        self._forget_dead(reports)

    def _forget_dead(self, reports: list[ActorMemoryReport]) -> None:
        """Drop the reports of actors whose process is gone (killed before they could withdraw them)."""
        for r in reports:
            if not is_process_alive(r.pid, r.process_start):
                with self._lock:
                    if self._reports.get(r.actor_name) is r:
                        del self._reports[r.actor_name]
                log.info("%s: its process %d is gone; its memory report is dropped", r.actor_name, r.pid)


def allocator_report(
    actor_name: str, device_index: int, accounted_bytes: int, cuda_device: int | None = None
) -> ActorMemoryReport:
    """The `ActorMemoryReport` a request actor sends to its node's agent.

    CUDA path iff this process has initialised CUDA (it holds device memory only
    then): reserved/allocated from `torch.cuda.memory_stats(cuda_device)` and the
    largest cached block from `torch.cuda.memory_snapshot()`; `cuda_device` is the
    torch index (default: current), `device_index` the node's NVML index (under Ray
    a `num_gpus=1` actor reads it from `ray.get_gpu_ids()`). Otherwise the actor's
    exact accounting is all there is: allocated = reserved = accounted, nothing cached.
    """
    import torch

    if accounted_bytes < 0:
        raise ValueError(f"{actor_name}: accounted_bytes must be >= 0, got {accounted_bytes}")
    if not torch.cuda.is_initialized():
        return ActorMemoryReport(actor_name, device_index, accounted_bytes, accounted_bytes, accounted_bytes, 0)
    device = torch.cuda.current_device() if cuda_device is None else cuda_device
    stats = torch.cuda.memory_stats(device)
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    allocated = min(int(stats.get("allocated_bytes.all.current", 0)), reserved)
    largest = largest_inactive_block(torch.cuda.memory_snapshot(), device)
    # The two calls are not atomic; another thread may allocate in between.
    largest = min(largest, reserved - allocated)
    return ActorMemoryReport(actor_name, device_index, accounted_bytes, reserved, allocated, largest)


# ---------------------------------------------------------------- Ray helpers




@cache
def _agent_actor_class() -> Any:
    import ray

    return ray.remote(num_cpus=0)(TelemetryAgent)


def ensure_agents(config: TelemetryConfig, namespace: str | None = None) -> dict[str, Any]:
    """One named detached agent per alive node, created if absent; node id -> actor handle.

    Idempotent: an existing agent is returned as is (with the config it was started with).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    agent_class = _agent_actor_class()
    handles = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        node_id = node["NodeID"]
        handles[node_id] = agent_class.options(
            name=agent_name(node_id),
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(node_id, config)
    return handles


def cluster_snapshot(handles: Mapping[str, Any], timeout_s: float) -> list[NodeTelemetry]:
    """Every agent's snapshot that arrives within `timeout_s`, in `handles` order.

    A dead or slow agent is skipped with a warning: a stale view of one node must
    not stall the ingress.
    """
    import ray

    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if not handles:
        return []
    refs = {node_id: handle.snapshot.remote() for node_id, handle in handles.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    is_ready = set(ready)
    snapshots: list[NodeTelemetry] = []
    for node_id, ref in refs.items():
        if ref not in is_ready:
            log.warning("telemetry agent on node %s did not answer within %.2f s; skipped", node_id, timeout_s)
            continue
        try:
            snapshots.append(ray.get(ref, timeout=0))
        except ray.exceptions.RayError as error:
            log.warning("telemetry agent on node %s failed; skipped: %s", node_id, error)
    return snapshots


# The agent samples its node every 200 ms (TelemetryConfig.poll_interval_s): an actor's reports more often
# than that change no snapshot's freshness, only the agent's load.
MIN_REPORT_INTERVAL_S = 0.2


class LatestEvery:
    """`send(value)` at most once every `interval_s`, always with the latest value: one offered sooner is held
    and sent as the interval ends, with whatever was offered after it. Thread-safe; `close` drops what is held
    and sends nothing more."""

    def __init__(self, send: Callable[[Any], None], interval_s: float) -> None:
        self._send, self._interval_s = send, interval_s
        self._lock = threading.Lock()
        self._latest: Any = None
        self._next_at = 0.0  # monotonic: nothing is sent before this
        self._timer: threading.Timer | None = None  # the held value's send
        self._is_closed = False

    def offer(self, value: Any) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._latest = value
            if self._timer is not None:
                return  # the held send takes this value
            wait = self._next_at - time.monotonic()
            if wait > 0:
                self._timer = threading.Timer(wait, self._flush)
                self._timer.daemon = True
                self._timer.start()
                return
            self._next_at = time.monotonic() + self._interval_s
        self._send(value)

    def close(self) -> None:
        with self._lock:
            self._is_closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _flush(self) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._timer = None
            self._next_at = time.monotonic() + self._interval_s
            value = self._latest
        self._send(value)


class AgentReporter:
    """A request actor's line to its node's telemetry agent: fire-and-forget reports.

    The agent is looked up once, by name, in the actors' namespace (the ingress starts
    one per node with `ensure_agents`). Where there is none — a test, a driver script —
    the actor runs the same and reports nothing. Reports never wait: telemetry must not
    slow a request.
    """

    def __init__(self, actor_name: str, namespace: str | None, is_cuda: bool) -> None:
        import ray

        self._actor_name = actor_name
        self._process = (os.getpid(), psutil.Process().create_time())
        # The node's NVML index of this actor's GPU (Ray sets CUDA_VISIBLE_DEVICES to it); the CPU is device 0.
        self._device_index = int(ray.get_gpu_ids()[0]) if is_cuda and ray.get_gpu_ids() else 0
        node_id = ray.get_runtime_context().get_node_id()
        try:
            agent = ray.get_actor(agent_name(node_id), namespace=namespace)
        except ValueError:
            log.info("%s: no telemetry agent on node %s; memory goes unreported", actor_name, node_id[:12])
            agent = None
        self._agent = agent
        # A request makes two reports (its row's KV in place, its row gone): sent each, they cost the agent more
        # CPU than the request's admission.
        self._latest = LatestEvery(self._send, MIN_REPORT_INTERVAL_S)

    def report(self, accounted_bytes: int) -> None:
        if self._agent is not None:
            self._latest.offer(accounted_bytes)

    def _send(self, accounted_bytes: int) -> None:
        try:
            report = allocator_report(self._actor_name, self._device_index, accounted_bytes)
            pid, started = self._process
            # Not a child of the request whose row this reports (remote_call.py): its cancellation must not
            # cancel the report, nor stall this actor's later reports.
            call_unparented(self._agent.report, replace(report, pid=pid, process_start=started))
        except Exception:  # a dead agent or a torch stats hiccup must not fail the request
            log.warning("%s: memory report failed", self._actor_name, exc_info=True)

    def forget(self) -> None:
        if self._agent is not None:
            self._latest.close()  # a held report must not follow the withdrawal
            try:
                call_unparented(self._agent.forget, self._actor_name)
            except Exception:
                log.warning("%s: could not withdraw its memory report", self._actor_name, exc_info=True)


class _NoReporter:
    """An actor outside Ray (an in-process cluster) has no agent to tell."""

    def report(self, accounted_bytes: int) -> None:
        pass

    def forget(self) -> None:
        pass


NO_REPORTER = _NoReporter()
