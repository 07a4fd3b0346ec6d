"""The cluster in this process: the registry's own state, and `RequestActor`s as plain objects.

No Ray, no Serve: the same books decide and reserve (`SharedRegistry`, as the registry actor
runs it), and the same engine computes — each actor streams its `.zqs`
file, batches its rows on its own thread and exits after its last row unless kept hot. What
differs is only how the world is reached: an actor is an object here, its stream an asyncio
task (`LocalStream`), its death `kill()`. So every behaviour that is not Ray's own — validation,
decisions, hot/join/bind/spawn placement, refusals and retry-after, streaming, cancellation,
an actor lost before or after its first item — can be tested through the ASGI app
(asgi.IngressApp) in one process, without starting another.

What only Ray has stays out: processes that die by themselves, registry restarts and hand-overs,
nodes. Several ingress replicas share one registry and one set of actors through a `LocalNode`
(asgi.Replicas serves them on one event loop). One node, `slots.num_cpu_slots` CPU slots of `cpu_slot_bytes`.
`calls` counts the callers' registry calls by name (as the registry actor's `calls()` does on Ray).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from actors.actor_names import new_actor_name
from actors.messages import ActorBusyError, ActorRequest
from actors.request_actor import RequestActor
from serve_app.cluster import (
    ActorGone,
    HandOver,
    Item,
    NewActor,
    StreamBusy,
    StreamCancelled,
    StreamEnded,
    StreamFailed,
    StreamLost,
)
from serve_app.config import IngressConfig
from serve_app.decisions import Decision
from serve_app.lease import LeaseGrant, LeaseReport, SlowPathLease
from serve_app.loaded_model import LoadedModel
from serve_app.registry import Outcome, SlotSpec
from serve_app.scorer import Scorer
from serve_app.shared_registry import SharedRegistry
from serve_app.snapshot import ClusterSnapshot, RequestFeatures
from serve_app.ttft_check import TtftCorrection
from serve_app.warm_pool import WarmSpec, pool_size, warm_specs

log = logging.getLogger(__name__)

NODE_ID = "local"


class LocalStream:
    """An actor's `generate`, pumped by a task of its own into a queue: a caller that stops waiting for
    `next()` (a deadline, a ping) leaves the row running, as it does with a Ray stream."""

    _END = object()

    def __init__(self, items: AsyncIterator[Item], on_end: Callable[[LocalStream], None]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._on_end = on_end
        self._task = asyncio.get_running_loop().create_task(self._pump(items))

    async def _pump(self, items: AsyncIterator[Item]) -> None:
        try:
            async for item in items:
                self._queue.put_nowait(item)
            self._queue.put_nowait(self._END)
        except asyncio.CancelledError:
            self._queue.put_nowait(StreamCancelled("the actor's call was cancelled"))
        except ActorBusyError as e:
            self._queue.put_nowait(StreamBusy(str(e)))
        except Exception as e:  # the actor raised while serving
            self._queue.put_nowait(StreamFailed(f"{type(e).__name__}: {e}"))
        finally:
            self._on_end(self)

    async def next(self) -> Item:
        item = await self._queue.get()
        if item is self._END or isinstance(item, StreamEnded):
            self._queue.put_nowait(self._END)  # after its end, a stream only says it has ended
            if isinstance(item, StreamEnded):
                raise item
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        self._task.cancel()

    def lose(self, detail: str) -> None:
        """The actor died: whoever waits hears StreamLost first."""
        self._queue.put_nowait(StreamLost(detail))
        self._task.cancel()

    async def drain(self) -> None:
        await asyncio.wait({self._task})


class _FailedStream:
    """The stream of an actor whose constructor raised: what Ray answers a call to such an actor."""

    def __init__(self, detail: str) -> None:
        self._detail = detail

    async def next(self) -> Item:
        raise StreamFailed(self._detail, is_load_failure=True)

    def cancel(self) -> None:
        pass

    async def drain(self) -> None:
        pass


class _Actor:
    """One actor's place in the cluster: created (or still being created), its open streams, and dead once
    killed or exited."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.actor: RequestActor | None = None  # None until its constructor returns
        self.streams: set[LocalStream] = set()
        self.is_dead = False

    def generate(self, request: ActorRequest) -> LocalStream:
        stream = LocalStream(self.actor.generate(request), self.streams.discard)
        self.streams.add(stream)
        return stream

    def kill(self) -> None:
        self.is_dead = True
        for stream in list(self.streams):
            stream.lose(f"actor {self.name} was killed")
        if self.actor is not None:
            self.actor.close()


@dataclass(eq=False)
class LocalNode:
    """What several in-process replicas share, as replicas on Ray share the registry actor and the request
    actors (asgi.Replicas): one registry, one set of actors, one count of the registry's calls. The first
    cluster built on it creates the registry."""

    registry: SharedRegistry | None = None
    actors: dict[str, _Actor] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # `actors`: tests read it from their thread
    calls: Counter[str] = field(default_factory=Counter)
    num_clusters: int = 0  # open on it: the last to close takes every actor with it, as on Ray


class LocalCluster:
    def __init__(self, config: IngressConfig, models: dict[str, LoadedModel], scorer: Scorer, replica_id: str, *,
                 actor_cls: type = RequestActor, node: LocalNode | None = None) -> None:
        self._config, self._models, self._scorer, self.replica_id = config, models, scorer, replica_id
        self._actor_cls = actor_cls
        policy = config.policy
        node = node if node is not None else LocalNode()
        if node.registry is None:
            node.registry = SharedRegistry(policy, scorer, config.registry.spawn_grace_s, kill=self.kill)
        self.registry, self.actors, self._lock, self.calls = node.registry, node.actors, node.lock, node.calls
        self._node = node
        node.num_clusters += 1
        self._slots = [SlotSpec(f"{NODE_ID}/cpu{i}", NODE_ID, config.slots.cpu_slot_bytes)
                       for i in range(config.slots.num_cpu_slots)]
        self._warm_specs = warm_specs(models.values(), policy, config.rule_scorer.node_cpus)
        self._pool_sizes = {m: pool_size(policy, m) for m in models}
        self._tasks: set[asyncio.Task] = set()
        self._warm_wake: asyncio.Event | None = None

    # ---- lifecycle -------------------------------------------------------------------

    def start(self, hand_over: HandOver) -> None:
        """The slots; warm pools and reconciling start with the event loop (`_ensure_running`). Nothing is
        ever handed over: this registry lives as long as the process."""
        self.registry.register_slots(self._slots)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # built outside a loop: the background work starts with the first request
        self._ensure_running()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._node.num_clusters -= 1
        if self._node.num_clusters == 0:
            for name in list(self.actors):
                self.kill(name)

    def _ensure_running(self) -> None:
        if self._warm_wake is not None:
            return
        self._warm_wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        for work in (self._keep_warm(), self._reconcile_loop()):
            task = loop.create_task(work)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._warm_wake.set()

    @property
    def is_available(self) -> bool:
        return True

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    # ---- the registry ----------------------------------------------------------------

    def _call(self, name: str, fn: Callable[[], Any]) -> Any:
        self.calls[name] += 1
        return fn()

    async def admit(self, features: RequestFeatures, spawn_name: str, request_id: str,
                    lease: SlowPathLease | None = None, correction: TtftCorrection | None = None) -> Decision:
        self._ensure_running()
        return self._call("admit", lambda: self.registry.admit(features, spawn_name, request_id,
                                                               replica_id=self.replica_id, lease=lease,
                                                               correction=correction))

    async def exchange_leases(self, report: LeaseReport, timeout_s: float) -> LeaseGrant:
        return self._call("exchange_leases", lambda: self.registry.exchange_leases(report))

    def give_back(self, row_ids: tuple[str, ...]) -> None:
        self._call("give_back", lambda: self.registry.give_back(self.replica_id, row_ids))

    def abandon(self, request_id: str) -> None:
        self._call("abandon", lambda: self.registry.abandon(request_id))

    def finish(self, actor_name: str, request_id: str, outcome: Outcome) -> None:
        self._call("finish", lambda: self.registry.finish(actor_name, request_id, outcome))

    def actor_started(self, actor_name: str) -> None:
        self._call("actor_started", lambda: self.registry.actor_started(actor_name))

    async def snapshot(self, timeout_s: float) -> ClusterSnapshot:
        return self._call("snapshot", self.registry.snapshot)

    def actor_names(self) -> set[str]:
        """The actors alive or being created (thread-safe)."""
        with self._lock:
            return {name for name, entry in self.actors.items() if not entry.is_dead}

    async def reconcile(self, timeout_s: float) -> None:
        self._call("reconcile", self.reconcile_now)

    def reconcile_now(self) -> None:
        """The books against the actors alive here: ghosts dropped; expired, retired and orphans killed. The
        registry's own loop runs this uncounted: `calls` counts what callers ask, as on Ray."""
        alive = self.actor_names()
        report = self.registry.reconcile_books(alive, time.time(), {NODE_ID})
        for name in report.to_kill:
            self.kill(name)

    # ---- actors ----------------------------------------------------------------------

    async def open(self, name: str, request: ActorRequest, new: NewActor | None = None) -> LocalStream | _FailedStream:
        if new is not None:
            for evicted in new.evict:  # forgotten by the registry already; gone before the new actor starts
                self.kill(evicted)
            entry = await self._create(name, new.zqs_path, None)
            if entry.actor is None:
                return _FailedStream(f"actor {name} could not be constructed")
        else:
            with self._lock:
                entry = self.actors.get(name)
            if entry is None or entry.is_dead or entry.actor is None:
                raise ActorGone(name)
        return entry.generate(request)

    def forget(self, name: str) -> None:
        pass  # no handle is cached here: `actors` is the truth

    def wake_warm(self) -> None:
        if self._warm_wake is not None:
            self._warm_wake.set()

    def kill(self, name: str) -> None:
        """End actor `name` as a process's death would: its streams end StreamLost, it computes no more."""
        with self._lock:
            entry = self.actors.pop(name, None)
        if entry is not None:
            entry.kill()

    async def _create(self, name: str, zqs_path: str, warm_layers: int | None) -> _Actor:
        """A new actor, constructed on a thread (it allocates its model and starts its loader threads); one
        killed meanwhile is closed as soon as it exists. Its `actor` stays None if its constructor raised."""
        entry = _Actor(name)
        with self._lock:
            self.actors[name] = entry

        def construct() -> RequestActor:
            return self._actor_cls(zqs_path, self._config.actor, warm_layers=warm_layers, name=name,
                                   on_exit=lambda: self._exited(entry))

        try:
            actor = await asyncio.to_thread(construct)
        except Exception:
            log.exception("actor %s could not be constructed", name)
            self._exited(entry)
            return entry
        entry.actor = actor
        if entry.is_dead:
            actor.close()
        return entry

    def _exited(self, entry: _Actor) -> None:
        """The actor ended itself (after its last row, or a failed step): gone, as a Ray actor whose process
        exits — a stream still open on it ends StreamLost (one whose Completion was sent has nothing left).
        As on Ray, the exit comes after the call that made it: what that call raises reaches its caller
        first (a load that failed is StreamFailed, not StreamLost)."""
        with self._lock:
            if self.actors.get(entry.name) is entry:
                del self.actors[entry.name]
        asyncio.get_running_loop().call_soon(entry.kill)

    # ---- background work ---------------------------------------------------------------

    async def _keep_warm(self) -> None:
        """Each model's warm pool kept full: the registry's plan, actors created, then marked ready."""
        specs = [s for s in self._warm_specs if self._pool_sizes.get(s.model, 0) > 0]
        while specs:
            try:  # woken by a bind or a freed slot, and every `warm_refresh_s` besides (as on Ray): a pool that
                # could not fill while an actor was starting on its node fills once it has started
                await asyncio.wait_for(self._warm_wake.wait(), self._config.warm_refresh_s)
            except asyncio.TimeoutError:
                pass
            self._warm_wake.clear()
            fills = self._call("fill_warm", lambda: self.registry.fill_warm(specs, self._new_names(specs)))
            for name, fill in fills:
                task = asyncio.get_running_loop().create_task(self._warm_up(name, fill.model))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _new_names(self, specs: list[WarmSpec]) -> dict[str, list[str]]:
        return {s.model: [new_actor_name(s.model) for _ in range(self._pool_sizes[s.model])] for s in specs}

    async def _warm_up(self, name: str, model_id: str) -> None:
        model = self._models[model_id]
        entry = await self._create(name, model.zqs_path, model.warm_layers)
        try:
            if entry.actor is None:
                raise RuntimeError("not constructed")
            self._call("warm_created", lambda: self.registry.warm_created(name))
            status = await entry.actor.ready(self._config.actor.load_timeout_s)
        except Exception as e:  # dropped, and replaced by the next round
            log.warning("warm actor %s failed before it was ready (%s); replacing it", name, type(e).__name__)
            self._call("drop_warming", lambda: self.registry.drop_warming(name))
            self.kill(name)
            self.wake_warm()
            return
        self._call("warm_ready", lambda: self.registry.warm_ready(name, status.resident_fraction))

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.registry.reconcile_interval_s)
            try:
                self.reconcile_now()
            except Exception:
                log.exception("reconcile pass failed")


@dataclass(frozen=True)
class LocalClusterSpec:
    """The fault seams, as on Ray: `actor_cls` (a RequestActor that stalls or fails on cue) and `cluster_cls`
    (a LocalCluster whose registry answers late)."""

    actor_cls: type = RequestActor
    cluster_cls: type[LocalCluster] = LocalCluster
    node: LocalNode | None = None  # shared by the replicas built from this spec (asgi.Replicas); None: its own

    def build(self, config: IngressConfig, models: dict[str, LoadedModel], scorer: Scorer,
              replica_id: str) -> LocalCluster:
        return self.cluster_cls(config, models, scorer, replica_id, actor_cls=self.actor_cls, node=self.node)
