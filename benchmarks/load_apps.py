"""The three systems under load: deploy each on the benchmark's Serve instance, warm it, settle it, remove it.

All are built from the same builder arguments (zeroqueue's args in `benchmarks/load.yaml`),
so they serve the same model on the same slots with the same batched engine; each runs
alone while it is measured.

- `zeroqueue`: serve_app's ingress, no queue (503 at once).
- `queue-unbounded`: benchmarks/baseline, Serve's default unbounded queue in front of one
  replica per slot taking `max_batch` requests at once.
- `queue-bounded`: the same, with Serve's `max_queued_requests` = slots x max_batch: one
  more full batch per replica may wait, beyond which Serve itself answers 503. A careful
  operator picks about that: the last request in a full queue waits for about one batch's
  service time (a full batch turns over once in c / X seconds, X the saturation throughput,
  ~1-2 s on this machine), within a 2 s TTFT SLO, while a longer queue only adds requests
  that will miss it.
- `queue-ongoing-N` (`--queue-ongoing`): the unbounded queue with each replica taking N requests at once
  (its engine's `max_batch` = `max_ongoing_requests` = N) instead of zeroqueue's max_batch. With
  `queue-unbounded` these are the queue's configurations; the report compares zeroqueue against the best
  of them by its own goodput (issue 23), not only against the queue at zeroqueue's settings.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger(__name__)

# zeroqueue's registry and request actors live here, away from any other cluster user's.
NAMESPACE = "zeroqueue-bench-load"
ZEROQUEUE, UNBOUNDED, BOUNDED = "zeroqueue", "queue-unbounded", "queue-bounded"
# The order they run in: the unbounded baseline first, since its measured capacity sets
# every offered load.
RUN_ORDER = (UNBOUNDED, ZEROQUEUE, BOUNDED)
# The unbounded queue's other `max_ongoing_requests` the benchmark tries by default: issue 23's {8, 12, 16}
# (benchmarks/load.yaml's max_batch, 32, is only zeroqueue's safety cap: the baselines also run at it).
QUEUE_ONGOING = (8, 12, 16)
ONGOING_PREFIX = "queue-ongoing-"


def ongoing_system(n: int) -> str:
    return f"{ONGOING_PREFIX}{n}"


# The order reports list them in.
SYSTEMS = (ZEROQUEUE, UNBOUNDED, BOUNDED, *map(ongoing_system, QUEUE_ONGOING))


def run_order(queue_ongoing: tuple[int, ...]) -> tuple[str, ...]:
    """RUN_ORDER, then the unbounded queue at each of `queue_ongoing`."""
    return (*RUN_ORDER, *map(ongoing_system, queue_ongoing))


def max_ongoing(system: str, args: dict[str, Any]) -> int:
    """What one replica (or zeroqueue actor) of `system` runs at once: its batch."""
    from serve_app.policy import PolicyConfig

    if system.startswith(ONGOING_PREFIX):
        return int(system.removeprefix(ONGOING_PREFIX))
    return PolicyConfig(**args.get("policy", {})).max_batch


@dataclass(frozen=True)
class Probe:
    """A request the harness sends outside the measurement (warm-up, settling)."""

    model: str
    prompts: dict[str, str]  # class -> prompt text
    max_tokens: dict[str, int]

    def body(self, cls: str, stream: bool = False) -> dict[str, Any]:
        return {"model": self.model, "max_tokens": self.max_tokens[cls], "stream": stream, "seed": 1,
                "messages": [{"role": "user", "content": self.prompts[cls]}]}


def bounded_queue(args: dict[str, Any]) -> int:
    """The bounded baseline's `max_queued_requests`: slots x max_batch (one more full batch per replica)."""
    return places(args)


def places(args: dict[str, Any], system: str = ZEROQUEUE) -> int:
    """c: requests the slots run at once, slots x max_batch (CPU slots: this benchmark runs on CPUs); for a
    `queue-ongoing-N`, slots x N."""
    return int(args.get("slots", {}).get("num_cpu_slots", 2)) * max_ongoing(system, args)


def deploy(app: str, args: dict[str, Any]) -> None:
    """Build and run `app` at route `/`; returns once its replicas are up."""
    from ray import serve

    if app == ZEROQUEUE:
        from serve_app.app import build_app

        built = build_app({**args, "namespace": NAMESPACE})
    else:
        from benchmarks.baseline.app import UNBOUNDED as SERVE_UNBOUNDED
        from benchmarks.baseline.app import build_app

        queue = {"max_queued_requests": bounded_queue(args) if app == BOUNDED else SERVE_UNBOUNDED}
        if app.startswith(ONGOING_PREFIX):
            queue["max_ongoing_requests"] = max_ongoing(app, args)
        built = build_app({**args, "baseline": queue})
    t0 = time.monotonic()
    serve.run(built, name=app, route_prefix="/")
    log.info("%s deployed in %.1f s", app, time.monotonic() - t0)


def undeploy(app: str) -> None:
    """Delete the app, then every actor it left in the benchmark's namespace (detached actors outlive it)."""
    from ray import serve

    serve.delete(app)
    kill_namespace_actors()


def kill_namespace_actors(namespace: str = NAMESPACE) -> None:
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == namespace:
            try:
                ray.kill(ray.get_actor(a["name"], namespace=namespace))
            except ValueError:
                pass  # it exited between the listing and the kill


def warm_up(base: str, probe: Probe, slots: int) -> None:
    """`slots` short requests at once: the app answers and has run the model; the closed-loop
    capacity measurement that follows warms every row (and spawns zeroqueue's hot actors)."""
    with ThreadPoolExecutor(slots) as pool:
        statuses = list(pool.map(_post, [base] * slots, [probe.body("short")] * slots))
    log.info("warm-up: %s", statuses)


def settle(app: str, base: str, probe: Probe, fast_s: float, slots: int, deadline_s: float = 90.0) -> float:
    """Wait until the app is idle again after a scenario (nothing of it carries into the next); returns the wait.

    zeroqueue says so itself (/health: no request running on any row, no actor starting).
    The baselines cannot, so `slots` short requests at once must all come back within
    `fast_s`: none of them waited behind leftover work on any replica.
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if app == ZEROQUEUE:
            try:
                health = httpx.get(f"{base}/health", timeout=5).json()
                idle = health["rows"] == 0 and health["actors"].get("starting", 0) == 0
            except (httpx.HTTPError, ValueError, KeyError):
                idle = False
        else:
            with ThreadPoolExecutor(slots) as pool:
                results = list(pool.map(lambda _: _timed_post(base, probe.body("short")), range(slots)))
            idle = all(status == 200 and took <= fast_s for status, took in results)
        if idle:
            return time.monotonic() - t0
        time.sleep(0.5)
    log.warning("%s did not settle within %.0f s; the next scenario starts anyway", app, deadline_s)
    return time.monotonic() - t0


def wait_ready(base: str, timeout_s: float = 120.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base}/health did not answer 200 within {timeout_s:.0f} s")


def _post(base: str, body: dict) -> int:
    try:
        return httpx.post(f"{base}/v1/messages", json=body, timeout=120).status_code
    except httpx.HTTPError:
        return 0


def _timed_post(base: str, body: dict) -> tuple[int, float]:
    t0 = time.monotonic()
    status = _post(base, body)
    return status, time.monotonic() - t0
