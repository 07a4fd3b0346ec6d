"""The chaos soak's chaos: what it kills and when, and the ingress replicas' memory it watches.

`Chaos` kills on the plan's schedule, each target drawn (seeded) from what is alive then: a
request actor, the registry (restarted by Ray, or for good), or an ingress replica other than
the witness. `RssSampler` reads the witness's resident memory, whose pid each replica states
in its own /health.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

from actors.actor_names import REGISTRY_NAME, is_request_actor_name

log = logging.getLogger("soak")

NAMESPACE = "zeroqueue-soak"
APP = DEPLOYMENT = "zeroqueue"
SERVE_NAMESPACE = "serve"


def request_actors() -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and is_request_actor_name(a["name"]))


def ingress_replicas() -> list[str]:
    """The app's Serve replica actors: `SERVE_REPLICA::<app>#<deployment>#<id>` in Serve's namespace."""
    import ray

    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == SERVE_NAMESPACE and a["name"].startswith("SERVE_REPLICA::"):
            parts = a["name"].split("::", 1)[1].split("#")
            if len(parts) == 3 and parts[0] == APP and parts[1] == DEPLOYMENT:
                out.append(a["name"])
    return sorted(out)


def replica_pids(base: str, names: list[str], max_tries: int = 40) -> dict[str, int]:
    """name -> pid of the alive replicas among `names`, as each replica says itself in /health
    (`replica.id` is the last part of its actor's name); asked until every one has answered once."""
    import httpx

    by_id = {name.rsplit("#", 1)[-1]: name for name in names}
    pids: dict[str, int] = {}
    for _ in range(max_tries):
        if len(pids) == len(by_id):
            break
        try:
            replica = httpx.get(f"{base}/health", timeout=5).json()["replica"]
        except (httpx.HTTPError, KeyError, ValueError):  # a replica just killed, or the registry restarting
            continue
        if replica["id"] in by_id:
            pids[by_id[replica["id"]]] = replica["pid"]
    return pids


def rss(pid: int) -> int | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


def kill_actor(name: str, namespace: str, no_restart: bool) -> tuple[str, str]:
    import ray

    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return name, "no target"
    ray.kill(handle, no_restart=no_restart)
    return name, "killed"


class Chaos(threading.Thread):
    """Kills on the plan's schedule; each target drawn at random (seeded) from what is alive then."""

    def __init__(self, schedule: list[tuple[float, str]], seed: int, t0: float, spare: str | None) -> None:
        super().__init__(name="soak-chaos", daemon=True)
        self.schedule, self.t0, self.spare = schedule, t0, spare
        self.rng = random.Random(f"{seed}/targets")
        self.kills: list[dict[str, Any]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        for t, kind in self.schedule:
            if self.stop_event.wait(max(0.0, self.t0 + t - time.monotonic())):
                return
            at = time.monotonic() - self.t0
            try:
                target, result = self._kill(kind)
            except Exception as e:  # a kill that fails is recorded, and the chaos goes on
                target, result = None, f"failed: {type(e).__name__}: {e}"
            self.kills.append({"t": at, "kind": kind, "target": target, "result": result})
            log.info("chaos %.1f s: %s %s: %s", at, kind, target, result)

    def _kill(self, kind: str) -> tuple[str | None, str]:
        if kind == "actor":
            names = request_actors()
            return kill_actor(self.rng.choice(names), NAMESPACE, True) if names else (None, "no target")
        if kind in ("registry_restart", "registry_gone"):
            return kill_actor(REGISTRY_NAME, NAMESPACE, kind == "registry_gone")
        names = [n for n in ingress_replicas() if n != self.spare]
        return kill_actor(self.rng.choice(names), SERVE_NAMESPACE, False) if names else (None, "no target")


class RssSampler(threading.Thread):
    """The witness replica's resident memory every few seconds: its peak over the load."""

    def __init__(self, pid: int | None, every_s: float = 5.0) -> None:
        super().__init__(name="soak-rss", daemon=True)
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while self.pid is not None and not self.stop_event.wait(self.every_s):
            self.peak = max(self.peak, rss(self.pid) or 0)
