"""Admission: decide and place one request, and hand its row to the relay and to rows.py.

The ingress (app.py) validates a request and hands it here:
  1. `registry.admit(features)`: the pure `decide()` and the reservation it implies, in
     one atomic call on the shared registry actor (no replica can over-commit a slot or a
     batch) — or a 503 at once when the registry does not answer within `registry_timeout_s`;
  2. act: call the idle hot actor, add a row to a hot actor's batch, bind a warm actor, or
     create an actor on the reserved slot (first killing the idle actors the decision
     evicts; placement.py) — or refuse with 503 `overloaded_error` and the registry's
     predicted `retry-after`;
  3. wait for the actor's `Started` (relay.py); from then on the row is the relay's, and
     rows.py releases it once however it ends.

What a request reserved is given back on every path: a refusal commits nothing; a client
that leaves (or a deadline) while the decision or the placement is in flight abandons it
(the registry undoes an admission it sees after its abandonment too); once the relay owns
the row, `Rows.end` runs exactly once. An actor lost before the client saw anything of
its answer costs one attempt, and the request is decided again (`run`).

The registry link (registry_link.py) survives the registry's deaths: a new registry gets
this deployment's policy and scorer and the rows still running here (`_hand_over`).
Warm pools are refilled on a background thread (warm_filler.py), never awaited by a request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import ray

from actors.actor_names import new_actor_name
from actors.messages import ActorRequest, Completion
from serve_app import errors, traces
from serve_app.config import IngressConfig
from serve_app.decisions import Bind, Reject, Spawn
from serve_app.loaded_model import LoadedModel
from serve_app.metrics import IngressMetrics
from serve_app.offload import within
from serve_app.placement import Placer
from serve_app.registry_actor import RegistryActor, get_registry
from serve_app.registry_link import RegistryLink
from serve_app.relay import LOST_RETRY_AFTER_S, ActorLost, Relay
from serve_app.rows import Admitted, Rows
from serve_app.scorer import Scorer
from serve_app.slots import SlotRefresher
from serve_app.snapshot import ClusterSnapshot, ClusterSummary, summarize
from serve_app.warm_filler import WarmFiller
from serve_app.warm_pool import LANES, WarmFill, WarmSpec

log = logging.getLogger(__name__)

# A request whose actor is lost before the client saw its answer is decided again, up to this many
# tries in all (a warm pool lost at once, its node gone, costs one try per dead actor still listed).
MAX_ATTEMPTS = 3


class Admission:
    def __init__(self, config: IngressConfig, models: dict[str, LoadedModel], scorer: Scorer, replica_id: str,
                 metrics: IngressMetrics, actor_cls: type, registry_cls: type[RegistryActor]) -> None:
        self.config, self.models, self.scorer, self.metrics = config, models, scorer, metrics
        self.replica_id = replica_id
        self.registry = RegistryLink(lambda: get_registry(config.registry, config.policy, scorer, registry_cls),
                                     replica_id, heartbeat_s=config.registry_heartbeat_s,
                                     probe_timeout_s=config.registry_probe_timeout_s)
        self.placer = Placer(actor_cls, config.actor, timeout_s=config.placement_timeout_s)
        policy = config.policy
        self.warm_filler = WarmFiller(
            self.registry,
            [WarmSpec(m.id, m.numbers.weight_bytes + policy.actor_overhead_bytes) for m in models.values()],
            {m: sum(policy.num_warm(m, lane) for lane in LANES) for m in models},
            self._create_warm, new_actor_name, refresh_s=config.warm_refresh_s,
            ready_timeout_s=config.actor.load_timeout_s)
        self.rows = Rows(self.registry, self.placer, metrics, config.policy, replica_id,
                         drain_timeout_s=config.token_timeout_s,
                         traces_writer=traces.TraceWriter(config.traces) if config.traces is not None else None,
                         on_slot_freed=self.warm_filler.wake)
        self.relay = Relay(config.start_timeout_s, config.token_timeout_s, self.rows)
        # The first heartbeat hands this deployment's policy and scorer, and the slots, to the registry
        # (a redeploy's new policy takes effect here); then slots, telemetry and the link are kept current.
        self.slot_refresher = SlotRefresher(self.registry, config.slots, config.actor, config.telemetry,
                                            slot_refresh_s=config.slot_refresh_s,
                                            telemetry_refresh_s=config.telemetry_refresh_s,
                                            on_new_incarnation=self._hand_over)
        self.slot_refresher.start()
        try:
            self._gauges: asyncio.Task | None = asyncio.get_running_loop().create_task(self._refresh_gauges())
        except RuntimeError:  # no event loop: constructed outside a Serve replica (tests of the class itself)
            self._gauges = None
        self.warm_filler.start()  # once the slots are registered: the pools fill onto them

    @property
    def num_running(self) -> int:
        return self.rows.num_running

    async def close(self) -> None:
        """The replica stops: stop refilling, and detach (the last replica takes every actor with it)."""
        self.registry.close()  # before detaching: a registry gone with the app is not re-created
        if self._gauges is not None:
            self._gauges.cancel()
        self.warm_filler.stop()
        self.placer.close()
        try:
            await asyncio.wait_for(self.registry.detach.remote(self.replica_id), timeout=30)
        except Exception:  # the registry shut itself down while answering, or is gone already
            log.info("registry detach of %s ended without an answer", self.replica_id)

    def _hand_over(self) -> None:
        """A new registry (first seen, restarted, or re-created): this deployment's policy and scorer,
        and the rows this replica still relays, so their actors are not killed as orphans.
        On the slot refresher's thread, after the slots were registered."""
        ray.get(self.registry.configure.remote(self.config.policy, self.scorer), timeout=30)
        rows, idle = self.rows.handed_over()
        if rows or idle:
            taken = ray.get(self.registry.adopt.remote(rows, idle), timeout=30)
            log.warning("handed %d of %d running rows and idle hot actors to the new registry", len(taken),
                        len(rows) + len(idle))

    def summary(self, snap: ClusterSnapshot) -> ClusterSummary:
        """The registry's view in counts; the gauges follow it (also set each heartbeat, below)."""
        summary = summarize(snap, self.config.policy.max_batch)
        self.metrics.set_cluster(summary)
        return summary

    async def _refresh_gauges(self) -> None:
        """Each heartbeat: dashboards see the gauges whether or not /health is polled. On the event loop,
        not the slot refresher's thread: calls one caller makes to the registry from two threads can
        reach it out of order, and Ray then holds that caller's later calls (registry_actor.admit)."""
        while True:
            await asyncio.sleep(self.config.registry_heartbeat_s)
            if not self.registry.is_available:
                continue
            try:
                self.summary(await within(self.registry.snapshot.remote(), self.config.registry_timeout_s * 4))
            except Exception:  # the registry is restarting or busy: the next round sets them
                log.debug("gauges not refreshed this round", exc_info=True)

    async def run(self, model: LoadedModel, features, actor_request: ActorRequest, arrival: float, *,
                   is_collected: bool, prepared_at: float = 0.0) -> tuple[Admitted, tuple[str, Completion] | None]:
        """Place the request; with `is_collected`, also its whole answer. Raises ApiError.

        An actor lost before the client saw anything of its answer — dead before it started
        (a warm or idle one that died unseen), or, for an answer collected whole, at any
        point — costs an attempt: its row was released as failed, which forgot and killed
        it, and the request is decided again on what is left, up to MAX_ATTEMPTS in all;
        then it is a 503 with retry-after, never a 500.
        """
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                admitted = await self._place(model, features, actor_request, arrival, prepared_at)
                return admitted, (await self.relay.collect(admitted) if is_collected else None)
            except ActorLost as lost:
                log.warning("request %s: its actor was lost (attempt %d of %d)", actor_request.request_id,
                            attempt, MAX_ATTEMPTS)
                if attempt == MAX_ATTEMPTS:
                    raise errors.overloaded(lost.message, LOST_RETRY_AFTER_S) from None
                await self._reconcile()  # a lost node's slots are gone before the next decision
        raise AssertionError("unreachable")

    async def _place(self, model: LoadedModel, features, actor_request: ActorRequest, arrival: float,
                     prepared_at: float) -> Admitted:
        """One decision and the action it names; returns once the actor has started computing.

        Raises ActorLost if the actor was dead before it started. Whatever the admission
        reserved is given back if this ends any other way before the relay owns the row
        (a deadline, or the client leaving).
        """
        request_id = actor_request.request_id
        spawn_name = new_actor_name(model.id)
        decision = await self._admit(features, spawn_name, request_id)
        decided_at = time.time()
        self.metrics.decisions.inc(tags={"model": model.id, "kind": type(decision).__name__.lower()})
        if isinstance(decision, Reject):
            self.metrics.rejections.inc(tags={"reason": decision.reason})
            self.metrics.observe_dispatch(model.id, time.time() - arrival)
            self.rows.trace(request_id, model.id, arrival, features, decision, None)
            if decision.http_status == 400:
                raise errors.invalid_request(decision.message)
            raise errors.overloaded(decision.message, decision.retry_after_s or self.config.policy.retry_after_s)
        rows = decision.candidate.batch_rows + 1 if decision.candidate is not None else 1
        self.metrics.batch_rows.observe(rows, tags={"model": model.id})
        self.metrics.admissions.inc(tags={"model": model.id, "tier": _tier(decision)})
        actor_request = dataclasses.replace(actor_request, keep_hot=decision.keep_hot)
        name = spawn_name if isinstance(decision, Spawn) else decision.actor_name
        try:
            if isinstance(decision, Spawn):
                handle = await self.placer.create(name, model.zqs_path, decision.node_id, evict=decision.evict)
                if decision.evict:
                    self.metrics.evictions.inc(len(decision.evict), tags={"model": model.id})
                for evicted in decision.evict:
                    self.rows.taken(evicted)
            else:  # Dispatch, Join or Bind: an actor that exists
                self.rows.taken(name)  # busy now, or lost
                handle = await self.placer.handle(name)
        except ValueError:  # no such actor: it died and the registry has not noticed yet
            self.registry.finish.remote(name, request_id, "failed")  # forget it
            raise ActorLost(503, "overloaded_error", "the model's process was lost; retry") from None
        except BaseException:  # a deadline, or the client left: nothing was sent, give the row back
            self.registry.abandon.remote(request_id)
            raise
        if isinstance(decision, Bind):
            self.warm_filler.wake()  # its pool is one short now
        stream = handle.generate.remote(actor_request)
        dispatch_time = time.time()
        self.metrics.observe_dispatch(model.id, dispatch_time - arrival)
        resident = decision.resident_bytes if isinstance(decision, Spawn) else \
            model.numbers.weight_bytes + self.config.policy.actor_overhead_bytes
        admitted = Admitted(request_id, model.id, name, decision.keep_hot, _tier(decision),
                            len(actor_request.prompt_ids), stream, arrival=arrival, dispatch_time=dispatch_time,
                            features=features, decision=decision, resident_bytes=resident,
                            prepared_at=prepared_at or arrival, decided_at=decided_at)
        self.rows.begin(admitted)
        await self.relay.first(admitted)
        return admitted

    async def _admit(self, features, spawn_name: str, request_id: str):
        """The registry's decision, or a 503 at once when it does not answer within `registry_timeout_s`
        (or is known not to answer: until the link's next heartbeat is answered, nothing is asked)."""
        if not self.registry.is_available:
            raise self._registry_unavailable()
        try:
            decision = await within(
                self.registry.admit.remote(features, spawn_name, request_id, self.slot_refresher.take_stats(),
                                           self.replica_id, self.registry.incarnation),
                self.config.registry_timeout_s)
        except asyncio.CancelledError:  # the client left: whatever the admission commits is undone
            self.registry.abandon.remote(request_id)
            raise
        except (asyncio.TimeoutError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            # Calls from this replica reach the registry in order, and a registry remembers what was
            # abandoned before it was admitted: nothing stays reserved for a request that was refused.
            self.registry.abandon.remote(request_id)
            # Late: probe, and go on admitting. Gone: refuse at once until a heartbeat (which re-creates one
            # gone for good) is answered.
            self.registry.unanswered(e)
            log.warning("request %s: the registry did not decide in time (%s)", request_id, type(e).__name__)
            raise self._registry_unavailable() from None
        if isinstance(decision, Reject) and decision.reason == "registry_restarted":
            self.registry.lost()  # the heartbeat hands this replica's rows over; admissions resume after it
            raise self._registry_unavailable()
        return decision

    def _registry_unavailable(self) -> errors.ApiError:
        self.metrics.rejections.inc(tags={"reason": "registry_unavailable"})
        # Back within a heartbeat or two (a restart, or a new registry) when it comes back at all.
        return errors.overloaded("the admission registry is unavailable; retry shortly",
                                 max(self.config.policy.retry_after_s, self.config.registry_heartbeat_s))

    async def _reconcile(self) -> None:
        try:
            await within(self.registry.reconcile_now.remote(), self.config.registry_timeout_s * 4)
        except Exception:  # best effort: the registry's own loop does the same within a second
            log.info("reconcile before a retry did not answer in time")

    def _create_warm(self, name: str, fill: WarmFill):
        """The warm filler's thread: a warm actor of `fill.model` on its slot."""
        model = self.models[fill.model]
        return self.placer.create_now(name, model.zqs_path, fill.node_id, model.warm_layers)


def _tier(decision) -> str:
    """Where a placed request runs, as X-Request-Tier says: the kind of candidate it was scored as.

    A bound actor still warming was scored as a fresh one (it pays the rest of its process start): cold.
    """
    if decision.candidate is None:  # decided outside `decide` (tests)
        return "cold" if isinstance(decision, Spawn) else "hot"
    kind = decision.candidate.kind
    return "hot" if kind == "join" else kind
