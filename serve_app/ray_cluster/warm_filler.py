"""Keeping each model's warm pool full, from one background thread of the ingress.

Every `refresh_s` (or at once after `wake()`: a row ended, a warm actor was bound) the
filler asks the registry which warm actors the pools miss (`RegistryActor.fill_warm`: the
pure plan in warm_pool.py, committed with the same reservation as any actor), creates
each one on its slot's node and says so (`warm_created`: a request may be bound to it while
it warms; before, its name resolves to nothing), and, once its `ready()` answers, tells the
registry it is warm (`warm_ready`). A warm actor that dies or fails before it is ready is removed
from the registry and replaced on a later round; one that dies once ready is dropped by
the registry's reconcile (a ghost) and replaced the same way.

Nothing here is awaited by a request, and the ingress's event loop never waits on it:
creating a named actor and the registry calls are blocking GCS round trips, made on this
thread only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import ray

from serve_app.ray_cluster.registry_link import RegistryLink
from serve_app.warm_pool import WarmFill, WarmSpec

log = logging.getLogger(__name__)


class WarmFiller:
    def __init__(self, link: RegistryLink, specs: list[WarmSpec], pool_sizes: dict[str, int],
                 create: Callable[[str, WarmFill], Any], new_name: Callable[[str], str], *,
                 refresh_s: float = 1.0, call_timeout_s: float = 10.0, ready_timeout_s: float = 300.0) -> None:
        self._link = link  # its `handle` is the registry of the moment
        self._specs = [s for s in specs if pool_sizes.get(s.model, 0) > 0]
        self._pool_sizes = pool_sizes
        self._create, self._new_name = create, new_name
        self._refresh_s, self._call_timeout_s, self._ready_timeout_s = refresh_s, call_timeout_s, ready_timeout_s
        self._pending: dict[str, Any] = {}  # warm actor name -> its ready() ref
        self._wake = threading.Event()
        self._stop = threading.Event()
        # Held while an actor is created and while stopping: once stop() returns no actor is created, so the
        # registry's shutdown, which kills what is alive when it runs, finds every actor this filler made.
        self._creating = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="zq-warm-filler", daemon=True)

    @property
    def is_enabled(self) -> bool:
        return bool(self._specs)

    def start(self) -> None:
        if self.is_enabled:
            self._wake.set()  # the first round at once: the pool fills as the deployment comes up
            self._thread.start()

    def wake(self) -> None:
        """Look again now (thread-safe, cheap: the event loop may call it)."""
        self._wake.set()

    def stop(self) -> None:
        with self._creating:
            self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._call_timeout_s)

    def fill_once(self) -> list[str]:
        """One round: settle the ready ones, then create what the pools miss. Returns the names created."""
        self._settle()
        names = {s.model: [self._new_name(s.model) for _ in range(self._pool_sizes[s.model])] for s in self._specs}
        fills = ray.get(self._link.handle.fill_warm.remote(self._specs, names), timeout=self._call_timeout_s)
        created = []
        for name, fill in fills:
            try:
                with self._creating:
                    if self._stop.is_set():  # the app is closing: this fill is never made
                        self._link.handle.remove.remote(name)
                        continue
                    handle = self._create(name, fill)
            except Exception:
                log.exception("warm actor %s for %s not created; its slot is given back", name, fill.model)
                self._link.handle.remove.remote(name)
                continue
            self._link.handle.warm_created.remote(name)  # its name resolves now: it may be bound
            self._pending[name] = handle.ready.remote(self._ready_timeout_s)
            created.append(name)
        return created

    def _settle(self) -> None:
        if not self._pending:
            return
        refs = list(self._pending.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done_set = set(done)
        for name, ref in list(self._pending.items()):
            if ref not in done_set:
                continue
            del self._pending[name]
            try:
                status = ray.get(ref)
            except Exception as e:  # it died or failed while warming: dropped, and replaced next round
                log.warning("warm actor %s failed before it was ready (%s); replacing it", name, type(e).__name__)
                self._link.handle.drop_warming.remote(name)  # a request bound to it meanwhile releases it itself
                continue
            self._link.handle.warm_ready.remote(name, status.resident_fraction)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._refresh_s if not self._pending else min(self._refresh_s, 0.05))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.fill_once()
            except Exception:  # a GCS or registry hiccup: try again next round
                log.exception("warm pool refill failed")
