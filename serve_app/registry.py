"""The registry of slots, request actors, their rows and the memory reserved on each slot (pure: no Ray).

One `RegistryState` lives in one place (the `RegistryActor`, registry_actor.py); every
ingress replica commits decisions through it: `admit` decides on the current state and
commits the decision in the same call, each commit re-checking its condition, and the
wrapper runs each call under one lock, so two replicas can never both commit the last
free bytes of a slot or the last free row of a batch.

Reservations. An actor holds `resident_bytes` (weights + per-process overhead) for its
whole life, plus, per row (one running request), that request's KV cache + workspace.
A slot's `reserved_bytes` is always the sum over its actors (`check_invariants`).
Lifecycle of an actor:

    try_warm      -> "warming"   (resident reserved; a warm actor started ahead of requests)
    warm_ready    -> "warm"      (its embeddings and first layers are in; it may be bound)
    try_bind      -> "starting"  (a warm or warming actor takes its request; the rest streams in)
    try_spawn     -> "starting"  (resident + its first row reserved; it is loading)
    actor_started -> "busy"      (its first token: every weight is resident, it may batch)
    try_dispatch  -> "busy"      (an "idle" actor takes a row)
    try_join      -> "busy"      (a busy hot actor takes one more row, up to max_batch)
    finish(row, "complete" | "cancelled")  -> the row's bytes released; with no row
                     left the actor goes "idle" if hot, else is forgotten (it exits itself)
    finish(row, "failed"), or a cancelled "starting" actor, or remove
                  -> forgotten with everything it held, and reported to be killed
    a Spawn that names actors to `evict` (idle hot or warm ones on its slot)
                  -> those are forgotten in the same commit; the ingress kills them

An actor that exits after its last row is forgotten at `finish`, before its process has
quite gone: a new actor on that slot takes seconds to start before it allocates, so the
overlap is harmless, and waiting for Ray to confirm the exit would idle the slot.

Predictions. Each row keeps the end its admission predicted (now + the scorer's total
time), from which a refusal's retry-after is computed (retry_after.py).

Crashes and restarts: registry_recovery.py (reconcile with Ray, hand-overs to a new registry).

Time. `now` and `busy_deadline` are epoch seconds from the registry's own clock (the
wrapper adds a timeout to its own `time.time()`), so replicas' clocks never mix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from actors.actor_names import REGISTRY_NAME, is_request_actor_name
from serve_app.decisions import Bind, Decision, Dispatch, Join, Reject, Spawn
from serve_app.policy import PolicyConfig, decide, warm_candidates
from serve_app.registry_records import (
    ActorRecord,
    AdoptedActor,
    AdoptedRow,
    Outcome,
    ReconcileReport,
    RowReservation,
    SlotRecord,
    SlotSpec,
)
from serve_app.registry_recovery import Recovery
from serve_app.registry_warm import WarmBooks
from serve_app.retry_after import retry_after_s
from serve_app.scorer import RULE_SCORER, Scorer
from serve_app.snapshot import (
    ActorView,
    ClusterSnapshot,
    RequestFeatures,
    SlotView,
)
from serve_app.warm_pool import LANES

# Re-exported: the registry's callers name these through this module.
__all__ = ["AdoptedActor", "AdoptedRow", "Outcome", "ReconcileReport", "RegistryState",
           "RowReservation", "SlotSpec", "is_request_actor_name"]

# How long an abandoned request id is remembered: longer than any admission call can be in flight.
ABANDONED_MEMORY_S = 60.0



@dataclass(frozen=True)
class RegistryConfig:
    name: str = REGISTRY_NAME
    namespace: str = "zeroqueue"  # where the registry lives
    actor_namespace: str = "zeroqueue"  # where request actors live (ActorConfig.namespace)
    reconcile_interval_s: float = 1.0
    # An actor is committed before it is created; creation shows in Ray's table within
    # milliseconds, so this only has to outlast a slow ingress between commit and spawn.
    spawn_grace_s: float = 10.0
    # An ingress replica not heard from for this long is gone; with none left, everything goes.
    replica_lease_s: float = 120.0
    # After a (re)start, how long the replicas have to hand their running rows back before
    # unknown actors are killed as orphans: five heartbeats, where a hand-over needs one; short,
    # because until then an orphan holds a slot.
    adopt_grace_s: float = 5.0
    # A replica not heard from for this long (ten heartbeats) is gone: the rows it relayed are released.
    replica_silence_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.reconcile_interval_s > 0 or not self.replica_lease_s > 0 or self.adopt_grace_s < 0:
            raise ValueError(f"reconcile_interval_s and replica_lease_s must be > 0 and adopt_grace_s >= 0, got "
                             f"{self.reconcile_interval_s}, {self.replica_lease_s}, {self.adopt_grace_s}")


class RegistryState(Recovery, WarmBooks):
    def __init__(self, max_actors_per_slot: int = 1, spawn_grace_s: float = 10.0,
                 max_idle_s: float | None = None, max_batch: int = 8) -> None:
        if max_actors_per_slot < 1 or max_batch < 1:
            raise ValueError(f"max_actors_per_slot and max_batch must be >= 1, got {max_actors_per_slot}, {max_batch}")
        if spawn_grace_s < 0 or (max_idle_s is not None and max_idle_s < 0):
            raise ValueError(f"spawn_grace_s and max_idle_s must be >= 0, got {spawn_grace_s}, {max_idle_s}")
        self.max_actors_per_slot = max_actors_per_slot
        self.max_batch = max_batch
        self.spawn_grace_s = spawn_grace_s
        self.max_idle_s = max_idle_s
        self._slots: dict[str, SlotRecord] = {}  # ordered by slot_id: the first-fit order
        self._actors: dict[str, ActorRecord] = {}
        # Views are rebuilt only for what changed, so a snapshot of 1,000 slots stays cheap.
        self._slot_views: dict[str, SlotView] = {}
        self._actor_views: dict[str, ActorView] = {}
        self._version = 0
        self._snapshot: ClusterSnapshot | None = None
        self._last_request_at: dict[str, float] = {}  # model -> its latest admission (or its pool's first fill)
        # Decisions by kind, actors evicted, and spawns decided while a warm actor of the model fitted
        # (a process start the warm pool was there to spare): what benchmarks and /health report.
        self.counters: Counter[str] = Counter()
        # Requests whose caller gave up before their admission was seen here (request id -> when):
        # an admission that arrives after its abandonment must not commit.
        self._abandoned: dict[str, float] = {}

    def reconfigure(self, max_actors_per_slot: int, max_idle_s: float | None, max_batch: int) -> None:
        """A redeploy's policy: applies to commits from now on (actors and rows already placed stay)."""
        if max_actors_per_slot < 1 or max_batch < 1 or (max_idle_s is not None and max_idle_s < 0):
            raise ValueError(f"invalid limits: {max_actors_per_slot}, {max_idle_s}, {max_batch}")
        self.max_actors_per_slot, self.max_idle_s, self.max_batch = max_actors_per_slot, max_idle_s, max_batch

    # ---- slots -----------------------------------------------------------------------

    def register_slots(self, slots: Iterable[SlotSpec]) -> None:
        """Add slots, or update the node and total of known ones (never below what is reserved)."""
        for spec in slots:
            if spec.total_bytes < 0:
                raise ValueError(f"slot {spec.slot_id}: total_bytes must be >= 0, got {spec.total_bytes}")
            slot = self._slots.get(spec.slot_id)
            if slot is None:
                slot = self._slots[spec.slot_id] = SlotRecord(spec.slot_id, spec.node_id, spec.total_bytes)
            elif spec.total_bytes < slot.reserved_bytes:
                raise ValueError(f"slot {spec.slot_id}: total_bytes {spec.total_bytes} is below the "
                                 f"{slot.reserved_bytes} bytes already reserved on it")
            slot.node_id, slot.total_bytes = spec.node_id, spec.total_bytes
            self._touch_slot(slot)
        self._slots = dict(sorted(self._slots.items()))
        self._slot_views = {k: self._slot_views[k] for k in self._slots}

    @property
    def slot_ids(self):
        """A live view of the registered slot ids (no copy: admissions consult it)."""
        return self._slots.keys()

    def update_slot_stats(self, slot_id: str, fragmentation: float, utilization: float) -> None:
        slot = self._slots.get(slot_id)
        if slot is None:
            raise KeyError(f"unknown slot {slot_id!r}")
        slot.fragmentation, slot.utilization = fragmentation, utilization
        self._touch_slot(slot)

    # ---- reads -----------------------------------------------------------------------

    def snapshot(self) -> ClusterSnapshot:
        if self._snapshot is None:
            self._snapshot = ClusterSnapshot(
                tuple(self._slot_views.values()), tuple(self._actor_views.values()), self._version
            )
        return self._snapshot

    def check_invariants(self) -> None:
        """Raise AssertionError unless every slot's books match its actors and their rows exactly."""
        reserved = dict.fromkeys(self._slots, 0)
        counts = dict.fromkeys(self._slots, 0)
        for a in self._actors.values():
            assert a.slot_id in self._slots, f"actor {a.name} is on unknown slot {a.slot_id}"
            assert a.resident_bytes >= 0 and all(r.request_bytes >= 0 for r in a.rows.values()), (
                f"actor {a.name} has negative bytes")
            assert (a.state in ("idle", "warm", "warming")) == (not a.rows), (
                f"actor {a.name} is {a.state} with {len(a.rows)} rows")
            assert a.state not in ("warm", "warming") or not a.is_hot, f"warm actor {a.name} is marked hot"
            assert a.state != "starting" or len(a.rows) == 1, f"starting actor {a.name} has {len(a.rows)} rows"
            assert len(a.rows) <= self.max_batch, f"actor {a.name} runs {len(a.rows)} rows > {self.max_batch}"
            assert len(a.rows) <= 1 or a.is_hot, f"actor {a.name} batches rows but is not hot"
            reserved[a.slot_id] += a.reserved_bytes
            counts[a.slot_id] += 1
        for s in self._slots.values():
            assert s.reserved_bytes == reserved[s.slot_id], (
                f"slot {s.slot_id}: reserved {s.reserved_bytes} != sum over its actors {reserved[s.slot_id]}")
            assert s.reserved_bytes <= s.total_bytes, f"slot {s.slot_id} over-committed"
            assert s.num_actors == counts[s.slot_id] <= self.max_actors_per_slot, (
                f"slot {s.slot_id}: {s.num_actors} actors recorded, {counts[s.slot_id]} registered")
        assert self.snapshot() == ClusterSnapshot(
            tuple(s.view() for s in self._slots.values()), tuple(a.view() for a in self._actors.values()),
            self._version), "the cached snapshot is stale"

    # ---- compare-and-set -------------------------------------------------------------

    def try_spawn(self, decision: Spawn, actor_name: str, model: str, row: RowReservation, now: float) -> bool:
        """Reserve `decision.reserve_bytes` on its slot for a new actor and its first row, if it still fits."""
        if actor_name in self._actors:
            raise ValueError(f"actor {actor_name} is already registered")
        slot = self._slots.get(decision.slot_id)
        if (slot is None or slot.free_bytes < decision.reserve_bytes
                or slot.num_actors >= self.max_actors_per_slot):
            return False
        row.request_bytes = decision.reserve_bytes - decision.resident_bytes
        self._register(ActorRecord(actor_name, model, slot.slot_id, decision.lane, "starting", decision.keep_hot,
                              decision.resident_bytes, now, {row.request_id: row}), slot)
        return True

    def try_dispatch(self, decision: Dispatch, row: RowReservation) -> bool:
        """Give an idle actor its one row, if it is still idle and the row fits."""
        actor = self._actors.get(decision.actor_name)
        if actor is None or actor.state != "idle":
            return False
        if not self._add_row(actor, decision.slot_id, decision.reserve_bytes, row):
            return False
        actor.is_hot = decision.keep_hot
        self._touch_actor(actor)
        return True

    def try_join(self, decision: Join, row: RowReservation) -> bool:
        """Add a row to a busy hot actor's batch, if it is still hot, has a free row, and the row fits."""
        actor = self._actors.get(decision.actor_name)
        if actor is None or actor.state != "busy" or not actor.is_hot or len(actor.rows) >= self.max_batch:
            return False
        return self._add_row(actor, decision.slot_id, decision.reserve_bytes, row)

    def try_bind(self, decision: Bind, row: RowReservation) -> bool:
        """Give a warm (or warming) actor its request, if it is still unbound and the row fits."""
        actor = self._actors.get(decision.actor_name)
        if actor is None or actor.state not in ("warm", "warming"):
            return False
        if not self._add_row(actor, decision.slot_id, decision.reserve_bytes, row):
            return False
        actor.state, actor.lane, actor.is_hot = "starting", decision.lane, decision.keep_hot
        self._touch_actor(actor)
        return True

    def admit(self, features: RequestFeatures, policy: PolicyConfig, spawn_name: str, request_id: str,
              now: float, scorer: Scorer = RULE_SCORER, replica_id: str = "") -> Decision:
        """`decide` on the current state and commit it in the same call; a Spawn is named `spawn_name`.

        A refusal for capacity or latency comes back with the predicted `retry_after_s`.
        """
        if policy.max_actors_per_slot != self.max_actors_per_slot or policy.max_batch != self.max_batch:
            raise ValueError(f"policy (max_actors_per_slot={policy.max_actors_per_slot}, max_batch="
                             f"{policy.max_batch}) != the registry's ({self.max_actors_per_slot}, {self.max_batch})")
        if request_id in self._abandoned:
            return Reject("no_capacity", None, f"request {request_id} was given up before it was admitted")
        self._last_request_at[features.model] = now
        snapshot = self.snapshot()
        decision = decide(features, snapshot, policy, scorer)
        if isinstance(decision, Reject):
            self.counters["reject"] += 1
            if decision.retry_after_s is None:
                return decision
            wait = retry_after_s(features, snapshot, policy, now)
            return Reject(decision.reason, wait, decision.message)
        is_cold = isinstance(decision, (Spawn, Bind))  # its weights may still be streaming in
        predicted_total = decision.prediction.total_s if decision.prediction is not None else 0.0
        row = RowReservation(request_id, features.num_tokens, features.tpot_target_s, now + predicted_total,
                             now + policy.busy_timeout_s(features, is_cold), replica_id=replica_id)
        if isinstance(decision, Spawn):
            is_committed = self._evict(decision.evict) and self.try_spawn(decision, spawn_name, features.model,
                                                                          row, now)
        elif isinstance(decision, Bind):
            is_committed = self.try_bind(decision, row)
        elif isinstance(decision, Join):
            is_committed = self.try_join(decision, row)
        else:
            is_committed = self.try_dispatch(decision, row)
        if not is_committed:
            raise RuntimeError(f"{decision} was decided on the current state but failed to commit")
        self.counters[type(decision).__name__.lower()] += 1
        if isinstance(decision, Spawn):
            self.counters["evicted"] += len(decision.evict)
            self.counters["spawn_with_warm_available"] += bool(warm_candidates(features, LANES, snapshot, 1))
        return decision

    # ---- lifecycle -------------------------------------------------------------------

    def actor_started(self, actor_name: str) -> bool:
        """A cold actor's first token: every weight is resident, so it may batch from now on."""
        actor = self._actors.get(actor_name)
        if actor is None or actor.state != "starting":
            return False
        actor.state = "busy"
        self._touch_actor(actor)
        return True

    def finish(self, actor_name: str, request_id: str, outcome: Outcome, now: float) -> bool:
        """A row ended. True when the actor must be killed (it failed, or a load nobody waits for).

        Unknown actors or rows (already finished, reclaimed, or never committed) change nothing.
        """
        actor = self._actors.get(actor_name)
        if actor is None or request_id not in actor.rows:
            return False
        if outcome == "failed" or (outcome == "cancelled" and actor.state == "starting"):
            self._forget(actor)
            return True
        row = actor.rows.pop(request_id)
        slot = self._slots[actor.slot_id]
        slot.reserved_bytes -= row.request_bytes
        if not actor.rows:
            if not actor.is_hot:
                self._forget(actor)  # it exits by itself after its last row
                return False
            actor.state, actor.idle_since = "idle", now
        self._touch_slot(slot)
        self._touch_actor(actor)
        return False

    def abandon(self, request_id: str, now: float) -> tuple[str, bool] | None:
        """Undo what an admission committed for `request_id`, if anything: its caller gave up on it.

        The row is finished as cancelled (an actor still starting for it is forgotten); returns
        (the actor's name, whether it must be killed), or None when nothing holds the request.
        """
        for actor in self._actors.values():
            if request_id in actor.rows:
                return actor.name, self.finish(actor.name, request_id, "cancelled", now)
        # Not admitted yet (or never will be): remembered, so that a late admission does not commit.
        self._abandoned = {r: t for r, t in self._abandoned.items() if now - t < ABANDONED_MEMORY_S}
        self._abandoned[request_id] = now
        return None

    def remove(self, actor_name: str) -> bool:
        actor = self._actors.get(actor_name)
        if actor is None:
            return False
        self._forget(actor)
        return True

    def _evict(self, names: tuple[str, ...]) -> bool:
        """Forget actors a Spawn retires, if every one is still idle or warm (all or none)."""
        actors = [self._actors.get(n) for n in names]
        if any(a is None or a.state not in ("idle", "warm", "warming") for a in actors):
            return False
        for a in actors:
            self._forget(a)
        return True

    # ---- internals -------------------------------------------------------------------

    def _register(self, actor: ActorRecord, slot: SlotRecord) -> None:
        """A new actor on `slot`, holding everything it reserves from now on."""
        self._actors[actor.name] = actor
        slot.reserved_bytes += actor.reserved_bytes
        slot.num_actors += 1
        self._touch_slot(slot)
        self._touch_actor(actor)

    def _add_row(self, actor: ActorRecord, slot_id: str, reserve_bytes: int, row: RowReservation) -> bool:
        slot = self._slots[actor.slot_id]
        if actor.slot_id != slot_id or slot.free_bytes < reserve_bytes:
            return False
        row.request_bytes = reserve_bytes
        actor.rows[row.request_id] = row
        actor.state, actor.idle_since = "busy", None
        slot.reserved_bytes += reserve_bytes
        self._touch_slot(slot)
        self._touch_actor(actor)
        return True

    def _forget(self, actor: ActorRecord) -> None:
        slot = self._slots[actor.slot_id]
        slot.reserved_bytes -= actor.reserved_bytes
        slot.num_actors -= 1
        del self._actors[actor.name]
        del self._actor_views[actor.name]
        self._touch_slot(slot)

    def _touch_slot(self, slot: SlotRecord) -> None:
        self._slot_views[slot.slot_id] = slot.view()
        self._changed()

    def _touch_actor(self, actor: ActorRecord) -> None:
        self._actor_views[actor.name] = actor.view()
        self._changed()

    def _changed(self) -> None:
        self._version += 1
        self._snapshot = None

