"""Per-request actors as Ray actors: a spawned actor computes what the runtime computes and leaves Ray's actor
table and its CPUs after its request; one killed from outside surfaces Ray's death to its caller; its memory
reaches the node's telemetry agent. The actor's own behaviour (hot reuse, cancel, batching, overlap, warm,
coalescing) is tested in-process: tests/runtime/test_request_actor.py."""

from __future__ import annotations

import time

import pytest

from actors.actor_config import ActorConfig
from actors.actor_names import new_actor_name
from actors.messages import Completion, Started, TextChunk
from actors.request_actor import spawn
from tests.runtime.test_request_actor import _in_process_tokens, _request, _token_ids

CONFIG = ActorConfig(namespace="zeroqueue-tests", num_cpus=1, load_threads=1, compute_threads=1)


def _consume(ray, gen) -> tuple[list[TextChunk], Completion]:
    items = [ray.get(ref) for ref in gen]
    assert isinstance(items[0], Started) and isinstance(items[-1], Completion)
    assert all(isinstance(i, TextChunk) for i in items[1:-1])
    return items[1:-1], items[-1]


def _wait_gone(ray, name: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=CONFIG.namespace)
        except ValueError:
            return
        time.sleep(0.05)
    raise AssertionError(f"actor {name} still in Ray's actor table after {timeout}s")


def _wait_cpus(ray, expected: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ray.available_resources().get("CPU", 0) >= expected


def test_actor_generates_what_the_in_process_runtime_generates_then_exits(ray_cluster, tiny_zqs):
    ray = ray_cluster
    free_before = ray.available_resources()["CPU"]
    request = _request(tiny_zqs)
    name = new_actor_name("tiny")
    actor = spawn(str(tiny_zqs), CONFIG, name)
    chunks, done = _consume(ray, actor.generate.remote(request))
    assert _token_ids(chunks) == _in_process_tokens(tiny_zqs, request)
    assert done.output_tokens == len(_token_ids(chunks)) == chunks[-1].num_output_tokens == 16 and done.stop_reason == "max_tokens"
    assert done.is_cold and 0 <= done.first_layers <= 2
    t = done.timings
    assert t.actor_start <= t.compute_start <= t.first_token <= t.last_token
    _wait_gone(ray, name)
    _wait_cpus(ray, free_before)


def test_killing_an_actor_mid_load_or_mid_decode_surfaces_an_error(ray_cluster, layered_zqs, tiny_zqs):
    ray = ray_cluster
    from ray.exceptions import ActorDiedError, RayActorError

    for zqs, kill_after in ((layered_zqs, 0), (tiny_zqs, 2)):
        name = new_actor_name("kill")
        actor = spawn(str(zqs), CONFIG, name)
        gen = actor.generate.remote(_request(zqs, max_tokens=1500, temperature=0.0))
        with pytest.raises((ActorDiedError, RayActorError)):
            for k, ref in enumerate(gen):
                if k == kill_after:
                    ray.kill(actor)
                ray.get(ref)
        _wait_gone(ray, name)


def test_actor_reports_its_memory_to_the_node_agent_and_its_peak(ray_cluster, tiny_zqs):
    ray = ray_cluster
    from actors.telemetry import TelemetryConfig
    from actors.telemetry_agent import ensure_agents

    (agent,) = ensure_agents(TelemetryConfig(poll_interval_s=0.1), namespace=CONFIG.namespace).values()

    def accounted() -> int:
        (device,) = ray.get(agent.snapshot.remote()).devices
        return device.accounted_bytes

    def wait_accounted(expected: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while accounted() != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert accounted() == expected

    try:
        name = new_actor_name("tiny")
        actor = spawn(str(tiny_zqs), CONFIG, name)
        weights = ray.get(actor.status.remote()).accounted_bytes
        assert weights > 0
        wait_accounted(weights)  # reported as soon as the model is allocated
        _, done = _consume(ray, actor.generate.remote(_request(tiny_zqs)))
        # The process's peak resident set over the request: Python and torch besides the weights.
        assert done.peak_bytes is not None and done.peak_bytes > weights
        _wait_gone(ray, name)
        wait_accounted(0)  # withdrawn on exit
        # Killed from outside, an actor cannot withdraw its report: the agent sees its process gone.
        name = new_actor_name("tiny")
        actor = spawn(str(tiny_zqs), CONFIG, name)
        wait_accounted(ray.get(actor.status.remote()).accounted_bytes)
        ray.kill(actor)
        _wait_gone(ray, name)
        wait_accounted(0)
    finally:
        ray.kill(agent)
