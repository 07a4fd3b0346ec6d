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

The books themselves (slots, actors, rows and the operations that keep them consistent) are
registry_books.py's; `RegistryState` commits decisions on them, with two collaborators on the
same books: `WarmBooks` (registry_warm.py: warm pools) and `Recovery` (registry_recovery.py:
reconcile with what is alive, hand-overs to a new registry).

Time. `now` and `busy_deadline` are epoch seconds from the registry's own clock (the
wrapper adds a timeout to its own `time.time()`), so replicas' clocks never mix.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from actors.actor_names import REGISTRY_NAME, is_request_actor_name
from serve_app.decisions import Bind, Decision, Dispatch, Join, Reject, Spawn
from serve_app.lease import LeaseGrant, LeaseReport, SlowPathLease
from serve_app.policy import PolicyConfig, decide, warm_candidates
from serve_app.registry_books import Books
from serve_app.registry_capacity import CapacityBooks
from serve_app.registry_leases import LeaseBooks
from serve_app.registry_records import (
    ActorRecord,
    AdoptedActor,
    AdoptedRow,
    Outcome,
    ReconcileReport,
    RowReservation,
    SlotSpec,
)
from serve_app.registry_recovery import Recovery
from serve_app.registry_warm import WarmBooks
from serve_app.retry_after import retry_after_s
from serve_app.scorer import RULE_SCORER, Scorer, rule_of
from serve_app.snapshot import ClusterSnapshot, ClusterSummary, RequestFeatures, summarize
from serve_app.warm_pool import LANES, WarmFill, WarmSpec

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


def _cold_start_s(features: RequestFeatures, scorer: Scorer) -> float:
    """A fresh actor's start to its first layers' worth of weights, as the rule predicts it: what a slot on a
    new node adds to that node's start before it serves (the trained scorer has no such constant)."""
    return rule_of(scorer).start_s(features.weight_bytes)


def is_leased_row(decision: Decision) -> bool:
    """A placement whose row can be leased: on a hot actor that stays hot (a join, or a dispatch that keeps
    it), where the row outlives its request. A cold or warm actor's first row is not: its actor's start
    (and its exit, if it does not stay) is the registry's to follow."""
    return isinstance(decision, Join) or (isinstance(decision, Dispatch) and decision.keep_hot)


# How long the counts sent with lease grants (for the replicas' gauges) may be reused: Ray exports metrics
# once a second at best.
SUMMARY_MAX_AGE_S = 1.0


class RegistryState:
    def __init__(self, max_actors_per_slot: int = 1, spawn_grace_s: float = 10.0,
                 max_idle_s: float | None = None, max_batch: int = 32) -> None:
        self.books = Books(max_actors_per_slot, spawn_grace_s, max_idle_s, max_batch)
        self.warm = WarmBooks(self.books)
        self.recovery = Recovery(self.books, self.finish)
        self.leases = LeaseBooks(self.books, self.finish)
        self.capacity = CapacityBooks(self.books)
        # Decisions by kind, actors evicted, and spawns decided while a warm actor of the model fitted
        # (a process start the warm pool was there to spare): what benchmarks and /health report.
        self.counters: Counter[str] = Counter()
        # Requests whose caller gave up before their admission was seen here (request id -> when):
        # an admission that arrives after its abandonment must not commit.
        self._abandoned: dict[str, float] = {}
        self._summary: tuple[float, ClusterSummary] | None = None  # (when, the counts) for exchange_leases
        # The retry instants refusals were told, per (model, lane), while still ahead: the next refusal
        # is told the next place after them, so that refused clients do not all come back at once.
        self._promised: dict[tuple[str, str], list[float]] = {}

    @property
    def max_actors_per_slot(self) -> int:
        return self.books.max_actors_per_slot

    @property
    def max_batch(self) -> int:
        return self.books.max_batch

    def reconfigure(self, max_actors_per_slot: int, max_idle_s: float | None, max_batch: int) -> None:
        """A redeploy's policy: applies to commits from now on (actors and rows already placed stay)."""
        self.books.set_limits(max_actors_per_slot, max_idle_s, max_batch)

    # ---- slots and reads -------------------------------------------------------------

    def register_slots(self, slots: Iterable[SlotSpec]) -> None:
        """Add slots, or update the node and total of known ones (never below what is reserved)."""
        self.books.register_slots(slots)

    @property
    def slot_ids(self):
        """A live view of the registered slot ids (no copy: admissions consult it)."""
        return self.books.slots.keys()

    def update_slot_stats(self, slot_id: str, fragmentation: float, utilization: float) -> None:
        self.books.update_slot_stats(slot_id, fragmentation, utilization)

    def snapshot(self) -> ClusterSnapshot:
        return self.books.snapshot()

    def check_invariants(self) -> None:
        """Raise AssertionError unless every slot's books match its actors and their rows exactly."""
        self.books.check_invariants()

    # ---- compare-and-set -------------------------------------------------------------

    def try_spawn(self, decision: Spawn, actor_name: str, model: str, row: RowReservation, now: float) -> bool:
        """Reserve `decision.reserve_bytes` on its slot for a new actor and its first row, if it still fits."""
        books = self.books
        if actor_name in books.actors:
            raise ValueError(f"actor {actor_name} is already registered")
        slot = books.slots.get(decision.slot_id)
        if (slot is None or slot.free_bytes < decision.reserve_bytes
                or slot.num_actors >= books.max_actors_per_slot):
            return False
        row.request_bytes = decision.reserve_bytes - decision.resident_bytes
        books.register(ActorRecord(actor_name, model, slot.slot_id, decision.lane, "starting", decision.keep_hot,
                                   decision.resident_bytes, now, {row.request_id: row}), slot)
        return True

    def try_dispatch(self, decision: Dispatch, row: RowReservation) -> bool:
        """Give an idle actor its one row, if it is still idle and the row fits."""
        actor = self.books.actors.get(decision.actor_name)
        if actor is None or actor.state != "idle" or not self._add_row(actor, decision.slot_id,
                                                                          decision.reserve_bytes, row):
            return False
        actor.is_hot = decision.keep_hot
        self.books.touch_actor(actor)
        return True

    def try_join(self, decision: Join, row: RowReservation) -> bool:
        """Add a row to a busy hot actor's batch, if it is still hot, has a free row, and the row fits."""
        actor = self.books.actors.get(decision.actor_name)
        if actor is None or actor.state != "busy" or not actor.is_hot or len(actor.rows) >= self.books.max_batch:
            return False
        return self._add_row(actor, decision.slot_id, decision.reserve_bytes, row)

    def try_bind(self, decision: Bind, row: RowReservation) -> bool:
        """Give a warm (or warming) actor its request, if it is still unbound and the row fits."""
        actor = self.books.actors.get(decision.actor_name)
        if actor is None or actor.state not in ("warm", "warming") or not self._add_row(
                actor, decision.slot_id, decision.reserve_bytes, row):
            return False
        actor.state, actor.lane, actor.is_hot = "starting", decision.lane, decision.keep_hot
        self.books.touch_actor(actor)
        return True

    def admit(self, features: RequestFeatures, policy: PolicyConfig, spawn_name: str, request_id: str,
              now: float, scorer: Scorer = RULE_SCORER, replica_id: str = "",
              lease: SlowPathLease | None = None) -> Decision:
        """`decide` on the current state and commit it in the same call; a Spawn is named `spawn_name`.

        A refusal for capacity or latency comes back with the predicted `retry_after_s`. With
        `lease` (a replica that holds leases), the free rows it gives back return first, and a row
        placed on an actor that stays hot (`is_leased_row`) is leased to `replica_id` from the start
        (lease.py), its id the request's: the replica keeps it after the request ends, and no `finish`
        is sent for it.
        """
        if policy.max_actors_per_slot != self.max_actors_per_slot or policy.max_batch != self.max_batch:
            raise ValueError(f"policy (max_actors_per_slot={policy.max_actors_per_slot}, max_batch="
                             f"{policy.max_batch}) != the registry's ({self.max_actors_per_slot}, {self.max_batch})")
        if request_id in self._abandoned:
            return Reject("no_capacity", None, f"request {request_id} was given up before it was admitted")
        for row_id in lease.returned if lease is not None else ():
            self.leases.give_back(replica_id, row_id, now)
        if lease is not None and lease.in_use:
            self.leases.record_uses(replica_id, lease.in_use, now)
        if lease is not None and lease.step_corrections:
            self.leases.record_corrections(replica_id, lease.step_corrections)
        self.books.last_request_at[features.model] = now
        snapshot = self.snapshot()
        decision = decide(features, snapshot, policy, scorer)
        if (isinstance(decision, Reject) and decision.retry_after_s is not None and lease is not None
                and self.leases.recall_free_row(features.model, policy.lane(features.input_tokens, features.max_tokens),
                                                features.dispatch_bytes, replica_id, now)):
            snapshot = self.snapshot()  # a row other replicas left free may take it
            decision = decide(features, snapshot, policy, scorer)
            self.counters["recalled"] += 1
        if (policy.lane(features.input_tokens, features.max_tokens) == "long" and self._is_last_resort(decision, "long")
                and self.leases.recall_idle_actor(features.model, "short", features.dispatch_bytes, now)):
            # A short-lane actor that runs nothing but whose rows are leased is busy for the books; idle once they
            # are back, it serves a long request the policy would otherwise refuse or put on a warm or warming
            # actor (an OpenAI request without max_tokens on an idle `make serve`: bound to the pool's warming
            # actor, one waited 14 s for its first token).
            snapshot = self.snapshot()
            decision = decide(features, snapshot, policy, scorer)
            self.counters["recalled_actor"] += 1
        if isinstance(decision, Reject):
            self.counters["reject"] += 1
            ready_in = None
            if decision.reason == "no_capacity":
                self.leases.refused(features.model, now)
                self.capacity.observe(snapshot, now)  # every slot was busy now: the plan must see it
                ready_in = self.capacity.ready_in_s(now, _cold_start_s(features, scorer))
                self.capacity.num_refused_for_capacity += ready_in is not None
            if decision.retry_after_s is None:
                return decision
            key = (features.model, policy.lane(features.input_tokens, features.max_tokens))
            promised = [t for t in self._promised.get(key, ()) if t > now]
            wait = retry_after_s(features, snapshot, policy, now, ready_in, scorer, num_promised=len(promised))
            self._promised[key] = [*promised, now + wait]
            return Reject(decision.reason, wait, decision.message)
        is_cold = isinstance(decision, (Spawn, Bind))  # its weights may still be streaming in
        predicted_total = decision.prediction.total_s if decision.prediction is not None else 0.0
        is_lease = lease is not None and is_leased_row(decision)
        row = RowReservation(request_id, features.num_tokens, features.tpot_target_s, now + predicted_total,
                             now + (lease.ttl_s if is_lease else policy.busy_timeout_s(features, is_cold)),
                             replica_id=replica_id, is_lease=is_lease,
                             # Its holder reports when its prompt is done. A row nobody reports is a start's
                             # (no join before its first token) or on an actor that does not stay hot.
                             pending_prompt_tokens=features.input_tokens if is_lease else 0)
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

    def _is_last_resort(self, decision: Decision, lane: str) -> bool:
        """A refusal with a retry, or a bind of a warming actor or of a warm one of another lane than the request's
        `lane`: what `decide` falls back to where that lane has nothing within the request's targets."""
        if isinstance(decision, Reject):
            return decision.retry_after_s is not None
        actor = self.books.actors.get(decision.actor_name) if isinstance(decision, Bind) else None
        return actor is not None and (actor.state == "warming" or actor.lane != lane)

    def exchange_leases(self, report: LeaseReport, now: float) -> LeaseGrant:
        """One replica's lease heartbeat (registry_leases.py), with the registry's counts for its gauges: those
        come from a snapshot of every slot and actor, so one summary serves every exchange for
        SUMMARY_MAX_AGE_S (the gauges' own resolution), not one snapshot per replica's heartbeat."""
        grant = self.leases.exchange(report, now)
        self.capacity.record(report.demand, now)
        if self._summary is None or not 0 <= now - self._summary[0] < SUMMARY_MAX_AGE_S:
            self._summary = (now, self.summary())
        return dataclasses.replace(grant, summary=self._summary[1])

    def summary(self) -> ClusterSummary:
        """The counts of the books now, with the capacity plan's where planning is on."""
        summary = summarize(self.snapshot(), self.max_batch)
        if not self.capacity.is_enabled:
            return summary
        status = self.capacity.status()
        return dataclasses.replace(summary, num_slots_wanted=status.num_wanted,
                                   num_nodes_pending=status.num_nodes_pending,
                                   num_refused_for_capacity=status.num_refused_for_capacity)

    # ---- lifecycle -------------------------------------------------------------------

    def actor_started(self, actor_name: str) -> bool:
        """A cold actor's first token: every weight is resident, so it may batch from now on."""
        actor = self.books.actors.get(actor_name)
        if actor is None or actor.state != "starting":
            return False
        actor.state, actor.start_lease = "busy", ""
        self.books.touch_actor(actor)
        return True

    def finish(self, actor_name: str, request_id: str, outcome: Outcome, now: float) -> bool:
        """A row ended. True when the actor must be killed (it failed, or a load nobody waits for).

        Unknown actors or rows (already finished, reclaimed, or never committed) change nothing.
        """
        books = self.books
        actor = books.actors.get(actor_name)
        if actor is None or request_id not in actor.rows:
            return False
        if outcome == "failed" or (outcome == "cancelled" and actor.state == "starting"):
            books.forget(actor)
            return True
        books.end_row(actor, request_id)
        if not actor.rows:
            if not actor.is_hot:
                books.forget(actor)  # it exits by itself after its last row
                return False
            actor.state, actor.idle_since = "idle", now
            # Nobody runs a request there to report it again: a stale figure (a busy host's, a burst's) would
            # price, and refuse, every dispatch to it from now on. Its long-run figure until a request starts
            # there: how this machine runs the rule's steps as a rule, where the constants alone may be far off.
            actor.step_correction = actor.step_baseline
        books.touch_actor(actor)
        return False

    def abandon(self, request_id: str, now: float) -> tuple[str, bool] | None:
        """Undo what an admission committed for `request_id`, if anything: its caller gave up on it.

        The row is finished as cancelled (an actor still starting for it is forgotten); returns
        (the actor's name, whether it must be killed), or None when nothing holds the request.
        """
        holder = self.books.row_holder(request_id)
        if holder is not None:
            return holder.name, self.finish(holder.name, request_id, "cancelled", now)
        # Not admitted yet (or never will be): remembered, so that a late admission does not commit.
        self._abandoned = {r: t for r, t in self._abandoned.items() if now - t < ABANDONED_MEMORY_S}
        self._abandoned[request_id] = now
        return None

    def remove(self, actor_name: str) -> bool:
        actor = self.books.actors.get(actor_name)
        if actor is None:
            return False
        self.books.forget(actor)
        return True

    # ---- warm pools and recovery (the collaborators' own docs say how) -----------------

    def fill_warm(self, specs: list[WarmSpec], policy: PolicyConfig, names: dict[str, list[str]],
                  now: float) -> list[tuple[str, WarmFill]]:
        return self.warm.fill_warm(specs, policy, names, now)

    def warm_created(self, actor_name: str) -> bool:
        return self.warm.warm_created(actor_name)

    def warm_ready(self, actor_name: str, resident_fraction: float) -> bool:
        return self.warm.warm_ready(actor_name, resident_fraction)

    def drop_warming(self, actor_name: str) -> bool:
        return self.warm.drop_warming(actor_name)

    def reconcile(self, alive: set[str], now: float, alive_nodes: set[str] | None = None,
                  draining_nodes: set[str] = frozenset()) -> ReconcileReport:
        self.leases.expire(now)  # before: a lease past its expiry returns; it does not expire its actor
        # Free leased rows on a draining node return: their holders would place requests there unasked.
        if draining_nodes:
            self.leases.take_back_free(lambda a: self.books.slots[a.slot_id].node_id in draining_nodes, now)
        return self.recovery.reconcile(alive, now, alive_nodes, draining_nodes)

    def adopt(self, rows: Iterable[AdoptedRow], now: float, idle: Iterable[AdoptedActor] = ()) -> list[str]:
        return self.recovery.adopt(rows, now, idle)

    def release_rows_of(self, replica_ids: set[str], now: float) -> list[str]:
        return self.recovery.release_rows_of(replica_ids, now)

    # ---- internals -------------------------------------------------------------------

    def _evict(self, names: tuple[str, ...]) -> bool:
        """Forget actors a Spawn retires, if every one is still idle or warm (all or none)."""
        actors = [self.books.actors.get(n) for n in names]
        if any(a is None or a.state not in ("idle", "warm", "warming") for a in actors):
            return False
        for a in actors:
            self.books.forget(a)
        return True

    def _add_row(self, actor: ActorRecord, slot_id: str, reserve_bytes: int, row: RowReservation) -> bool:
        return actor.slot_id == slot_id and self.books.add_row(actor, row, reserve_bytes)
