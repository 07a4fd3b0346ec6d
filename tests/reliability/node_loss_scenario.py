"""The node-loss scenario, run in a subprocess by test_node_loss.py; prints one `ZQ-RESULT {json}` line.

It needs a Ray cluster of its own (two nodes, `ray.cluster_utils.Cluster`), which cannot
live in a pytest process that already holds the session's local Ray.

  1. A head node (CPU slot of the app) and a tiny model packed into a temp dir.
  2. Serve with the app on the head only (`proxy_location="HeadOnly"`); the ingress is
     placed while the head is the only node, so it and the registry stay there.
  3. A worker node joins; its CPU slot is registered with the registry directly
     (`register_slots`), since the app's CPU slots are discovered on the ingress's node
     only and nothing in its args places replicas per node.
  4. Pairs of concurrent requests until a hot actor is idle on the worker node's slot
     (`max_hot_short_actors: 2`, so both slots keep one; `max_batch: 1`, so a pair needs
     both actors, as it would on a loaded cluster).
  5. The worker node is removed; then pairs of concurrent requests while another thread
     polls the registry's snapshot, until the lost slot is gone and requests are served
     again (or a deadline). Every status is recorded with its time since the removal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NAMESPACE = "zq-node-loss-tests"
APP = "zeroqueue-node-loss"
MODEL = "zq-tiny"


def _post(base: str, timeout_s: float) -> dict:
    import httpx

    t0 = time.monotonic()
    try:
        r = httpx.post(f"{base}/v1/messages", timeout=timeout_s, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
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
        "raw": body.get("raw") if isinstance(body, dict) else None,
    }


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

    from serve_app.app import build_app
    from serve_app.registry import SlotSpec
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
        "num_cpus": 2, "resources": {"zq-node-a": 1}, "include_dashboard": False,
        "dashboard_agent_listen_port": None})
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
        head_id = ray.get_runtime_context().get_node_id()
        base = f"http://127.0.0.1:{args.port}"
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app({
            "models": [{"id": MODEL, "zqs_path": str(zqs)}],
            "slots": {"kind": "cpu", "num_cpu_slots": 1, "cpu_slot_bytes": 1 << 30},
            # Two hot actors: the warm-up leaves an idle one on each node's slot. One row per
            # actor: the remaining node's actor is full with one request, as a loaded cluster's
            # would be, so the other request of a pair is the one that meets the lost node.
            "policy": {"max_hot_short_actors": 2, "max_batch": 1},
            "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
            "namespace": NAMESPACE,
        }), name=APP, route_prefix="/")
        result["phases"]["app_up_s"] = round(time.monotonic() - t_start, 2)

        worker = cluster.add_node(num_cpus=1, resources={"zq-node-b": 1})
        cluster.wait_for_nodes()
        worker_id = worker.node_id
        assert worker_id != head_id
        registry = ray.get_actor("zq-registry", namespace=NAMESPACE)
        worker_slot = f"{worker_id[:12]}/cpu0"
        ray.get(registry.register_slots.remote([SlotSpec(worker_slot, worker_id, 1 << 30)]), timeout=30)
        result.update(head_node=head_id, worker_node=worker_id, worker_slot=worker_slot)

        pool = ThreadPoolExecutor(max_workers=3)
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
            return _emit(result)
        result["phases"]["worker_actor_s"] = round(time.monotonic() - t_start, 2)

        # ---- the loss ---------------------------------------------------------------
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
        final = ray.get(registry.snapshot.remote(), timeout=30)
        result.update(
            after=after,
            slots_seen=slots_seen,
            final_slots=[(v.slot_id, v.node_id, v.num_actors) for v in final.slots],
            final_actors=[(a.name, a.slot_id, a.state) for a in final.actors],
        )
        pool.shutdown(wait=True)
        result["phases"]["total_s"] = round(time.monotonic() - t_start, 2)
        return _emit(result)
    finally:
        try:
            serve.shutdown()
        except Exception:
            pass
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _emit(result: dict) -> int:
    print("ZQ-RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
