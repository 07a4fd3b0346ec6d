"""The zero-queue cluster with leases and N ingress replicas, in simulated time: the real books on both sides.

`LeasedCluster` answers the simulator's `Cluster` protocol (sim_model.py) as the product admits:

- the registry is the real `RegistryState` (prewarmed as `RegistryCluster` does), and each ingress replica a
  real `LeaseBook` (serve_app/lease_book.py);
- an arrival goes to a replica drawn at random (Serve's router deals requests to replicas, not to rows);
  that replica places it with the real `LeaseBook.place` (the same `decide()` on its leased view, as admission.py)
  and takes the row with no registry call; a view that cannot place it sends it down the slow path,
  `RegistryState.admit` with a `SlowPathLease` (the replica's free rows of the model go back first, a row
  on a hot actor comes back leased, another replica's reported-free row may be recalled before a refusal);
- each replica's heartbeat exchange (`report` -> `exchange_leases` -> `apply`, then the free rows of a
  contended model given back) runs every `heartbeat_s`, the replicas' heartbeats staggered evenly, and the
  registry expires unrenewed rows at each; a row's end goes back to its replica's book (`release`), and to
  the registry only while its model is contended (`give_back`), as rows.py does;
- a row the registry recalled while its holder still thought it free is turned away when that holder
  places a request in it (the actor's `StreamBusy` in the product): the holder forgets it and decides again;
- early refusal (admission.py's `refuse_early`): after a slow-path refusal for capacity, that replica refuses
  the model itself for `early_refusal_s` unless a row of it ended there since; the first request after the
  window asks again.

What it leaves out: calls take no simulated time (a slow-path decision sees the registry as it is at the
arrival; in the product the call takes milliseconds, the heartbeat's view is as old as here); replicas
never fail or restart.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from benchmarks.sim_clusters import MODEL, RegistryCluster, _predicted_end, actor_name
from serve_app.decisions import Decision, Reject, Spawn
from serve_app.lease import LeaseConfig, LeasedRow, SlowPathLease
from serve_app.lease_book import LeaseBook
from serve_app.policy import PolicyConfig
from serve_app.registry import is_leased_row
from serve_app.scorer import RULE_SCORER, Scorer
from serve_app.snapshot import RequestFeatures


@dataclasses.dataclass
class LeaseCounts:
    local: int = 0  # placed on a leased row by the replica alone
    slow_path: int = 0  # RegistryState.admit calls
    early_refusals: int = 0  # refused by the replica with no registry call
    turned_away: int = 0  # a recalled row taken by its old holder: decided again
    exchanges: int = 0
    give_backs: int = 0  # rows given back at their end (contended model)


class LeasedCluster:
    def __init__(self, slot_bytes: Sequence[int], policy: PolicyConfig, resident_bytes: int,
                 num_prewarmed: int = 0, scorer: Scorer = RULE_SCORER, slots_per_node: int = 8,
                 num_prewarmed_long: int = 0, *, num_replicas: int = 2, heartbeat_s: float = 1.0,
                 leases: LeaseConfig | None = None, early_refusal_s: float = 0.1, seed: int = 0) -> None:
        self._central = RegistryCluster(slot_bytes, policy, resident_bytes, num_prewarmed, scorer, slots_per_node,
                                        num_prewarmed_long)
        self.policy, self.scorer, self.state = policy, scorer, self._central.state
        self.heartbeat_s, self.early_refusal_s, self.resident_bytes = heartbeat_s, early_refusal_s, resident_bytes
        config = leases or LeaseConfig()
        self.books = [LeaseBook(config, f"replica-{i}", policy.max_batch, heartbeat_s) for i in range(num_replicas)]
        # Staggered: replica i first exchanges at (i + 1) / N of a heartbeat.
        self._next_exchange = [heartbeat_s * (i + 1) / num_replicas for i in range(num_replicas)]
        self._next_expiry = heartbeat_s  # the registry's own reconcile loop, once a heartbeat
        self._rng = random.Random(seed)
        self._rows: dict[int, tuple[int, str | None]] = {}  # request -> (its replica, its leased row or None)
        # Per replica, model -> (refused early until, rows it had ended then).
        self._refused_until: list[dict[str, tuple[float, int]]] = [{} for _ in self.books]
        self._freed: list[dict[str, int]] = [{} for _ in self.books]  # model -> rows ended on that replica
        self.counts = LeaseCounts()

    # ---- the simulator's Cluster protocol -------------------------------------------------------

    def admit(self, features: RequestFeatures, now: float, request: int) -> tuple[Decision, str | None]:
        self._heartbeats(now)
        i = self._rng.randrange(len(self.books))
        if self._refuses_early(i, features.model, now):
            self.counts.early_refusals += 1
            return Reject("no_capacity", self.policy.retry_after_s, "refused early"), None
        placed = self._decide_on_leases(i, features, now)
        if placed is not None:
            decision, row_id = placed
            self._rows[request] = (i, row_id)
            self.counts.local += 1
            return decision, decision.actor_name
        return self._slow_path(i, features, now, request)

    def started(self, name: str) -> None:
        self.state.actor_started(name)

    def first_token(self, request: int) -> None:
        """Its prompt is done, as the relay tells the book (serve_app/rows.py): a joiner no longer waits on it."""
        i, row_id = self._rows.get(request, (0, None))
        if row_id is not None:
            self.books[i].prompt_done(row_id)

    def finish(self, name: str, request: int, now: float) -> None:
        self._heartbeats(now)
        i, row_id = self._rows.pop(request)
        book = self.books[i]
        self._freed[i][MODEL] = self._freed[i].get(MODEL, 0) + 1
        if row_id is None:
            self.state.finish(name, str(request), "complete", now)
        elif book.release(row_id):  # contended: back to the registry at once
            self.state.leases.give_back(book.replica_id, row_id, now)
            self.counts.give_backs += 1

    def check_books(self) -> None:
        self.state.check_invariants()

    # ---- a replica's admission -------------------------------------------------------------------

    def _decide_on_leases(self, i: int, features: RequestFeatures, now: float) -> tuple[Decision, str] | None:
        book = self.books[i]
        while True:
            placed = book.place(features, self.policy, self.scorer, now, now)
            if placed is None:
                return None
            decision, row = placed
            holder = self.state.books.row_holder(row.row_id)
            if holder is not None and holder.name == row.actor_name:
                return decision, row.row_id
            # Recalled for another replica's slow path since our last exchange: the actor turns the row away.
            book.forget(row.row_id)
            self.counts.turned_away += 1

    def _slow_path(self, i: int, features: RequestFeatures, now: float,
                   request: int) -> tuple[Decision, str | None]:
        book = self.books[i]
        self.counts.slow_path += 1
        name = actor_name(self._central._next_seq)
        lease = SlowPathLease(book.ttl_s, book.give_back_free(features.model))
        decision = self.state.admit(features, self.policy, name, str(request), now, self.scorer,
                                    replica_id=book.replica_id, lease=lease)
        if isinstance(decision, Reject):
            if decision.reason == "no_capacity" and decision.retry_after_s is not None:
                self._refused_until[i][features.model] = (now + self.early_refusal_s,
                                                          self._freed[i].get(features.model, 0))
            return decision, None
        self._refused_until[i].pop(features.model, None)
        if isinstance(decision, Spawn):
            self._central._next_seq += 1
            self._rows[request] = (i, None)
            return decision, name
        if is_leased_row(decision):
            row = LeasedRow(str(request), decision.actor_name, features.model, decision.slot_id, decision.lane,
                            decision.reserve_bytes, self.resident_bytes)
            book.add(row, features, _predicted_end(decision, now), now)
            self._rows[request] = (i, row.row_id)
        else:
            self._rows[request] = (i, None)
        return decision, decision.actor_name

    def _refuses_early(self, i: int, model: str, now: float) -> bool:
        """admission.py's refuse_early: no call can be in flight here, so the window's probe is simply the first
        request after it; a row of the model that ended on this replica, or is free in its leases, ends it."""
        window = self._refused_until[i].get(model)
        if window is None:
            return False
        until, freed = window
        if now >= until or self.books[i].has_free(model) or self._freed[i].get(model, 0) != freed:
            del self._refused_until[i][model]
            return False
        return True

    # ---- heartbeats ------------------------------------------------------------------------------

    def _heartbeats(self, now: float) -> None:
        """Every exchange due by `now`, in time order (so each sees the rows as they were at its time)."""
        while True:
            i = min(range(len(self.books)), key=self._next_exchange.__getitem__)
            at = self._next_exchange[i]
            if at > now:
                return
            self._next_exchange[i] = at + self.heartbeat_s
            book = self.books[i]
            if at >= self._next_expiry:
                self.state.leases.expire(at)
                self._next_expiry = at + self.heartbeat_s
            report = book.report(at)
            # The registry's side of exchange_leases, without the counts for the gauges (a full snapshot each).
            book.apply(report, self.state.leases.exchange(report, at), at)
            for row_id in book.give_back_contended():
                self.state.leases.give_back(book.replica_id, row_id, at)
                self.counts.give_backs += 1
            self.counts.exchanges += 1
