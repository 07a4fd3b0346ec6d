"""Acting on a committed placement: the request actor a row is sent to, created or looked up.

Creating a named actor and looking one up are blocking GCS calls. They run on a bounded
thread pool with a deadline (offload.py): past it, or past its cap, the request is
refused at once (503) instead of waiting in a queue here. A creation the request stopped
waiting for (its deadline, or its client left) still ends in its thread; the actor it
made is then killed, since nothing will use it.

The actor class is injected (`actor_cls`): the fault seam, through which tests place
actors that stall, die at a chosen point or answer slowly, without real models.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.actor_config import ActorConfig
from actors.actor_kill import kill_named
from serve_app.offload import BoundedExecutor

# Handles of actors this replica created or looked up, most recent last; an actor retired or
# evicted elsewhere leaves a stale entry, which is dropped when the cache is full (or found dead).
MAX_CACHED_HANDLES = 1024


class Placer:
    def __init__(self, actor_cls: type, actor: ActorConfig, *, timeout_s: float = 10.0, max_threads: int = 4,
                 max_pending: int = 64) -> None:
        # One remote class for every spawn: `ray.remote()` per spawn would export the class anew each time.
        self._actor_class = ray.remote(actor_cls)
        self._actor = actor
        self._executor = BoundedExecutor("actor placement", max_threads=max_threads, max_pending=max_pending,
                                         timeout_s=timeout_s)
        self._handles: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # the event loop and the warm filler's thread share the cache

    async def create(self, name: str, zqs_path: str, node_id: str, warm_layers: int | None = None,
                     evict: tuple[str, ...] = ()) -> Any:
        """A new actor on `node_id`, after killing the actors `evict` names; raises ApiError (503) on a deadline."""

        def create() -> Any:
            for evicted in evict:  # forgotten by the registry already; gone before the new actor starts
                self.kill(evicted)
            return self.create_now(name, zqs_path, node_id, warm_layers)

        return await self._executor.run(create, on_abandoned=self._kill_handle)

    def create_now(self, name: str, zqs_path: str, node_id: str, warm_layers: int | None = None) -> Any:
        """The blocking creation (for threads of their own, such as the warm filler's)."""
        options = self._actor.actor_options(name)
        # The registry's node for the slot: this replica may not have discovered it (another replica's CPU slots).
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        handle = self._actor_class.options(**options).remote(zqs_path, self._actor, warm_layers=warm_layers)
        self._cache(name, handle)
        return handle

    async def handle(self, name: str) -> Any:
        """The actor named `name` (started by this replica or another); raises ApiError (503) on a deadline."""
        with self._lock:
            handle = self._handles.get(name)
        if handle is None:
            handle = await self._executor.run(lambda: ray.get_actor(name, namespace=self._actor.namespace))
            self._cache(name, handle)
        return handle

    def forget(self, name: str) -> None:
        with self._lock:
            self._handles.pop(name, None)

    def kill(self, name: str) -> None:
        with self._lock:
            handle = self._handles.pop(name, None)
        if handle is None:
            kill_named(name, self._actor.namespace)
        else:
            self._kill_handle(handle)

    def close(self) -> None:
        self._executor.close()

    def _cache(self, name: str, handle: Any) -> None:
        with self._lock:
            self._handles[name] = handle
            self._handles.move_to_end(name)
            while len(self._handles) > MAX_CACHED_HANDLES:
                self._handles.popitem(last=False)

    def _kill_handle(self, handle: Any) -> None:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # gone already
            pass
