"""NVML telemetry and allocator statistics on a real GPU."""

from __future__ import annotations

import time

import pytest
import torch

from actors.telemetry import (
    NvmlSource,
    TelemetryConfig,
    open_source,
)
from actors.telemetry_agent import (
    TelemetryAgent,
    allocator_report,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MiB = 1 << 20


def _nvml_index_of_current_device() -> int:
    """NVML numbers every GPU on the node; torch only the visible ones. Match them by UUID."""
    import pynvml

    torch_uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
        for index in range(count):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            if torch_uuid in uuid:
                return index
    finally:
        pynvml.nvmlShutdown()
    if count == 1:
        return 0
    pytest.skip(f"cannot match torch device UUID {torch_uuid} to an NVML index")


def test_nvml_source_reports_the_device_total_and_free_within_it():
    index = _nvml_index_of_current_device()
    source = NvmlSource()
    try:
        readings = source.read()
    finally:
        source.close()
    assert len(readings) == source.num_devices >= 1
    _, total = torch.cuda.mem_get_info()
    assert readings[index].total_bytes == total
    for reading in readings:
        assert reading.kind == "cuda"
        assert 0 <= reading.free_bytes <= reading.total_bytes
        assert 0 <= reading.driver_reserved_bytes <= reading.total_bytes - reading.free_bytes
        assert 0.0 <= reading.utilization <= 1.0


def test_open_source_picks_nvml_where_a_gpu_exists():
    source = open_source()
    try:
        assert isinstance(source, NvmlSource)
    finally:
        source.close()


def test_allocator_report_sees_a_tensor_allocation_and_its_cached_block():
    torch.cuda.init()  # the report reads allocator statistics only once CUDA is initialised
    torch.cuda.empty_cache()
    before = allocator_report("probe", 0, accounted_bytes=0)

    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    during = allocator_report("probe", 0, accounted_bytes=64 * MiB)
    assert during.allocator_allocated_bytes - before.allocator_allocated_bytes >= 64 * MiB
    assert during.allocator_reserved_bytes >= during.allocator_allocated_bytes
    assert during.accounted_bytes == 64 * MiB

    del x  # the block stays in torch's cache: free to this process only
    after = allocator_report("probe", 0, accounted_bytes=0)
    assert after.allocator_allocated_bytes == before.allocator_allocated_bytes
    assert after.largest_free_block_bytes >= 64 * MiB
    torch.cuda.empty_cache()


def test_agent_counts_an_actors_cache_as_fragmentation():
    index = _nvml_index_of_current_device()
    agent = TelemetryAgent("node", TelemetryConfig(poll_interval_s=0.05), NvmlSource())
    try:
        x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        del x
        report = allocator_report("probe", index, accounted_bytes=0)
        agent.report(report)
        time.sleep(0.2)  # a few polls after the allocation
        device = next(d for d in agent.snapshot().devices if d.device_index == index)
    finally:
        agent.stop()
        torch.cuda.empty_cache()

    cached = report.allocator_reserved_bytes - report.allocator_allocated_bytes
    assert cached >= 256 * MiB
    assert device.kind == "cuda"
    assert device.used_bytes >= report.allocator_reserved_bytes
    largest = max(device.free_bytes, report.largest_free_block_bytes)
    assert device.fragmentation == pytest.approx(1 - largest / (device.free_bytes + cached))
    assert device.fragmentation > 0
