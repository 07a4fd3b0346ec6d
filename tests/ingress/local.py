"""The ingress on real HTTP with no Serve: uvicorn (what Serve's proxy runs) serving `IngressApp` on a
free port, from a thread of the test process — over the in-process cluster (no Ray at all), or, for
the port's contract test, over Ray's.

A test talks to `server.base` exactly as it would to a deployment; it reads the registry's books
(`books()`) through the port, and the in-process actors (`actor_names()`, `kill`) directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

from serve_app.asgi import IngressApp, Replicas
from serve_app.cluster import ClusterSpec
from serve_app.config import AppArgs, ingress_config
from serve_app.local_cluster import LocalCluster, LocalClusterSpec, LocalNode
from serve_app.snapshot import ClusterSnapshot
from tests.helpers import is_settled
from tests.serve.waiting import wait_for

MODEL = "zq-tiny"
# Two CPU slots of 1 GiB, one load and one compute thread: the deployments of tests/serve, in-process.
BASE_ARGS: dict[str, Any] = {
    "slots": {"kind": "cpu", "num_cpu_slots": 2, "cpu_slot_bytes": 1 << 30},
    "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
}


class LocalServer:
    def __init__(self, args: dict[str, Any], spec: ClusterSpec, num_replicas: int = 1) -> None:
        """`num_replicas` > 1: that many ingress replicas on one cluster (asgi.Replicas), requests dealt in turn
        or to the replica a request's `x-zq-replica` header names; `app` is the first."""
        config = ingress_config(AppArgs.model_validate(args))
        if num_replicas > 1:
            spec = dataclasses.replace(spec, node=LocalNode())
        self.apps = [IngressApp(config, spec) for _ in range(num_replicas)]
        self.app = self.apps[0]
        asgi = self.app if num_replicas == 1 else Replicas(self.apps)
        self._server = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=0, lifespan="on",
                                                     access_log=False, log_level="warning", log_config=None))
        self._thread = threading.Thread(target=self._server.run, name="zq-test-uvicorn", daemon=True)
        self._thread.start()
        wait_for(lambda: self._server.started or not self._thread.is_alive(), 60, "the local server to start")
        if not self._server.started:
            raise RuntimeError("the local server did not start (see the log)")
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"

    @property
    def cluster(self) -> LocalCluster:
        return self.app.ingress.admission.cluster

    def books(self) -> ClusterSnapshot:
        return asyncio.run_coroutine_threadsafe(self.cluster.snapshot(10.0), self.app.loop).result(timeout=30)

    def actor_names(self) -> set[str]:
        return self.cluster.actor_names()

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        """`fn()` run on the server's event loop, where the cluster lives; its result."""

        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.app.loop).result(timeout=30)

    def kill(self, name: str) -> None:
        """Kill actor `name` as a process's death would: its streams end StreamLost."""
        self.on_loop(lambda: self.cluster.kill(name))

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)


def serve_locally(zqs_path: str, actor_cls: type | None = None, num_replicas: int = 1, **args: Any) -> LocalServer:
    """`BASE_ARGS` with the tiny model as `MODEL`, and what a test changes."""
    spec = LocalClusterSpec(actor_cls) if actor_cls is not None else LocalClusterSpec()
    return LocalServer(BASE_ARGS | {"models": [{"id": MODEL, "zqs_path": str(zqs_path)}]} | args, spec, num_replicas)


def assert_nothing_left(server: LocalServer, timeout: float = 30.0) -> None:
    """No row reserved, no actor still starting or busy, and no actor alive that the books do not know."""

    def settled() -> bool:
        return is_settled(server.books(), server.actor_names())

    wait_for(settled, timeout, "no reservation, no busy actor and no orphan left")


def api_key_env(name: str, key: str) -> str:
    """Set the key's variable (the app reads it at build time); returns its name for `api_key_env`."""
    os.environ[name] = key
    return name

