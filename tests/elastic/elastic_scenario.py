"""Elastic capacity on Ray's own autoscaler, run in a subprocess by test_elastic.py (and with a longer step
load by benchmarks/bench_elastic.py); prints one `ZQ-RESULT {json}` line.

The cluster is Ray's fake multi-node autoscaling cluster (autoscaling_cluster.py): the real
autoscaler launches worker "nodes" (local raylets) of one type, each declaring one `zq_slot`,
and terminates them when idle. The head has no slot. The app's slots are `kind: resource`, and
its capacity planner may ask for `--max-slots` of them.

  1. Load: a client offers `--rate` requests a second (each in a thread of its own, so that one
     slow answer does not slow the offered rate) for `--load-s` seconds, or until `--served`
     requests were served when `--load-s` is 0. The first ones find no slot: refused at once,
     quoting the node's start; the planner asks Ray; a node joins; its slot reaches the registry
     from Ray's node table; requests are served on it — with no redeploy.
  2. Idle: no request; the node's actors retire, the planner lowers its ask, and the autoscaler
     removes the idle node; the registry forgets its slot. Watched until then or `--idle-watch-s`.

With `--idle-before-s`, the cluster is watched idle first (at `--min-slots`, which the autoscaler's
`min_workers` bring up before the clock starts). Every request's status, retry-after and timings,
and a timeline of the registry's capacity
status and Ray's nodes (every 0.5 s) go into the result.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

NAMESPACE = "zq-elastic-tests"
MODEL = "zq-tiny"


def _post(base: str, t0: float, max_tokens: int) -> dict:
    import httpx

    sent = time.monotonic()
    record = {"sent_s": round(sent - t0, 3)}
    try:
        r = httpx.post(f"{base}/v1/messages", timeout=120, json={
            "model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi there"}]})
        body = r.json()
    except (httpx.HTTPError, ValueError) as e:
        return record | {"status": None, "error": repr(e), "took_s": round(time.monotonic() - sent, 3)}
    error = body.get("error") if isinstance(body, dict) else None
    return record | {
        "status": r.status_code,
        "took_s": round(time.monotonic() - sent, 3),
        "retry_after": float(r.headers["retry-after"]) if "retry-after" in r.headers else None,
        "tier": r.headers.get("x-request-tier"),
        "error_type": error.get("type") if isinstance(error, dict) else None,
    }


def _timeline(registry, t0: float) -> dict:
    import ray

    status = ray.get(registry.capacity_status.remote(), timeout=30)
    snap = ray.get(registry.snapshot.remote(), timeout=30)
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("zq_slot")]
    return {"t": round(time.monotonic() - t0, 2), "wanted": status.num_wanted, "needed": status.num_needed,
            "present": status.num_present, "nodes_pending": status.num_nodes_pending,
            "slot_nodes": len(nodes), "actors": sorted(a.state for a in snap.actors),
            "rows": sum(a.num_rows for a in snap.actors), "refused_for_capacity": status.num_refused_for_capacity}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rate", type=float, default=2.0, help="requests offered per second during the load")
    parser.add_argument("--load-s", type=float, default=0.0, help="0: until --served requests were served")
    parser.add_argument("--served", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-slots", type=int, default=1)
    parser.add_argument("--slots-per-node", type=int, default=1)
    parser.add_argument("--idle-timeout-min", type=float, default=0.1, help="the autoscaler's idle timeout")
    parser.add_argument("--idle-watch-s", type=float, default=90.0)
    parser.add_argument("--node-start-s", type=float, default=5.0, help="the planner's predicted node start")
    parser.add_argument("--idle-before-s", type=float, default=0.0, help="watched with no load, before it")
    parser.add_argument("--min-slots", type=int, default=0, help="the planner's, and the workers' min_workers")
    parser.add_argument("--max-batch", type=int, default=32, help="rows a hot actor runs at most")
    parser.add_argument("--poisson", action="store_true", help="exponential gaps between arrivals (else even)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paced", action="store_true",
                        help="rows held for device time (paced_actor.py), not the host CPU's decode alone")
    parser.add_argument("--max-idle-s", type=float, default=3.0, help="an idle hot actor retires after this")
    parser.add_argument("--demand-window-s", type=float, default=5.0, help="the planner's")
    parser.add_argument("--scale-down-delay-s", type=float, default=5.0, help="the planner's")
    args = parser.parse_args()

    import ray
    from ray import serve

    from serve_app.app import Ingress
    from serve_app.config import AppArgs, ingress_config
    from serve_app.ray_cluster.cluster import RayClusterSpec
    from tests.elastic.autoscaling_cluster import FakeAutoscalingCluster
    from tests.elastic.paced_actor import PacedActor
    from tests.helpers import emit_result, end_scenario
    from weights_tool.pack import pack
    from weights_tool.synth import synthesize

    t_start = time.monotonic()
    result: dict = {"args": vars(args), "phases": {}}
    tmp = Path(tempfile.mkdtemp(prefix="zq-elastic-"))
    zqs = pack(synthesize("tiny", tmp / "hf", dtype="float32", seed=3), tmp / "tiny.zqs")
    # The head runs Serve, the ingress and the registry (2 logical CPUs, no slot); a worker node is one
    # logical CPU per slot, exactly its actors'.
    cluster = FakeAutoscalingCluster({"CPU": 2}, {"slot_worker": {
        "resources": {"CPU": args.slots_per_node, "zq_slot": args.slots_per_node}, "node_config": {},
        "min_workers": args.min_slots // args.slots_per_node, "max_workers": args.max_slots // args.slots_per_node}},
        idle_timeout_minutes=args.idle_timeout_min)
    try:
        address = cluster.start()
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
        base = f"http://127.0.0.1:{args.port}"
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": args.port})
        parsed = AppArgs.model_validate({
            "models": [{"id": MODEL, "zqs_path": str(zqs)}],
            "slots": {"kind": "resource", "resource": "zq_slot", "cpu_slot_bytes": 1 << 30},
            # Idle hot actors retire soon (--max-idle-s), so that an idle node empties; no warm pool to hold one.
            # Every slot may keep a hot actor: a slot's next request does not pay a process start.
            "policy": {"max_idle_s": args.max_idle_s, "num_warm_short_actors": 0, "num_warm_long_actors": 0,
                       "max_batch": args.max_batch, "max_hot_short_actors": args.max_slots},
            "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
            "capacity": {"is_enabled": True, "min_slots": args.min_slots, "max_slots": args.max_slots, "interval_s": 0.5,
                         "node_start_s": args.node_start_s, "demand_window_s": args.demand_window_s,
                         "scale_down_delay_s": args.scale_down_delay_s},
            # Longer than the whole run: a joining or draining node is seen in the node table each heartbeat.
            "slot_refresh_s": 600.0,
            "namespace": NAMESPACE,
        })
        spec = RayClusterSpec(actor_cls=PacedActor) if args.paced else RayClusterSpec()
        serve.run(Ingress.options(num_replicas=1).bind(ingress_config(parsed), cluster=spec),
                  name="zeroqueue-elastic", route_prefix="/")
        registry = ray.get_actor("zq-registry", namespace=NAMESPACE)
        t0 = time.monotonic()
        result["phases"]["app_up_s"] = round(t0 - t_start, 2)
        result["timeline"] = timeline = [_timeline(registry, t0)]
        while len([n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("zq_slot")]) * \
                args.slots_per_node < args.min_slots and time.monotonic() < t0 + 120:
            time.sleep(0.5)  # the autoscaler's min_workers come up first
        t0 = time.monotonic()

        # ---- load -------------------------------------------------------------------------
        requests: list[dict] = []
        lock = threading.Lock()
        stop_watch = threading.Event()

        def send() -> None:
            r = _post(base, t0, args.max_tokens)
            with lock:
                requests.append(r)

        def watch() -> None:
            while not stop_watch.wait(0.5):
                try:
                    timeline.append(_timeline(registry, t0))
                except Exception as e:  # recorded: the test reads the timeline
                    timeline.append({"t": round(time.monotonic() - t0, 2), "error": repr(e)})

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        time.sleep(args.idle_before_s)
        result["phases"]["load_start_s"] = round(time.monotonic() - t0, 2)
        senders = []
        rng = random.Random(args.seed)
        next_at = time.monotonic()
        deadline = next_at + (args.load_s or 120.0)
        while time.monotonic() < deadline:
            with lock:
                if not args.load_s and sum(r["status"] == 200 for r in requests) >= args.served:
                    break
            senders.append(threading.Thread(target=send, daemon=True))
            senders[-1].start()
            next_at += rng.expovariate(args.rate) if args.poisson else 1 / args.rate
            time.sleep(max(0.0, next_at - time.monotonic()))
        for s in senders:
            s.join(timeout=120)
        t_load_end = time.monotonic() - t0
        result["phases"]["load_end_s"] = round(t_load_end, 2)

        # ---- idle -------------------------------------------------------------------------
        idle_deadline = time.monotonic() + args.idle_watch_s
        while time.monotonic() < idle_deadline:
            last = timeline[-1]
            if "error" not in last and last["t"] > t_load_end and last["slot_nodes"] == 0 and last["present"] == 0:
                break
            time.sleep(0.5)
        stop_watch.set()
        watcher.join(timeout=30)
        names = ray.util.list_named_actors(all_namespaces=True)
        result.update(
            requests=sorted(requests, key=lambda r: r["sent_s"]),
            named_actors=sorted(a["name"] for a in names if a["namespace"] == NAMESPACE),
            final=_timeline(registry, t0),
        )
        result["phases"]["total_s"] = round(time.monotonic() - t_start, 2)
        return emit_result(result)
    finally:
        end_scenario(cluster, tmp)


if __name__ == "__main__":
    sys.exit(main())
