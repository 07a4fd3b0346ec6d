"""What the reliability tests share: deploying the ingress with injected faults, calling it, and
checking that a request ended one of the three ways and left nothing behind."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

from serve_app.sse import decode_events
from tests.helpers import is_settled, request_actors, run_app
from tests.helpers import undeploy as undeploy  # the reliability tests' `harness.undeploy(ray, namespace)`
from tests.serve.waiting import wait_for

MODEL = "zq-tiny"


def deploy(port: int, app: str, namespace: str, zqs_path: str, *, actor_cls: type | None = None,
           registry_cls: type | None = None, **args: Any) -> str:
    """The real ingress on real Serve and HTTP, with the given fault classes bound at its seam."""
    from serve_app.app import Ingress
    from serve_app.config import AppArgs, ingress_config
    from serve_app.ray_cluster.cluster import RayClusterSpec

    parsed = AppArgs.model_validate({
        "models": [{"id": MODEL, "zqs_path": str(zqs_path)}],
        "slots": {"kind": "cpu", "num_cpu_slots": 2, "cpu_slot_bytes": 1 << 30},
        "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
        "namespace": namespace,
    } | args)
    seams = {k: v for k, v in {"actor_cls": actor_cls, "registry_cls": registry_cls}.items() if v is not None}
    return run_app(port, app, Ingress.options(num_replicas=parsed.num_replicas,
                                              graceful_shutdown_timeout_s=parsed.graceful_shutdown_timeout_s)
                   .bind(ingress_config(parsed), cluster=RayClusterSpec(**seams)))


def body(text: str = "hi", max_tokens: int = 8, stream: bool = False) -> dict:
    # Seeded: unseeded, the random model may end its turn before any text, which some checks need.
    return {"model": MODEL, "max_tokens": max_tokens, "stream": stream, "seed": 3, "temperature": 0.7,
            "messages": [{"role": "user", "content": text}]}


@dataclass
class Ending:
    """How a request ended, as its client saw it."""

    status: int
    request_id: str | None  # the header
    error_type: str | None  # the JSON error's, or the stream's error event's
    error_request_id: str | None  # the one the error carries
    events: list[dict]  # a stream's events (empty for JSON)
    text: str
    seconds: float

    @property
    def is_complete(self) -> bool:
        if self.status != 200:
            return False
        return not self.events or self.events[-1]["type"] == "message_stop"


def call(base: str, payload: dict, timeout: float = 120.0, headers: dict | None = None) -> Ending:
    t0 = time.monotonic()
    r = httpx.post(f"{base}/v1/messages", json=payload, timeout=timeout, headers=headers)
    seconds = time.monotonic() - t0
    rid = r.headers.get("request-id")
    if payload.get("stream") and r.status_code == 200:
        events = decode_events(r.content)
        errors = [e for e in events if e["type"] == "error"]
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        if errors:
            return Ending(200, rid, errors[0]["error"]["type"], errors[0].get("request_id"), events, text, seconds)
        return Ending(200, rid, None, None, events, text, seconds)
    data = r.json()
    if r.status_code != 200:
        return Ending(r.status_code, rid, data["error"]["type"], data.get("request_id"), [], "", seconds)
    return Ending(200, rid, None, None, [], "".join(b["text"] for b in data["content"]), seconds)


def assert_documented_error(ending: Ending, status: int, error_type: str) -> None:
    assert (ending.status, ending.error_type) == (status, error_type), ending
    assert ending.request_id and ending.error_request_id == ending.request_id, ending


def registry(ray, namespace: str):
    return ray.get_actor("zq-registry", namespace=namespace)


def assert_nothing_left(ray, namespace: str, timeout: float = 30.0) -> None:
    """No row reserved, no actor still starting or busy, and no request actor the registry does not know.

    Bounded by the registry's reconcile (1 s) and an actor's exit after its last row, on a slow machine.
    """

    def settled() -> bool:
        return is_settled(ray.get(registry(ray, namespace).snapshot.remote(), timeout=10),
                          request_actors(ray, namespace))

    wait_for(settled, timeout, "no reservation, no busy actor and no orphan left")


def health(base: str) -> dict:
    return httpx.get(f"{base}/health", timeout=30).json()
