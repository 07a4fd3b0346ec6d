"""The ingress's gauges reach Prometheus from its own heartbeat, with no /health call to set them.

A deployment of its own that nothing polls: after two requests (one cold, one on the hot actor
the first left), its replica exports zq_actors for every state with the idle hot actor in it,
zq_free_slots, zq_rows and zq_batch_occupancy, and zq_admissions_total by tier. Its replica's
series are told from other modules' by the WorkerId label of its admissions, whose model id
only this module serves.
"""

from __future__ import annotations

import httpx

from serve_app.snapshot import ACTOR_STATES
from tests.helpers import SERVE_PORT, metrics_export_port
from tests.reliability import harness
from tests.reliability.harness import call
from tests.serve.waiting import wait_for

NAMESPACE = "zq-metrics-export-tests"
PORT = SERVE_PORT
MODEL = "zq-metrics-export"


def _series(ray) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every ray_zq_ line in this node's Prometheus export."""
    port = metrics_export_port(ray)
    out = []
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        if line.startswith("ray_zq_"):
            head, value = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            pairs = (p.split("=", 1) for p in labels.rstrip("}").split(",") if "=" in p)
            out.append((name, {k: v.strip('"') for k, v in pairs}, float(value)))
    return out


def _replica_gauges(ray) -> dict[tuple[str, str], float] | None:
    """(name, state) -> value of the gauges this module's replica exports; None until it has exported them all."""
    series = _series(ray)
    workers = {labels["WorkerId"] for name, labels, _ in series
               if name == "ray_zq_admissions_total" and labels.get("model") == MODEL}
    if len(workers) != 1:
        return None
    gauges = {(name, labels.get("state", "")): value for name, labels, value in series
              if labels["WorkerId"] in workers and name in ("ray_zq_actors", "ray_zq_free_slots", "ray_zq_rows",
                                                            "ray_zq_batch_occupancy")}
    tiers = {labels["tier"]: value for name, labels, value in series
             if name == "ray_zq_admissions_total" and labels.get("model") == MODEL}
    # Each series reaches the export on its own cycle: wait for the idle actor and both admissions' tiers.
    is_complete = gauges.get(("ray_zq_actors", "idle")) and {"cold", "hot"} <= tiers.keys()
    return gauges | {("tier", t): v for t, v in tiers.items()} if is_complete else None


def test_gauges_are_exported_from_the_heartbeat_without_any_health_call(ray_cluster, tiny_zqs):
    ray = ray_cluster
    base = harness.deploy(PORT, "zeroqueue-metrics-export", NAMESPACE, tiny_zqs,
                          models=[{"id": MODEL, "zqs_path": str(tiny_zqs)}], policy={"max_hot_short_actors": 1})
    try:
        for _ in range(2):
            ending = call(base, {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert ending.is_complete, ending
        # Ray's exporter reports every few seconds; the heartbeat sets the gauges every second.
        wait_for(lambda: _replica_gauges(ray) is not None, 60, "the replica's gauges with the idle hot actor")
        gauges = _replica_gauges(ray)
        assert {s for name, s in gauges if name == "ray_zq_actors"} == set(ACTOR_STATES), gauges
        assert gauges[("ray_zq_actors", "idle")] == 1 and gauges[("ray_zq_rows", "")] == 0
        assert gauges[("ray_zq_free_slots", "")] == 1  # two slots, one holding the hot actor
        assert gauges[("ray_zq_batch_occupancy", "")] == 0  # nothing busy
        assert gauges[("tier", "cold")] == 1 and gauges[("tier", "hot")] == 1
    finally:
        harness.undeploy(ray, NAMESPACE)
