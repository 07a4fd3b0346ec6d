"""The node-loss scenario, run in a subprocess by test_node_loss.py; prints one `ZQ-RESULT {json}` line.

It needs a Ray cluster of its own (two nodes, `ray.cluster_utils.Cluster`), which cannot
live in a pytest process that already holds the session's local Ray. Slots are `kind: resource`
(one per unit of `zq_slot` on any node) and the capacity planner is on, with no autoscaler: the
scenario plays the autoscaler by hand, adding the node the planner asks for.

  1. A head node with one `zq_slot`, and a tiny model packed into a temp dir.
  2. Serve with the app on the head only (`proxy_location="HeadOnly"`); the ingress is
     placed while the head is the only node, so it and the registry stay there.
  3. Pairs of concurrent requests (`max_batch: 1`: a pair needs two slots) until one is refused
     and the planner asks Ray for a second slot (`capacity_status`); then a worker node with
     the bundle it asked for joins. Its slot reaches the registry from Ray's node table — no
     redeploy, no slot registered by hand.
  4. Pairs until a hot actor is idle on the worker node's slot (`max_hot_short_actors: 2`,
     so both slots keep one).
  5. Under load: two streams held open before their last event (the fault actor's `gate:`), one
     on each node. The worker is drained (a preemption): its slot leaves the registry while its
     stream runs on, and a request then is refused, not placed there. Then the worker node is
     removed while both stream: the worker's stream must end with an error event; the head's
     completes once the gate opens.
  6. Pairs of concurrent requests while another thread polls the registry's snapshot, until
     the lost slot is gone and requests are served again (or a deadline). Every status is
     recorded with its time since the removal.
  7. A second worker added by hand: a gated answer collected whole runs on it (the head's actor
     holds a gated stream), the head's stream ends, and the node is removed: the collected request
     is decided again and served on the head.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the fault actor's module, for this driver and (through it) Ray's workers

NAMESPACE = "zq-node-loss-tests"
APP = "zeroqueue-node-loss"
MODEL = "zq-tiny"
SLOT_GONE_S = 30.0  # the longest the registry takes to drop a removed node's slot (test_node_loss's bound is less)


def _post(base: str, timeout_s: float, prompt: str = "hi") -> dict:
    import httpx

    t0 = time.monotonic()
    try:
        r = httpx.post(f"{base}/v1/messages", timeout=timeout_s, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": prompt}]})
    except httpx.HTTPError as e:  # no answer at all: recorded, the test fails on it
        return {"status": None, "error": repr(e), "took_s": time.monotonic() - t0}
    try:
        body = r.json()
    except ValueError:
        body = {"raw": r.text[:500]}
    error = body.get("error") if isinstance(body, dict) else None
    return {
        "status": r.status_code,
        "took_s": round(time.monotonic() - t0, 3),
        "request_id_header": r.headers.get("request-id"),
        "request_id_body": body.get("request_id") if isinstance(body, dict) else None,
        "error_type": error.get("type") if isinstance(error, dict) else None,
        "error_message": error.get("message") if isinstance(error, dict) else None,
        "tier": r.headers.get("x-request-tier"),
        "retry_after": r.headers.get("retry-after"),
        "raw": body.get("raw") if isinstance(body, dict) else None,
    }


def _stream(base: str, prompt: str, first: threading.Event) -> dict:
    """One streamed request: its SSE event names in order, and an error event's type; `first` is set at its
    first text delta (the stream is computing on its actor)."""
    import httpx

    events, error_type = [], None
    try:
        with httpx.stream("POST", f"{base}/v1/messages", timeout=120, json={
                "model": MODEL, "max_tokens": 8, "stream": True,
                "messages": [{"role": "user", "content": prompt}]}) as r:
            status = r.status_code
            for line in r.iter_lines():
                if line.startswith("event: "):
                    events.append(line.removeprefix("event: "))
                    if events[-1] == "content_block_delta":
                        first.set()
                elif line.startswith("data: ") and events and events[-1] == "error":
                    error_type = json.loads(line.removeprefix("data: "))["error"]["type"]
    except httpx.HTTPError as e:
        return {"status": None, "error": repr(e), "events": events}
    finally:
        first.set()  # a stream that never started must not hold the scenario up
    return {"status": status, "events": events, "error_type": error_type}


def _reached(condition, timeout_s: float) -> float | None:
    """Seconds until `condition` held (tests/serve/waiting.py's wait), or None if it did not within
    `timeout_s`: the scenario records what it saw and the test judges it."""
    from tests.serve.waiting import wait_for

    t0 = time.monotonic()
    try:
        wait_for(condition, timeout_s)
    except AssertionError:
        return None
    return round(time.monotonic() - t0, 2)


def _slot_ids(ray, registry) -> list[str]:
    return [v.slot_id for v in ray.get(registry.snapshot.remote(), timeout=30).slots]


def _pair(pool: ThreadPoolExecutor, base: str, timeout_s: float) -> list[dict]:
    return list(pool.map(lambda _: _post(base, timeout_s), range(2)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--observe-s", type=float, default=30.0, help="longest watch after the removal")
    parser.add_argument("--min-ok-after", type=int, default=2, help="200s after the slot is gone, then stop")
    args = parser.parse_args()

    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serve_app.app import Ingress
    from serve_app.config import AppArgs, ingress_config
    from serve_app.ray_cluster.cluster import RayClusterSpec
    from tests.helpers import emit_result, end_scenario
    from tests.reliability.faults import FaultyActor
    from weights_tool.pack import pack
    from weights_tool.synth import synthesize

    t_start = time.monotonic()
    result: dict = {"phases": {}}
    tmp = Path(tempfile.mkdtemp(prefix="zq-node-loss-"))
    zqs = pack(synthesize("tiny", tmp / "hf", dtype="float32", seed=3), tmp / "tiny.zqs")

    # Logical CPUs: the head's 2 cover its request slot (1) and Ray's own 0-CPU actors;
    # the worker's 1 is exactly its one slot. Dashboard agent ports are left to the OS, so
    # a Ray already running on this machine (the test session's) never collides.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"zq_slot": 1}, "include_dashboard": False,
        "dashboard_agent_listen_port": None})
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
        head_id = ray.get_runtime_context().get_node_id()
        base = f"http://127.0.0.1:{args.port}"
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": args.port})
        parsed = AppArgs.model_validate({
            "models": [{"id": MODEL, "zqs_path": str(zqs)}],
            "slots": {"kind": "resource", "resource": "zq_slot", "cpu_slot_bytes": 1 << 30},
            # Two hot actors: the warm-up leaves an idle one on each node's slot. One row per
            # actor: the remaining node's actor is full with one request, as a loaded cluster's
            # would be, so the other request of a pair is the one that meets the lost node.
            "policy": {"max_hot_short_actors": 2, "max_batch": 1},
            "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
            "capacity": {"is_enabled": True, "min_slots": 1, "max_slots": 2, "interval_s": 0.5,
                         "node_start_s": 5.0, "demand_window_s": 10.0, "scale_down_delay_s": 600.0},
            # Longer than the whole run: a joining or draining node is seen in the node table each heartbeat.
            "slot_refresh_s": 600.0,
            "namespace": NAMESPACE,
        })
        serve.run(Ingress.options(num_replicas=1).bind(ingress_config(parsed),
                                                       cluster=RayClusterSpec(actor_cls=FaultyActor)),
                  name=APP, route_prefix="/")
        result["phases"]["app_up_s"] = round(time.monotonic() - t_start, 2)
        registry = ray.get_actor("zq-registry", namespace=NAMESPACE)
        pool = ThreadPoolExecutor(max_workers=3)

        # ---- the planner asks for a slot; a node with its bundle joins ------------------
        asked: list[dict] = []
        status = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            asked += _pair(pool, base, 60)
            status = ray.get(registry.capacity_status.remote(), timeout=30)
            if status.num_wanted == 2:
                break
            time.sleep(0.5)
        result["asked"] = asked
        result["status_before_node"] = [status.num_wanted, status.num_present, status.num_nodes_pending,
                                        [dict(b) for b in status.bundles]] if status is not None else None
        if status is None or status.num_wanted != 2:
            result["error"] = f"the planner never asked for a second slot: {status}"
            return emit_result(result)
        extra = {k: v for k, v in status.bundles[-1].items() if k != "CPU"}
        worker = cluster.add_node(num_cpus=1, resources=extra)
        cluster.wait_for_nodes()
        worker_id = worker.node_id
        assert worker_id != head_id
        worker_slot = f"{worker_id}/zq_slot0"
        seen_s = _reached(lambda: worker_slot in _slot_ids(ray, registry), 30)
        result.update(head_node=head_id, worker_node=worker_id, worker_slot=worker_slot, worker_slot_seen_s=seen_s)
        if seen_s is None:
            result["error"] = f"the worker's slot never reached the registry: {_slot_ids(ray, registry)}"
            return emit_result(result)

        warmup: list[dict] = []
        on_worker = None
        for _ in range(6):
            warmup += _pair(pool, base, 60)
            snap = ray.get(registry.snapshot.remote(), timeout=30)
            on_worker = next((a for a in snap.actors if a.slot_id == worker_slot), None)
            if on_worker is not None and on_worker.state == "idle":
                break
        result["warmup"] = warmup
        result["actors_before"] = [(a.name, a.slot_id, a.state, a.is_hot) for a in snap.actors]
        if on_worker is None:
            result["error"] = "no actor ever ran on the worker node's slot"
            return emit_result(result)
        result["phases"]["worker_actor_s"] = round(time.monotonic() - t_start, 2)

        # ---- under load: a stream on each node, then the worker node goes --------------
        gate = tmp / "go"
        firsts = [threading.Event(), threading.Event()]
        streams = [pool.submit(_stream, base, f"hold gate:{gate} {i}", firsts[i]) for i in range(2)]
        for first in firsts:
            first.wait(120)

        # ---- the worker is drained first (a preemption with a deadline, as `ray drain-node` or KubeRay
        # before a pod's deletion): it leaves admission while its stream runs on ----------------------
        from ray.core.generated import autoscaler_pb2

        gcs = ray._raylet.GcsClient(address=cluster.address)
        result["drain_accepted"] = list(gcs.drain_node(
            worker_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), "node-loss scenario",
            int(time.time() * 1000) + 120_000))
        result["drained_slot_gone_s"] = _reached(lambda: worker_slot not in _slot_ids(ray, registry), 30)
        time.sleep(2.5)  # two more reconcile passes: a booked actor on the draining node is no orphan in either
        result["streams_open_after_drain"] = [not f.done() for f in streams]
        # The head's one slot holds its stream (one row an actor) and the worker is out of admission: refused.
        result["during_drain"] = _post(base, 60)

        slots_seen: list[tuple[float, list[str]]] = []
        stop = threading.Event()
        t_removed = [0.0]

        def poll_slots() -> None:
            while not stop.is_set():
                try:
                    s = ray.get(registry.snapshot.remote(), timeout=10)
                    slots_seen.append((round(time.monotonic() - t_removed[0], 3), [v.slot_id for v in s.slots]))
                except Exception as e:  # recorded; the test fails if the slot is never seen gone
                    slots_seen.append((round(time.monotonic() - t_removed[0], 3), [f"error: {e!r}"]))
                stop.wait(0.25)

        t0 = time.monotonic()
        cluster.remove_node(worker)
        t_removed[0] = time.monotonic()
        result["remove_node_took_s"] = round(t_removed[0] - t0, 3)
        poller = threading.Thread(target=poll_slots, daemon=True)
        poller.start()
        time.sleep(2.0)  # the worker's stream has met its dead actor (Ray notices a dead node within this)
        gate.touch()
        result["streams"] = [f.result(timeout=120) for f in streams]

        after: list[dict] = []
        deadline = t_removed[0] + args.observe_s
        while time.monotonic() < deadline:
            t_sent = round(time.monotonic() - t_removed[0], 3)
            for r in _pair(pool, base, 60):
                r["sent_s"] = t_sent
                after.append(r)
            gone = [t for t, ids in slots_seen if ids and worker_slot not in ids and not ids[0].startswith("error")]
            ok_after_gone = [r for r in after if gone and r["status"] == 200 and r["sent_s"] >= gone[0]]
            if len(ok_after_gone) >= args.min_ok_after:
                break
            time.sleep(0.2)
        stop.set()
        poller.join(timeout=15)

        # ---- a second node added by hand: an answer collected whole is retried when its node goes --------
        # The head's actor takes a gated stream, so the next request spawns an actor on the new node's slot;
        # that node goes while the request is there (its actor starting, or computing up to its gate), after
        # the head's stream ended: decided again, it is served by the head's hot actor, and its client sees
        # only the 200.
        second = cluster.add_node(num_cpus=1, resources={"zq_slot": 1})
        cluster.wait_for_nodes()
        second_slot = f"{second.node_id}/zq_slot0"
        result["second_slot_seen"] = _reached(lambda: second_slot in _slot_ids(ray, registry), 30) is not None
        gate_head, gate_second = tmp / "go-head", tmp / "go-second"
        first = threading.Event()
        held = pool.submit(_stream, base, f"hold gate:{gate_head} head", first)
        first.wait(120)
        collected = pool.submit(_post, base, 120, f"hold gate:{gate_second} second")
        result["collected_on_second"] = _reached(lambda: any(
            a.slot_id == second_slot and a.num_rows for a in ray.get(registry.snapshot.remote(), timeout=30).actors),
            60) is not None
        gate_head.touch()
        result["head_stream"] = held.result(timeout=120)
        cluster.remove_node(second)
        gate_second.touch()  # for the request's next attempt: its first actor is gone with the node
        result["collected"] = collected.result(timeout=120)
        result["second_slot_gone"] = _reached(lambda: second_slot not in _slot_ids(ray, registry), SLOT_GONE_S) is not None
        final = ray.get(registry.snapshot.remote(), timeout=30)
        result.update(
            after=after,
            slots_seen=slots_seen,
            final_slots=[(v.slot_id, v.node_id, v.num_actors) for v in final.slots],
            final_actors=[(a.name, a.slot_id, a.state) for a in final.actors],
        )
        pool.shutdown(wait=True)
        result["phases"]["total_s"] = round(time.monotonic() - t_start, 2)
        return emit_result(result)
    finally:
        end_scenario(cluster, tmp)


if __name__ == "__main__":
    sys.exit(main())
