"""A benchmark driver's calls to request actors: drain a stream, wait for an actor to exit, kill one.

Shared by the benchmarks that spawn `RequestActor`s themselves (bench_cold_start,
bench_warm, bench_gpu); `ray` is passed in, so importing this module starts nothing.
"""

from __future__ import annotations

import time
from typing import Any

from actors.messages import Completion, TextChunk


def consume(ray: Any, gen: Any) -> tuple[Completion, float]:
    """Drain one actor stream; (its Completion, when the first TextChunk reached the driver)."""
    first_chunk, completion = None, None
    for ref in gen:
        item = ray.get(ref)
        if isinstance(item, TextChunk) and first_chunk is None:
            first_chunk = time.time()
        elif isinstance(item, Completion):
            completion = item
    if completion is None or first_chunk is None:
        raise RuntimeError("the actor's stream ended without a token and a Completion")
    return completion, first_chunk


def first_token(ray: Any, gen: Any) -> float:
    """Drain an actor stream; when its first TextChunk reached the caller."""
    first = None
    for ref in gen:
        if isinstance(ray.get(ref), TextChunk) and first is None:
            first = time.time()
    if first is None:
        raise RuntimeError("the actor's stream ended without a token")
    return first


def wait_gone(ray: Any, name: str, namespace: str, timeout: float = 30.0) -> None:
    """Until the actor `name` has exited (its name is free again), or TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"actor {name} still alive {timeout} s after its request ended")


def kill(ray: Any, actor: Any) -> None:
    """Kill `actor` if it is still there; one already gone is the normal case."""
    try:
        ray.kill(actor)
    except Exception:  # already gone: the normal case
        pass
