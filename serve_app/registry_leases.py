"""The registry's side of leases (lease.py): rows of hot actors, and start leases, held for one ingress replica each.

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

A start lease is committed as the registry's own bind or spawn would be, with a free leased row for
the request: a warm actor becomes "starting" (held, so no other decision binds or evicts it), or a
new actor is registered "starting" on a slot with room, named but not created (`start_lease` says
which; reconcile does not take an uncreated one for a ghost). Its holder's report says when it
used the lease, and when the actor sent its first token ("busy": it may batch); from then on the
actor is like any other. An unused start lease that returns (given back, expired, taken back)
leaves the warm actor warm again, or forgets the actor that was never started.
"""

from __future__ import annotations

import heapq
import itertools
import uuid
from collections.abc import Callable, Iterator

from actors.actor_names import new_actor_name
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
        for row_id, is_started in report.start_uses.items():  # before the returns: a used lease is a bind or spawn
            self._start_used(replica, row_id, is_started, now)
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
                self._end(actor, row_id, now)
                del held[row_id]
            # else: placed by an admission whose answer the replica had not seen when it sent this; not
            # renewed, so it expires if the replica never learns of it
        # As this replica last heard them (fading), on the actors its rows there were renewed on.
        _set_corrections(renewed, report.step_corrections, report.step_baselines)
        for actor in renewed.values():  # its view rebuilt once, not once per row
            self.books.touch_actor(actor)
        # Told now (`held` lacks them); remembered until a report no longer knows them (this grant may be lost).
        still_known = self.recalled.pop(replica, set()) & report.known
        if still_known:
            self.recalled[replica] = still_known
        contended = frozenset(m for m, t in self._refused_at.items() if now - t < ttl_s)
        granted: list[LeasedRow] = []
        recalled: set[str] = set()
        for want in report.wanted:
            have = sum(1 for a, _ in held.values()  # rows of hot batches (a used start lease's, once started)
                       if a.model == want.model and a.lane == want.lane and a.is_hot and a.state in ("busy", "idle"))
            actors = self._best_actors(want)
            for _ in range(want.num_rows - have):
                actor = next(actors, None)
                if actor is None:
                    break
                row = RowReservation(f"lease-{self._prefix}-{next(self._ids)}", 0, None, now, now + ttl_s,
                                     replica_id=replica, is_lease=True)
                self.books.add_row(actor, row, want.row_bytes)
                held[row.request_id] = (actor, row)
                granted.append(leased_row(actor, row, self.books))
            granted += self._grant_starts(replica, want, held, want.model in contended, recalled, now, ttl_s)
        # A start lease no longer wanted at all (its key left the report) is returned by its holder unasked.
        recalled |= {r for r, (a, _) in held.items() if a.start_lease and a.slot_id in self.books.draining}
        return LeaseGrant(tuple(granted), frozenset(held), self._batches(replica, held), contended=contended,
                          recalled_starts=frozenset(recalled))

    def _grant_starts(self, replica: str, want: LeaseWant, held: dict[str, tuple[ActorRecord, RowReservation]],
                      is_contended: bool, recalled: set[str], now: float, ttl_s: float) -> list[LeasedRow]:
        """Start leases up to `want.num_starts`, only while every hot batch of the model and lane is full (its
        places leased or running) and none is starting: a request that could join one must not start a
        process instead. Held
        ones are recalled when a place frees, or while the model is contended (they would sit idle while the
        registry refuses others) — never ended here: the holder may have used one since it sent its report,
        so only the holder returns them (`LeaseGrant.recalled_starts`)."""
        starts = [(a, r) for a, r in held.values() if a.start_lease and a.model == want.model and a.lane == want.lane]
        if not starts and not want.num_starts:  # the usual want: rows only, and no scan of every actor for it
            return []
        # A hot actor still starting for its first request will have places too, within its start.
        has_place = next(self._best_actors(want), None) is not None or any(
            a.is_hot and a.state == "starting" and not a.start_lease and a.model == want.model and a.lane == want.lane
            for a in self.books.actors.values())
        if has_place or is_contended:
            recalled.update(r.request_id for _, r in starts)
            return []
        # One on a node now too busy for a start at full speed goes back (the registry's own decisions price it).
        recalled.update(r.request_id for a, r in starts if self._is_busy_node(a.slot_id, want))
        granted = []
        for _ in range(want.num_starts - len(starts)):
            start = self._lease_start(replica, want, now, ttl_s)
            if start is None:
                break
            held[start[1].request_id] = start
            granted.append(leased_row(*start, self.books))
        return granted

    def _is_busy_node(self, slot_id: str, want: LeaseWant) -> bool:
        """A start on this slot's node would run at less than a core's speed (rule_scorer.node_cpus): a start
        lease is no place to decide it, since the replica's leased view does not see its node's actors."""
        node = self.books.slots[slot_id].node_id
        return bool(want.node_cpus) and self.books.snapshot().num_busy_on_node(node) + 1 > want.node_cpus

    def record_uses(self, replica: str, in_use: dict[str, RowUse], now: float) -> None:
        """`replica`'s rows in use as it sees them now, ahead of a slow-path decision (SlowPathLease)."""
        held = self.books.leased_to(replica)
        for row_id, use in in_use.items():
            if row_id in held:
                actor, row = held[row_id]
                _record_use(row, use, now)
                self.books.touch_actor(actor)

    def record_corrections(self, replica: str, corrections: dict[str, float]) -> None:
        """`replica`'s step corrections as they stand now, for the actors it holds rows on (SlowPathLease)."""
        actors = {actor.name: actor for actor, _ in self.books.leased_to(replica).values()}
        for actor in _set_corrections(actors, corrections, {}):
            self.books.touch_actor(actor)

    def refused(self, model: str, now: float) -> None:
        """The registry refused a request of `model` for want of capacity: its holders hear it's contended."""
        self._refused_at[model] = now

    def give_back(self, replica: str, row_id: str, now: float) -> None:
        """A row `replica` returns (with a report, or ahead of a slow-path admission); another's is kept."""
        actor = self.books.row_holder(row_id)
        row = actor.rows[row_id] if actor is not None else None
        if row is not None and row.is_lease and row.replica_id == replica:
            self._end(actor, row_id, now)

    def recall_free_row(self, model: str, lane: str, need: int, replica: str, now: float) -> bool:
        """Take back one free row another replica holds on a hot actor of `model` and `lane` where `need`
        bytes would fit once it is gone: a slow path that found no room must not refuse while rows sit
        idle in other replicas' leases (fragmentation at capacity). True if one was taken.

        Its holder last reported it free, within a heartbeat; should it place a request there before its
        next exchange tells it otherwise, the actor — which never runs more than `max_batch` rows — turns
        the row away if its batch is full (the holder then forgets the row and decides again)."""
        for a in self.books.actors.values():
            if (a.model != model or a.lane != lane or not a.is_hot or a.start_lease
                    or a.slot_id in self.books.draining):
                continue  # a start lease is not a row of a hot batch: its holder may be binding it now
            slot = self.books.slots[a.slot_id]
            for r in a.rows.values():
                if r.is_free_lease and r.replica_id != replica and slot.free_bytes + r.request_bytes >= need:
                    self.recalled.setdefault(r.replica_id, set()).add(r.request_id)
                    self._finish(a.name, r.request_id, "cancelled", now)
                    return True
        return False

    def recall_idle_actor(self, model: str, lane: str, need: int, now: float) -> bool:
        """Take back every row of one hot actor of `model` and `lane` that runs nothing — all its rows free leases,
        whichever replica holds them — where `need` bytes would fit once they are gone: idle for the books, it may
        take a request of the other lane that would otherwise be refused (policy.py). True if one was.

        Its holders are told as with `recall_free_row`; one that places a request there before its next exchange
        joins the batch the actor now runs, which never exceeds `max_batch` rows."""
        for a in self.books.actors.values():
            if (a.model != model or a.lane != lane or not a.is_hot or a.start_lease or not a.rows
                    or a.slot_id in self.books.draining or not all(r.is_free_lease for r in a.rows.values())):
                continue
            if self.books.slots[a.slot_id].free_bytes + sum(r.request_bytes for r in a.rows.values()) < need:
                continue
            for r in list(a.rows.values()):
                self.recalled.setdefault(r.replica_id, set()).add(r.request_id)
                self._finish(a.name, r.request_id, "cancelled", now)
            return True
        return False

    def take_back_free(self, is_leaving: Callable[[ActorRecord], bool], now: float) -> int:
        """Free leased rows on the actors `is_leaving` names (their node is being drained) return; how many."""
        leaving = [(a, r.request_id) for a, r in self.books.leased_rows()
                   if r.is_free_lease and is_leaving(a) and not a.start_lease]  # those its holder returns
        for actor, row_id in leaving:
            self._end(actor, row_id, now)
        return len(leaving)

    def expire(self, now: float) -> int:
        """Rows whose lease ran out return; returns how many."""
        expired = [(a, r.request_id) for a, r in self.books.leased_rows() if now > r.busy_deadline]
        for actor, row_id in expired:
            self._end(actor, row_id, now)
        return len(expired)

    def _end(self, actor: ActorRecord, row_id: str, now: float) -> None:
        """A leased row returns. An unused warm lease leaves its actor warm (its process waits on, loaded);
        any other row ends as the registry's `finish` ends a cancelled row — an unused spawn lease's actor,
        "starting", is forgotten (and killed, should its holder have created it after all)."""
        row = actor.rows.get(row_id)
        if actor.start_lease == "warm" and row is not None and row.is_free_lease and len(actor.rows) == 1:
            self.books.end_row(actor, row_id)
            actor.state, actor.is_hot, actor.start_lease = "warm", False, ""
            self.books.touch_actor(actor)
            return
        self._finish(actor.name, row_id, "cancelled", now)

    def _start_used(self, replica: str, row_id: str, is_started: bool, now: float) -> None:
        """`replica` placed a request in its start lease `row_id` (and its actor has sent a first token)."""
        actor = self.books.row_holder(row_id)
        row = actor.rows[row_id] if actor is not None else None
        if row is None or not row.is_lease or row.replica_id != replica:
            return  # expired, or its actor failed, before this report came
        changed = bool(actor.start_lease) or (is_started and actor.state == "starting")
        if actor.start_lease == "spawn":  # created about now: reconcile's grace for a young actor runs from here
            actor.spawned_at = now
        actor.start_lease = ""
        if is_started and actor.state == "starting":
            actor.state = "busy"
        if changed:
            self.books.touch_actor(actor)

    def _lease_start(self, replica: str, want: LeaseWant, now: float,
                     ttl_s: float) -> tuple[ActorRecord, RowReservation] | None:
        """A start lease for `want`, committed as a bind or a spawn would be: a warm actor of the model filled for
        its lane, else a new actor on the first slot with room for it and its row (no eviction) — unless the
        model's warm pool is short, since it refills onto such a slot, and a warm actor binds faster than a
        spawn starts; None if neither."""
        books = self.books
        snapshot = books.snapshot()
        keep_hot = snapshot.hot_count(want.model, want.lane) < want.max_hot
        row = RowReservation(f"lease-{self._prefix}-{next(self._ids)}", 0, None, now, now + ttl_s,
                             replica_id=replica, is_lease=True)
        for a in books.actors.values():
            if (a.state == "warm" and a.model == want.model and a.lane == want.lane
                    and a.slot_id not in books.draining and not self._is_busy_node(a.slot_id, want)
                    and books.add_row(a, row, want.row_bytes)):
                a.state, a.is_hot, a.start_lease = "starting", keep_hot, "warm"
                books.touch_actor(a)
                return a, row
        if snapshot.warm_count(want.model, want.lane) < want.num_warm:
            return None
        for slot in books.slots.values():
            if (slot.slot_id in books.draining or slot.num_actors >= books.max_actors_per_slot
                    or slot.free_bytes < want.resident_bytes + want.row_bytes or self._is_busy_node(slot.slot_id, want)):
                continue
            row.request_bytes = want.row_bytes
            actor = ActorRecord(new_actor_name(want.model), want.model, slot.slot_id, want.lane, "starting", keep_hot,
                                want.resident_bytes, now, {row.request_id: row}, start_lease="spawn")
            books.register(actor, slot)
            return actor, row
        return None

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
                            if not (r.is_lease and r.replica_id == replica) and not r.is_free_lease),
                      a.step_baseline)
            for a in actors.values())


def _set_corrections(actors: dict[str, ActorRecord], corrections: dict[str, float],
                     baselines: dict[str, float]) -> list[ActorRecord]:
    """A replica's step corrections (and long-run figures, where it sent them) on those of `actors` it named;
    the actors set."""
    out = []
    for name, correction in corrections.items():
        actor = actors.get(name)
        if actor is None or not correction > 0:
            continue
        actor.step_correction = correction
        if baselines.get(name, 0) > 0:
            actor.step_baseline = baselines[name]
        out.append(actor)
    return out


def leased_row(actor: ActorRecord, row: RowReservation, books: Books) -> LeasedRow:
    return LeasedRow(row.request_id, actor.name, actor.model, actor.slot_id, actor.lane, row.request_bytes,
                     actor.resident_bytes, actor.start_lease, actor.is_hot, books.slots[actor.slot_id].node_id,
                     actor.resident_fraction)


def _record_use(row: RowReservation, use: RowUse | None, now: float) -> None:
    if use is None:  # free: it holds its bytes, and could take a request at once
        row.num_tokens, row.tpot_target_s, row.predicted_end, row.pending_prompt_tokens = 0, None, now, 0
    else:
        row.num_tokens, row.tpot_target_s, row.predicted_end = use.num_tokens, use.tpot_target_s, use.predicted_end
        row.pending_prompt_tokens = use.pending_prompt_tokens
