"""Telemetry math, sources and the agent's polling, without Ray."""

from __future__ import annotations

import itertools
import threading
import time

import psutil
import pytest
import torch

from actors.telemetry import (
    ActorMemoryReport,
    CpuSource,
    DeviceReading,
    DeviceTelemetry,
    TelemetryConfig,
    combine,
    ewma,
    fragmentation,
    largest_inactive_block,
    open_source,
)
from actors.telemetry_agent import (
    LatestEvery,
    TelemetryAgent,
    allocator_report,
)
from tests.serve.waiting import wait_for

GiB = 1 << 30
MiB = 1 << 20


# ---------------------------------------------------------------- ewma


def test_ewma_first_sample_is_taken_as_is():
    assert ewma(None, 0.7, alpha=0.2) == 0.7


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.9])
def test_ewma_converges_geometrically_at_rate_one_minus_alpha(alpha):
    value = 0.0
    for step in range(1, 30):
        value = ewma(value, 1.0, alpha)
        assert value == pytest.approx(1.0 - (1.0 - alpha) ** step)
    assert value <= 1.0  # never overshoots the sample


def test_ewma_larger_alpha_follows_faster_and_alpha_one_is_the_sample():
    slow = fast = 0.0
    for _ in range(5):
        slow, fast = ewma(slow, 1.0, 0.1), ewma(fast, 1.0, 0.5)
    assert slow < fast
    assert ewma(0.3, 0.9, alpha=1.0) == 0.9


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_ewma_rejects_alpha_outside_unit_interval(alpha):
    with pytest.raises(ValueError, match="alpha"):
        ewma(0.0, 1.0, alpha)


# ---------------------------------------------------------------- fragmentation


def test_fragmentation_is_zero_when_nothing_is_free():
    assert fragmentation(0, 0) == 0.0


def test_fragmentation_is_zero_for_one_block():
    assert fragmentation(5 * GiB, 5 * GiB) == 0.0


def test_fragmentation_of_many_small_blocks_is_near_one():
    # 1000 blocks of 1 MiB each: the largest is a thousandth of what is free.
    assert fragmentation(MiB, 1000 * MiB) == pytest.approx(0.999)


@pytest.mark.parametrize("largest, total", [(2, 1), (-1, 5), (1, -5)])
def test_fragmentation_rejects_inconsistent_input(largest, total):
    with pytest.raises(ValueError):
        fragmentation(largest, total)


# ---------------------------------------------------------------- messages


def test_config_validates():
    with pytest.raises(ValueError, match="poll_interval_s"):
        TelemetryConfig(poll_interval_s=0)
    with pytest.raises(ValueError, match="alpha"):
        TelemetryConfig(ewma_alpha=0)


def test_actor_report_validates_allocator_figures():
    with pytest.raises(ValueError, match="exceeds reserved"):
        ActorMemoryReport("a", 0, GiB, allocator_reserved_bytes=GiB, allocator_allocated_bytes=2 * GiB,
                          largest_free_block_bytes=0)
    with pytest.raises(ValueError, match="largest free block"):
        ActorMemoryReport("a", 0, GiB, allocator_reserved_bytes=3 * GiB, allocator_allocated_bytes=2 * GiB,
                          largest_free_block_bytes=2 * GiB)
    with pytest.raises(ValueError, match="accounted_bytes"):
        ActorMemoryReport("a", 0, -1, 0, 0, 0)


def test_reading_and_telemetry_validate():
    with pytest.raises(ValueError, match="free"):
        DeviceReading(0, "cuda", total_bytes=GiB, free_bytes=2 * GiB, driver_reserved_bytes=0, utilization=0.0)
    with pytest.raises(ValueError, match="kind"):
        DeviceReading(0, "tpu", GiB, GiB, 0, 0.0)
    with pytest.raises(ValueError, match="must equal total"):
        DeviceTelemetry("n", 0, "cpu", total_bytes=10, used_bytes=3, free_bytes=3, reserved_bytes=0,
                        accounted_bytes=0, utilization_ewma=0.0, fragmentation=0.0, sampled_at=0.0)


# ---------------------------------------------------------------- combine


def _report(name, device, accounted, reserved, allocated, largest):
    return ActorMemoryReport(name, device, accounted * GiB, reserved * GiB, allocated * GiB, largest * GiB)


def test_combine_gpu_counts_allocator_caches_as_fragmented_free_memory():
    reading = DeviceReading(0, "cuda", total_bytes=80 * GiB, free_bytes=10 * GiB,
                            driver_reserved_bytes=1 * GiB, utilization=0.5)
    reports = [
        _report("a", 0, accounted=30, reserved=32, allocated=29, largest=2),  # caches 3 GiB
        _report("b", 0, accounted=20, reserved=21, allocated=20, largest=1),  # caches 1 GiB
        _report("c", 1, accounted=5, reserved=5, allocated=5, largest=0),  # another GPU: ignored
    ]
    t = combine("node", reading, reports, utilization_ewma=0.4, sampled_at=123.0)

    assert (t.node_id, t.device_index, t.kind, t.sampled_at) == ("node", 0, "cuda", 123.0)
    assert t.total_bytes == 80 * GiB
    assert t.free_bytes == 10 * GiB  # caches are not free to a new actor
    assert t.used_bytes == 70 * GiB
    assert t.accounted_bytes == 50 * GiB
    # used 70 = driver reserved 1 + held by our allocators 53 + 16 held by no actor of ours
    assert t.reserved_bytes == 17 * GiB
    # free 10 (one block) + cached 4; largest block = the driver's 10
    assert t.fragmentation == pytest.approx(1 - 10 / 14)
    assert t.utilization_ewma == 0.4


def test_combine_gpu_largest_block_may_be_inside_an_allocator():
    reading = DeviceReading(0, "cuda", 80 * GiB, free_bytes=1 * GiB, driver_reserved_bytes=0, utilization=0.0)
    t = combine("node", reading, [_report("a", 0, 70, 79, 75, 3)], 0.0, 0.0)
    assert t.fragmentation == pytest.approx(1 - 3 / (1 + 4))


def test_combine_clamps_when_reports_claim_more_than_the_reading_shows_used():
    # The report was taken after a load the NVML reading has not seen yet.
    reading = DeviceReading(0, "cuda", 80 * GiB, free_bytes=70 * GiB, driver_reserved_bytes=GiB, utilization=0.0)
    t = combine("node", reading, [_report("a", 0, 20, 20, 20, 0)], 0.0, 0.0)
    assert t.reserved_bytes == GiB
    assert t.free_bytes == 70 * GiB


def test_combine_without_reports_is_the_reading_alone():
    reading = DeviceReading(2, "cuda", 80 * GiB, 30 * GiB, GiB, 0.0)
    t = combine("node", reading, [], 0.0, 0.0)
    assert (t.accounted_bytes, t.reserved_bytes, t.fragmentation) == (0, 50 * GiB, 0.0)


def test_combine_cpu_free_is_available_and_fragmentation_comes_from_actors_only():
    reading = DeviceReading(0, "cpu", total_bytes=16 * GiB, free_bytes=10 * GiB, driver_reserved_bytes=0,
                            utilization=0.1)
    exact = combine("node", reading, [_report("a", 0, 2, 2, 2, 0)], 0.1, 0.0)
    assert exact.free_bytes == 10 * GiB  # available already excludes what the actor holds
    assert exact.accounted_bytes == 2 * GiB
    assert exact.reserved_bytes == 4 * GiB  # used 6 - held 2
    assert exact.fragmentation == 0.0  # available RAM is never counted as fragmented

    cached = combine("node", reading, [_report("a", 0, 2, 4, 2, 1)], 0.1, 0.0)
    assert cached.fragmentation == pytest.approx(1 - 1 / 2)


# ---------------------------------------------------------------- allocator statistics


def test_largest_inactive_block_reads_torch_snapshot_segments():
    segments = [
        {"device": 0, "total_size": 20 * MiB, "blocks": [
            {"size": 5 * MiB, "state": "active_allocated"},
            {"size": 15 * MiB, "state": "inactive"},
        ]},
        {"device": 0, "total_size": 64 * MiB, "blocks": [{"size": 64 * MiB, "state": "active_pending_free"}]},
        {"device": 1, "total_size": 99 * MiB, "blocks": [{"size": 99 * MiB, "state": "inactive"}]},
    ]
    assert largest_inactive_block(segments, device=0) == 15 * MiB
    assert largest_inactive_block(segments, device=1) == 99 * MiB
    assert largest_inactive_block([], device=0) == 0


def test_allocator_report_on_cpu_is_the_actors_own_accounting():
    if torch.cuda.is_initialized():
        pytest.skip("this process holds CUDA memory")
    report = allocator_report("actor-1", 0, accounted_bytes=3 * MiB)
    assert report == ActorMemoryReport("actor-1", 0, 3 * MiB, 3 * MiB, 3 * MiB, 0)
    with pytest.raises(ValueError, match="accounted_bytes"):
        allocator_report("actor-1", 0, accounted_bytes=-1)


# ---------------------------------------------------------------- sources


def test_cpu_source_reports_sane_numbers():
    source = CpuSource()
    (reading,) = source.read()
    assert reading.kind == "cpu" and reading.device_index == 0
    assert reading.total_bytes == psutil.virtual_memory().total > 0
    assert 0 < reading.free_bytes <= reading.total_bytes
    assert 0.0 <= reading.utilization <= 1.0


def test_open_source_picks_cpu_on_a_cpu_only_machine():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    source = open_source()
    assert isinstance(source, CpuSource)
    source.close()


# ---------------------------------------------------------------- the agent, without Ray


class ScriptedSource:
    """A device whose readings follow a fixed cycle, so the agent's EWMA can be checked exactly."""

    kind = "cuda"

    def __init__(self, utilizations, fail_reads=()):
        self._utilizations = itertools.cycle(utilizations)
        self._fail_reads = set(fail_reads)
        self.num_reads = 0
        self.is_closed = False
        self.lock = threading.Lock()

    def read(self):
        with self.lock:
            self.num_reads += 1
            if self.num_reads in self._fail_reads:
                raise RuntimeError("transient NVML error")
            return (DeviceReading(0, "cuda", 80 * GiB, 60 * GiB, GiB, next(self._utilizations)),)

    def close(self):
        self.is_closed = True


def test_agent_smooths_utilisation_over_polls():
    source = ScriptedSource([0.0, 1.0])
    agent = TelemetryAgent("node", TelemetryConfig(poll_interval_s=0.01, ewma_alpha=0.3), source)
    time.sleep(0.15)
    agent.stop()
    expected = None
    for utilization in itertools.islice(itertools.cycle([0.0, 1.0]), source.num_reads):
        expected = ewma(expected, utilization, 0.3)
    (device,) = agent.snapshot().devices
    assert source.num_reads >= 3
    assert 0.0 < device.utilization_ewma < 1.0
    assert device.utilization_ewma == pytest.approx(expected)


def test_agent_report_shows_at_once_and_forget_removes_it():
    source = ScriptedSource([0.2])
    agent = TelemetryAgent("node", TelemetryConfig(poll_interval_s=60.0), source)
    try:
        agent.report(_report("a", 0, accounted=7, reserved=8, allocated=7, largest=1))
        assert agent.snapshot().devices[0].accounted_bytes == 7 * GiB
        assert source.num_reads == 1  # shown without a new poll
        assert agent.forget("a") is True
        assert agent.forget("a") is False
        assert agent.snapshot().devices[0].accounted_bytes == 0
        with pytest.raises(ValueError, match="no cuda device 3"):
            agent.report(_report("b", 3, 1, 1, 1, 0))
        with pytest.raises(TypeError):
            agent.report({"actor_name": "b"})
    finally:
        agent.stop()


def test_agent_polls_at_its_interval_and_stops():
    source = ScriptedSource([0.0])
    interval = 0.02
    started = time.monotonic()
    agent = TelemetryAgent("node", TelemetryConfig(poll_interval_s=interval), source)
    time.sleep(0.3)
    agent.stop()
    elapsed = time.monotonic() - started
    num_reads = source.num_reads
    # One read at start, then one per interval; a fixed-rate schedule never bursts.
    assert 3 <= num_reads <= elapsed / interval + 2
    assert source.is_closed
    time.sleep(3 * interval)
    assert source.num_reads == num_reads
    agent.stop()  # idempotent


def test_agent_survives_failed_polls():
    source = ScriptedSource([0.5], fail_reads={2, 3})
    agent = TelemetryAgent("node", TelemetryConfig(poll_interval_s=0.01), source)
    first = agent.snapshot().sampled_at
    deadline = time.monotonic() + 2.0
    while source.num_reads < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    agent.stop()
    assert source.num_reads >= 6
    assert agent.snapshot().sampled_at > first


def test_agent_drops_the_report_of_a_process_that_is_gone():
    import os
    import subprocess
    import sys
    from dataclasses import replace

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child_start = psutil.Process(child.pid).create_time()
    own = (os.getpid(), psutil.Process().create_time())
    agent = TelemetryAgent("node", TelemetryConfig(poll_interval_s=60.0), ScriptedSource([0.2]))

    def accounted() -> int:
        return agent.snapshot().devices[0].accounted_bytes // GiB

    try:
        agent.report(replace(_report("killed", 0, 1, 1, 1, 0), pid=child.pid, process_start=child_start))
        agent.report(replace(_report("alive", 0, 2, 2, 2, 0), pid=own[0], process_start=own[1]))
        agent.report(_report("unknown", 0, 4, 4, 4, 0))  # no pid: kept until withdrawn
        agent._poll()
        assert accounted() == 7
        child.kill()
        child.wait()
        agent._poll()
        assert accounted() == 6
        # The same pid with another start time is another process: the pid was reused.
        agent.report(replace(_report("reused", 0, 8, 8, 8, 0), pid=own[0], process_start=own[1] - 100))
        agent._poll()
        assert accounted() == 6
    finally:
        child.kill()
        agent.stop()



def test_latest_every_sends_the_latest_value_at_most_once_an_interval():
    sent: list[int] = []
    latest = LatestEvery(sent.append, interval_s=0.1)
    started = time.monotonic()
    for i in range(200):  # an actor's two reports per request, many requests
        latest.offer(i)
        time.sleep(0.001)
    elapsed = time.monotonic() - started
    wait_for(lambda: bool(sent) and sent[-1] == 199, 10, "the held value sent")
    assert sent[0] == 0  # the first goes at once
    assert len(sent) <= elapsed / 0.1 + 2, (len(sent), elapsed)  # one an interval, and the held one at the end
    assert sent == sorted(sent)


def test_latest_every_sends_nothing_held_after_close():
    sent: list[int] = []
    latest = LatestEvery(sent.append, interval_s=0.2)
    latest.offer(1)
    latest.offer(2)  # held (unless this machine stalled a whole interval between the two)
    latest.close()
    latest.offer(3)
    time.sleep(0.5)
    assert 3 not in sent and sent[0] == 1
