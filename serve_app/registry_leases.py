"""The registry's side of leases (lease.py): rows of hot actors held for one ingress replica each.

A collaborator of `RegistryState` (registry.py) on the same books (registry_books.py), under the
same lock; pure, no Ray. A leased row is an ordinary `RowReservation` on its actor with
`is_lease` set and the holder as its `replica_id`: it counts against the actor's `max_batch`
and holds its bytes on the slot whether a request runs in it or not, so every other decision
(another replica's slow path, a spawn, an eviction) sees it taken, and the books' invariants
cover it unchanged. An actor with leased rows is "busy": never evicted or retired idle.

    exchange   one replica's heartbeat: rows returned, uses recorded, leases renewed, rows granted
    give_back  a free row returned (with a report, ahead of that replica's slow-path admission, or the
               moment its request ends while its model is contended: `refused`)
    recall_free_row  another replica's free row taken back for a slow path that found no room
    expire     rows whose lease was not renewed in time return (a silent or stopped replica)

A row given back, expired, or of an actor that failed is simply gone from the holder's `held`
set in its next grant; the holder forgets it then.
"""

from __future__ import annotations

import heapq
import itertools
import uuid
from collections.abc import Callable, Iterator

from serve_app.lease import BatchInfo, LeasedRow, LeaseGrant, LeaseReport, LeaseWant, RowUse
from serve_app.registry_books import Books
from serve_app.registry_records import ActorRecord, RowReservation


class LeaseBooks:
    def __init__(self, books: Books, finish: Callable[[str, str, str, float], bool]) -> None:
        """`finish`: the registry's own end of a row (RegistryState.finish): a returned row is a row ended."""
        self.books = books
        self._finish = finish
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]  # row ids stay unique across registry incarnations
        # Free rows taken back from a replica for another's slow path, until its next exchange tells it.
        self.recalled: dict[str, set[str]] = {}
        self._refused_at: dict[str, float] = {}  # model -> its latest refusal for want of capacity

    def exchange(self, report: LeaseReport, now: float) -> LeaseGrant:
        replica, ttl_s = report.replica_id, report.ttl_s
        for row_id in report.returned:
            self.give_back(replica, row_id, now)
        held = self.books.leased_to(replica)
        renewed: dict[str, ActorRecord] = {}
        for row_id, (actor, row) in list(held.items()):
            if row_id in report.known:
                _record_use(row, report.in_use.get(row_id), now)
                row.busy_deadline = now + ttl_s
                renewed[actor.name] = actor
            elif row.is_free_lease:  # granted by an exchange whose answer was lost: nobody will use it
                self._finish(actor.name, row_id, "cancelled", now)
                del held[row_id]
            # else: placed by an admission whose answer the replica had not seen when it sent this; not
            # renewed, so it expires if the replica never learns of it
        for actor in renewed.values():  # its view rebuilt once, not once per row
            self.books.touch_actor(actor)
        # Told now (`held` lacks them); remembered until a report no longer knows them (this grant may be lost).
        still_known = self.recalled.pop(replica, set()) & report.known
        if still_known:
            self.recalled[replica] = still_known
        granted: list[LeasedRow] = []
        for want in report.wanted:
            have = sum(1 for a, _ in held.values() if a.model == want.model and a.lane == want.lane)
            actors = self._best_actors(want)
            for _ in range(want.num_rows - have):
                actor = next(actors, None)
                if actor is None:
                    break
                row = RowReservation(f"lease-{self._prefix}-{next(self._ids)}", 0, None, now, now + ttl_s,
                                     replica_id=replica, is_lease=True)
                self.books.add_row(actor, row, want.row_bytes)
                held[row.request_id] = (actor, row)
                granted.append(leased_row(actor, row))
        contended = frozenset(m for m, t in self._refused_at.items() if now - t < ttl_s)
        return LeaseGrant(tuple(granted), frozenset(held), self._batches(replica, held), contended=contended)

    def refused(self, model: str, now: float) -> None:
        """The registry refused a request of `model` for want of capacity: its holders hear it's contended."""
        self._refused_at[model] = now

    def give_back(self, replica: str, row_id: str, now: float) -> None:
        """A row `replica` returns (with a report, or ahead of a slow-path admission); another's is kept."""
        actor = self.books.row_holder(row_id)
        row = actor.rows[row_id] if actor is not None else None
        if row is not None and row.is_lease and row.replica_id == replica:
            self._finish(actor.name, row_id, "cancelled", now)

    def recall_free_row(self, model: str, lane: str, need: int, replica: str, now: float) -> bool:
        """Take back one free row another replica holds on a hot actor of `model` and `lane` where `need`
        bytes would fit once it is gone: a slow path that found no room must not refuse while rows sit
        idle in other replicas' leases (fragmentation at capacity). True if one was taken.

        Its holder last reported it free, within a heartbeat; should it place a request there before its
        next exchange tells it otherwise, the actor — which never runs more than `max_batch` rows — turns
        the row away if its batch is full (the holder then forgets the row and decides again)."""
        for a in self.books.actors.values():
            if a.model != model or a.lane != lane or not a.is_hot or a.slot_id in self.books.draining:
                continue
            slot = self.books.slots[a.slot_id]
            for r in a.rows.values():
                if r.is_free_lease and r.replica_id != replica and slot.free_bytes + r.request_bytes >= need:
                    self.recalled.setdefault(r.replica_id, set()).add(r.request_id)
                    self._finish(a.name, r.request_id, "cancelled", now)
                    return True
        return False

    def take_back_free(self, is_leaving: Callable[[ActorRecord], bool], now: float) -> int:
        """Free leased rows on the actors `is_leaving` names (their node is being drained) return; how many."""
        leaving = [(a.name, r.request_id) for a, r in self.books.leased_rows() if r.is_free_lease and is_leaving(a)]
        for name, row_id in leaving:
            self._finish(name, row_id, "cancelled", now)
        return len(leaving)

    def expire(self, now: float) -> int:
        """Rows whose lease ran out return; returns how many."""
        expired = [(a.name, r.request_id) for a, r in self.books.leased_rows() if now > r.busy_deadline]
        for name, row_id in expired:
            self._finish(name, row_id, "cancelled", now)
        return len(expired)

    def _best_actors(self, want: LeaseWant) -> Iterator[ActorRecord]:
        """For each row granted in turn, the hot actor of the model and lane with the fewest rows (then the first
        name) that has a free row and room: leases spread over batches as joins do, so no replica's rows crowd
        one batch while another idles. The actors are filtered once, not once per row (a large cluster has
        thousands); granting only fills batches and slots, so one found full stays full for this exchange."""
        books = self.books
        heap = [(len(a.rows), a.name, a) for a in books.actors.values()
                if a.model == want.model and a.lane == want.lane and a.is_hot and a.state in ("busy", "idle")
                and a.slot_id not in books.draining]
        heapq.heapify(heap)
        while heap:
            _, _, a = heapq.heappop(heap)
            if len(a.rows) >= books.max_batch or books.slots[a.slot_id].free_bytes < want.row_bytes:
                continue
            yield a  # the caller adds a row to it before asking again
            heapq.heappush(heap, (len(a.rows), a.name, a))

    def _batches(self, replica: str, held: dict[str, tuple[ActorRecord, RowReservation]]) -> tuple[BatchInfo, ...]:
        actors = {a.name: a for a, _ in held.values()}
        return tuple(
            BatchInfo(a.name, self.books.slots[a.slot_id].view(),
                      tuple(r.view() for r in a.rows.values()
                            if not (r.is_lease and r.replica_id == replica) and not r.is_free_lease))
            for a in actors.values())


def leased_row(actor: ActorRecord, row: RowReservation) -> LeasedRow:
    return LeasedRow(row.request_id, actor.name, actor.model, actor.slot_id, actor.lane, row.request_bytes,
                     actor.resident_bytes)


def _record_use(row: RowReservation, use: RowUse | None, now: float) -> None:
    if use is None:  # free: it holds its bytes, and could take a request at once
        row.num_tokens, row.tpot_target_s, row.predicted_end = 0, None, now
    else:
        row.num_tokens, row.tpot_target_s, row.predicted_end = use.num_tokens, use.tpot_target_s, use.predicted_end
