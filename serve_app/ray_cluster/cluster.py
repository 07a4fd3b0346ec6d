"""The cluster on Ray: the shared registry actor, and request actors as named Ray actors.

This replica's part of it:
  - the registry link (registry_link.py), which survives the registry's restarts and deaths:
    a new registry gets this deployment's policy and scorer, its slots, and the rows and idle
    hot actors this replica still knows (`_hand_over`, on the slot refresher's thread);
  - the slot refresher (slots.py): heartbeats, slots, telemetry, on one background thread;
  - the placer (placement.py): actors created and looked up off the event loop, with deadlines;
  - the warm filler (warm_filler.py): each model's warm pool kept full from a thread of its own;
  - Ray's errors mapped to the port's typed endings (stream.py, and `admit` and `snapshot` below).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import ray

from actors.actor_names import new_actor_name
from actors.messages import ActorRequest
from actors.request_actor import RequestActor
from serve_app.cluster import ActorGone, HandOver, NewActor, RegistryUnavailable
from serve_app.config import IngressConfig
from serve_app.decisions import Decision, Reject
from serve_app.lease import LeaseGrant, LeaseReport, SlowPathLease
from serve_app.loaded_model import LoadedModel
from serve_app.offload import within
from serve_app.ray_cluster.placement import Placer
from serve_app.ray_cluster.registry_actor import RegistryActor, get_registry
from serve_app.ray_cluster.registry_link import RegistryLink
from serve_app.ray_cluster.slots import SlotRefresher
from serve_app.ray_cluster.stream import RayStream
from serve_app.ray_cluster.warm_filler import WarmFiller
from serve_app.registry import Outcome
from serve_app.scorer import Scorer
from serve_app.snapshot import ClusterSnapshot, RequestFeatures
from serve_app.ttft_check import TtftCorrection
from serve_app.warm_pool import WarmFill, pool_size, warm_specs

log = logging.getLogger(__name__)

# What Ray raises for a registry call that got no answer: late (a timeout), or the actor gone.
_UNANSWERED = (asyncio.TimeoutError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@dataclass(frozen=True)
class RayClusterSpec:
    """`actor_cls` and `registry_cls` are the fault seam: tests inject actors and registries that stall,
    die on cue or answer slowly; `build_app` uses the real ones."""

    actor_cls: type = RequestActor
    registry_cls: type[RegistryActor] = RegistryActor

    def build(self, config: IngressConfig, models: dict[str, LoadedModel], scorer: Scorer,
              replica_id: str) -> RayCluster:
        return RayCluster(config, models, scorer, replica_id, actor_cls=self.actor_cls,
                          registry_cls=self.registry_cls)


class RayCluster:
    def __init__(self, config: IngressConfig, models: dict[str, LoadedModel], scorer: Scorer, replica_id: str, *,
                 actor_cls: type, registry_cls: type[RegistryActor]) -> None:
        self._config, self._models, self._scorer, self.replica_id = config, models, scorer, replica_id
        self._link = RegistryLink(lambda: get_registry(config.registry, config.policy, registry_cls),
                                  replica_id, heartbeat_s=config.registry_heartbeat_s,
                                  probe_timeout_s=config.registry_probe_timeout_s)
        self._placer = Placer(actor_cls, config.actor, timeout_s=config.placement_timeout_s)
        policy = config.policy
        self._warm = WarmFiller(
            self._link,
            warm_specs(models.values(), policy, config.rule_scorer.node_cpus),
            {m: pool_size(policy, m) for m in models},
            self._create_warm, new_actor_name, refresh_s=config.warm_refresh_s,
            ready_timeout_s=config.actor.load_timeout_s)
        self._handed_over: HandOver = lambda: ([], [])
        self._slots: SlotRefresher | None = None

    # ---- lifecycle -------------------------------------------------------------------

    def start(self, hand_over: HandOver) -> None:
        self._handed_over = hand_over
        # The first heartbeat, here, hands this deployment's policy, scorer and slots to the registry
        # (a redeploy's new policy takes effect here); a registry that cannot be reached fails the start.
        self._slots = SlotRefresher(self._link, self._config.slots, self._config.actor, self._config.telemetry,
                                    slot_refresh_s=self._config.slot_refresh_s,
                                    telemetry_refresh_s=self._config.telemetry_refresh_s,
                                    on_new_incarnation=self._hand_over)
        self._slots.start()
        self._warm.start()  # once the slots are registered: the pools fill onto them

    async def close(self) -> None:
        self._link.close()  # before detaching: a registry gone with the app is not re-created
        try:
            self._warm.stop()  # before detaching: the last replica's detach kills every actor alive then
            if self._slots is not None:
                await asyncio.to_thread(self._slots.stop)  # likewise: no telemetry agent created after it
            self._placer.close()
        finally:
            try:
                await asyncio.wait_for(self._link.handle.detach.remote(self.replica_id), timeout=30)
            except Exception:  # the registry shut itself down while answering, or is gone already
                log.info("registry detach of %s ended without an answer", self.replica_id)

    def _hand_over(self) -> None:
        """A new registry (first seen, restarted, or re-created): this deployment's policy and scorer, and
        the rows this replica still relays, so their actors are not killed as orphans. On the slot
        refresher's thread, after the slots were registered."""
        ray.get(self._link.handle.configure.remote(self._config.policy, self._scorer, self._config.capacity),
                timeout=30)
        rows, idle = self._handed_over()
        if rows or idle:
            taken = ray.get(self._link.handle.adopt.remote(rows, idle), timeout=30)
            log.warning("handed %d of %d running rows and idle hot actors to the new registry", len(taken),
                        len(rows) + len(idle))

    @property
    def is_available(self) -> bool:
        return self._link.is_available

    @property
    def num_slots(self) -> int:
        return len(self._slots.slots) if self._slots is not None else 0

    # ---- the registry ----------------------------------------------------------------

    async def admit(self, features: RequestFeatures, spawn_name: str, request_id: str,
                    lease: SlowPathLease | None = None, correction: TtftCorrection | None = None) -> Decision:
        stats = self._slots.take_stats() if self._slots is not None else None
        try:
            decision = await within(
                self._link.call("admit", features, spawn_name, request_id, stats, self.replica_id,
                                self._link.incarnation, lease, correction),
                self._config.registry_timeout_s)
        except _UNANSWERED as e:
            # Late: probe, and go on admitting. Gone: refuse at once until a heartbeat (which re-creates one
            # gone for good) is answered.
            self._link.unanswered(e)
            raise RegistryUnavailable(type(e).__name__) from None
        if isinstance(decision, Reject) and decision.reason == "registry_restarted":
            self._link.lost()  # the heartbeat hands this replica's rows over; admissions resume after it
            raise RegistryUnavailable(decision.reason)
        return decision

    async def exchange_leases(self, report: LeaseReport, timeout_s: float) -> LeaseGrant:
        try:
            grant = await within(self._link.call("exchange_leases", report, self._link.incarnation), timeout_s)
        except _UNANSWERED as e:
            self._link.unanswered(e)
            raise RegistryUnavailable(type(e).__name__) from None
        if grant is None:  # a registry this replica has not handed over to yet: the heartbeat does that
            self._link.lost()
            raise RegistryUnavailable("registry_restarted")
        self._link.heard()  # the registry counts this as an attach: the link's own can wait
        return grant

    def give_back(self, row_ids: tuple[str, ...]) -> None:
        self._link.call("give_back", self.replica_id, row_ids)

    def abandon(self, request_id: str) -> None:
        # Calls from this replica reach the registry in order, and a registry remembers what was abandoned
        # before it was admitted: nothing stays reserved for a request that was refused.
        self._link.call("abandon", request_id)

    def finish(self, actor_name: str, request_id: str, outcome: Outcome) -> None:
        self._link.call("finish", actor_name, request_id, outcome)

    def actor_started(self, actor_name: str) -> None:
        self._link.call("actor_started", actor_name)

    async def snapshot(self, timeout_s: float) -> ClusterSnapshot:
        try:
            return await within(self._link.call("snapshot"), timeout_s)
        except _UNANSWERED as e:
            self._link.unanswered(e)
            raise RegistryUnavailable(type(e).__name__) from None

    async def reconcile(self, timeout_s: float) -> None:
        try:
            await within(self._link.call("reconcile_now"), timeout_s)
        except Exception:  # best effort: the registry's own loop does the same within a second
            log.info("reconcile did not answer in time")

    # ---- actors ----------------------------------------------------------------------

    async def open(self, name: str, request: ActorRequest, new: NewActor | None = None) -> RayStream:
        try:
            if new is not None:
                handle = await self._placer.create(name, new.zqs_path, new.node_id, evict=new.evict)
            else:
                handle = await self._placer.handle(name)
        except ValueError:  # no such actor: it died and the registry has not noticed yet
            raise ActorGone(name) from None
        return RayStream(handle.generate.remote(request))

    def forget(self, name: str) -> None:
        self._placer.forget(name)

    def wake_warm(self) -> None:
        self._warm.wake()

    def _create_warm(self, name: str, fill: WarmFill):
        """The warm filler's thread: a warm actor of `fill.model` on its slot."""
        model = self._models[fill.model]
        return self._placer.create_now(name, model.zqs_path, fill.node_id, model.warm_layers)
