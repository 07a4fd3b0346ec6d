"""Telemetry agents as Ray actors on a real local cluster: placement, snapshots, deadlines."""

from __future__ import annotations

import itertools
import logging
import statistics
import time

import psutil
import pytest

from actors.telemetry import (
    ActorMemoryReport,
    NodeTelemetry,
    TelemetryConfig,
)
from actors.telemetry_agent import (
    agent_name,
    cluster_snapshot,
    ensure_agents,
)

NAMESPACE = "zq-telemetry-agent-tests"
POLL_INTERVAL_S = 0.1
MiB = 1 << 20


def _wait_ready(ray, handles, timeout_s=60.0):
    ray.get([h.__ray_ready__.remote() for h in handles.values()], timeout=timeout_s)


def _kill_and_wait(ray, handles, namespace, timeout_s=10.0):
    """Kill the agents and wait until their names are free, so no later test sees them, and until a call on each
    handle fails: Ray frees the name before the process is gone, and a call sent in between is still answered
    (a full suite once saw a "dead" agent's snapshot)."""
    for handle in handles.values():
        ray.kill(handle)
    deadline = time.monotonic() + timeout_s
    for node_id in handles:
        while True:
            try:
                ray.get_actor(agent_name(node_id), namespace=namespace)
            except ValueError:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent {agent_name(node_id)} still registered after {timeout_s} s")
            time.sleep(0.05)
    for node_id, handle in handles.items():
        while True:
            try:
                ray.get(handle.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.RayActorError:
                break
            except ray.exceptions.GetTimeoutError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent {agent_name(node_id)} still answers after {timeout_s} s")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def agents(ray_cluster):
    handles = ensure_agents(TelemetryConfig(poll_interval_s=POLL_INTERVAL_S), namespace=NAMESPACE)
    _wait_ready(ray_cluster, handles)
    yield handles
    _kill_and_wait(ray_cluster, handles, NAMESPACE)


def _only(handles):
    (node_id, handle), = handles.items()  # the test cluster is one node
    return node_id, handle


def test_one_agent_per_alive_node_and_idempotent(ray_cluster, agents):
    alive = {node["NodeID"] for node in ray_cluster.nodes() if node["Alive"]}
    assert set(agents) == alive

    again = ensure_agents(TelemetryConfig(poll_interval_s=POLL_INTERVAL_S), namespace=NAMESPACE)
    assert {n: h._actor_id for n, h in again.items()} == {n: h._actor_id for n, h in agents.items()}
    for node_id, handle in agents.items():
        named = ray_cluster.get_actor(agent_name(node_id), namespace=NAMESPACE)
        assert named._actor_id == handle._actor_id


def test_snapshot_reports_the_cpu_within_a_second(ray_cluster, agents):
    node_id, handle = _only(agents)
    started = time.time()
    snapshot = ray_cluster.get(handle.snapshot.remote(), timeout=1.0)
    assert time.time() - started < 1.0

    assert isinstance(snapshot, NodeTelemetry)
    assert snapshot.node_id == node_id
    (device,) = snapshot.devices
    assert (device.kind, device.device_index) == ("cpu", 0)
    assert device.total_bytes == psutil.virtual_memory().total  # the agent runs on this machine
    assert 0 < device.free_bytes <= device.total_bytes
    assert 0.0 <= device.utilization_ewma <= 1.0
    assert abs(device.sampled_at - time.time()) < 1.0


def test_report_then_snapshot_shows_accounted_bytes_and_forget_removes_them(ray_cluster, agents):
    _, handle = _only(agents)
    report = ActorMemoryReport("request-actor-1", 0, accounted_bytes=300 * MiB,
                               allocator_reserved_bytes=300 * MiB, allocator_allocated_bytes=300 * MiB,
                               largest_free_block_bytes=0)
    ray_cluster.get(handle.report.remote(report), timeout=5.0)
    (device,) = ray_cluster.get(handle.snapshot.remote(), timeout=5.0).devices
    assert device.accounted_bytes == 300 * MiB

    assert ray_cluster.get(handle.forget.remote("request-actor-1"), timeout=5.0) is True
    (device,) = ray_cluster.get(handle.snapshot.remote(), timeout=5.0).devices
    assert device.accounted_bytes == 0

    wrong_device = ActorMemoryReport("request-actor-2", 7, 1, 1, 1, 0)
    with pytest.raises(ValueError, match="no cpu device 7"):
        ray_cluster.get(handle.report.remote(wrong_device), timeout=5.0)


def test_poll_interval_is_honoured(ray_cluster, agents):
    _, handle = _only(agents)
    sampled = []
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:
        at = ray_cluster.get(handle.snapshot.remote(), timeout=5.0).sampled_at
        if not sampled or at != sampled[-1]:
            sampled.append(at)
        time.sleep(0.01)
    steps = [b - a for a, b in itertools.pairwise(sampled)]
    assert len(steps) >= 5
    assert all(step > 0 for step in steps)
    assert statistics.median(steps) == pytest.approx(POLL_INTERVAL_S, rel=0.3)


def test_cluster_snapshot_skips_dead_and_slow_agents_within_its_deadline(ray_cluster, agents, caplog):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class SlowAgent:
        def snapshot(self):
            time.sleep(30)

    doomed = ensure_agents(TelemetryConfig(), namespace=NAMESPACE + "-doomed")
    slow = SlowAgent.remote()
    try:
        _wait_ready(ray, {**doomed, "slow": slow})
        _kill_and_wait(ray, doomed, NAMESPACE + "-doomed")
        live_node, live = _only(agents)
        handles = {live_node: live, "dead-node": next(iter(doomed.values())), "slow-node": slow}

        timeout_s = 1.0
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="actors.telemetry_agent"):
            snapshots = cluster_snapshot(handles, timeout_s=timeout_s)
        elapsed = time.monotonic() - started

        assert elapsed < timeout_s + 0.5
        assert [s.node_id for s in snapshots] == [live_node]
        warnings = " ".join(r.getMessage() for r in caplog.records)
        assert "dead-node failed" in warnings
        assert "slow-node did not answer" in warnings
    finally:
        ray.kill(slow)
