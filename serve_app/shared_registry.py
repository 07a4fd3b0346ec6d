"""The registry's state behind one lock, with the kills its commits imply (pure: no Ray).

Every call that reads or changes `RegistryState` does so in one critical section, so each
compare-and-set (`admit`, `finish`, `abandon`, ...) is linearizable: of two callers racing for
the last free bytes of a slot, the second one's re-check sees the first one's reservation. A
commit that forgets an actor still running (a failed row, a load nobody waits for) kills it
through `kill`, outside the lock.

Both clusters run this: the registry actor on Ray (ray_cluster/registry_actor.py subclasses it,
adding incarnations, replicas and Ray's view of what is alive) and the in-process cluster
(local_cluster.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from serve_app.capacity import CapacityConfig, CapacityPlan
from serve_app.decisions import Decision
from serve_app.lease import LeaseGrant, LeaseReport, SlowPathLease
from serve_app.policy import PolicyConfig
from serve_app.registry import Outcome, ReconcileReport, RegistryState, SlotSpec
from serve_app.registry_capacity import CapacityStatus
from serve_app.scorer import RULE_SCORER, Scorer
from serve_app.snapshot import ClusterSnapshot, RequestFeatures
from serve_app.ttft_check import TtftCorrection, corrected
from serve_app.warm_pool import WarmFill, WarmSpec, pool_size


class SharedRegistry:
    def __init__(self, policy: PolicyConfig, scorer: Scorer | None, spawn_grace_s: float,
                 kill: Callable[[str], None]) -> None:
        self._policy = policy
        self._scorer = scorer or RULE_SCORER
        self._state = RegistryState(policy.max_actors_per_slot, spawn_grace_s, policy.max_idle_s, policy.max_batch)
        self._lock = threading.Lock()
        self._kill_actor = kill

    # ---- slots and reads ---------------------------------------------------------------

    def register_slots(self, slots: Iterable[SlotSpec]) -> None:
        with self._lock:
            self._state.register_slots(slots)

    def snapshot(self) -> ClusterSnapshot:
        with self._lock:
            return self._state.snapshot()

    def counters(self) -> dict[str, int]:
        """Decisions by kind, evictions, and spawns decided while a fitting warm actor was there."""
        with self._lock:
            return dict(self._state.counters)

    def check_invariants(self) -> None:
        with self._lock:
            self._state.check_invariants()

    # ---- commits ---------------------------------------------------------------------

    def admit(self, features: RequestFeatures, spawn_name: str, request_id: str,
              slot_stats: dict[str, tuple[float, float]] | None = None, replica_id: str = "",
              lease: SlowPathLease | None = None, correction: TtftCorrection | None = None) -> Decision:
        """Decide with this registry's policy and scorer, and commit, in one step. `slot_stats`:
        slot_id -> (fragmentation, utilization) from telemetry, applied first (unknown slots skipped).
        With `lease`, a row on a hot actor is leased to `replica_id` (RegistryState.admit)."""
        with self._lock:
            for slot_id, (fragmentation, utilization) in (slot_stats or {}).items():
                if slot_id in self._state.slot_ids:
                    self._state.update_slot_stats(slot_id, fragmentation, utilization)
            return self._state.admit(features, self._policy, spawn_name, request_id, time.time(),
                                     corrected(self._scorer, correction), replica_id, lease)

    def exchange_leases(self, report: LeaseReport) -> LeaseGrant:
        """A replica's lease heartbeat: returns, uses and wants in; its rows, renewed and granted, out."""
        with self._lock:
            return self._state.exchange_leases(report, time.time())

    def give_back(self, replica_id: str, row_ids: tuple[str, ...]) -> None:
        """Free rows `replica_id` returns between heartbeats (its model is contended)."""
        with self._lock:
            for row_id in row_ids:
                self._state.leases.give_back(replica_id, row_id, time.time())

    def fill_warm(self, specs: list[WarmSpec], names: dict[str, list[str]]) -> list[tuple[str, WarmFill]]:
        """Commit the warm actors the pools miss; the caller creates them."""
        with self._lock:
            return self._state.fill_warm(specs, self._policy, names, time.time())

    def warm_created(self, actor_name: str) -> bool:
        with self._lock:
            return self._state.warm_created(actor_name)

    def warm_ready(self, actor_name: str, resident_fraction: float) -> bool:
        with self._lock:
            return self._state.warm_ready(actor_name, resident_fraction)

    def drop_warming(self, actor_name: str) -> bool:
        with self._lock:
            return self._state.drop_warming(actor_name)

    def actor_started(self, actor_name: str) -> bool:
        with self._lock:
            return self._state.actor_started(actor_name)

    def finish(self, actor_name: str, request_id: str, outcome: Outcome) -> bool:
        """A row ended; an actor that failed (or a load nobody waits for) is forgotten and killed here."""
        with self._lock:
            must_kill = self._state.finish(actor_name, request_id, outcome, time.time())
        if must_kill:
            self._kill_actor(actor_name)
        return must_kill

    def abandon(self, request_id: str) -> bool:
        """A caller gave up waiting for `request_id`'s admission: release whatever it committed."""
        with self._lock:
            undone = self._state.abandon(request_id, time.time())
        if undone is not None and undone[1]:
            self._kill_actor(undone[0])
        return undone is not None

    def remove(self, actor_name: str) -> bool:
        with self._lock:
            return self._state.remove(actor_name)

    def configure(self, policy: PolicyConfig, scorer: Scorer | None = None,
                  capacity: CapacityConfig | None = None) -> None:
        """The policy, scorer and capacity plan's config of the latest deployment (a redeploy's replicas bring
        theirs)."""
        with self._lock:
            self._state.reconfigure(policy.max_actors_per_slot, policy.max_idle_s, policy.max_batch)
            self._policy, self._scorer = policy, scorer or RULE_SCORER
            if capacity is not None:
                self._state.capacity.configure(capacity)

    # ---- capacity ----------------------------------------------------------------------

    def plan_capacity(self) -> CapacityPlan | None:
        """One planning step (registry_capacity.py); None when planning is off."""
        with self._lock:
            capacity = self._state.capacity
            if not capacity.is_enabled:
                return None
            models = {a.model for a in self._state.books.actors.values()} | set(self._state.books.last_request_at)
            warm = {m: pool_size(self._policy, m) for m in models}
            return capacity.step(time.time(), warm)

    def capacity_status(self) -> CapacityStatus:
        with self._lock:
            return self._state.capacity.status()

    def reconcile_books(self, alive: set[str], listed_at: float, alive_nodes: set[str],
                        draining_nodes: set[str] = frozenset()) -> ReconcileReport:
        """The books matched to the actors and nodes alive (and draining) at `listed_at`; the caller kills what
        it names."""
        with self._lock:
            return self._state.reconcile(alive, listed_at, alive_nodes, draining_nodes)
