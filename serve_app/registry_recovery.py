"""The registry's side of failures: matching its books to what Ray lists alive, and taking back
what a registry that restarted empty lost. A collaborator of `RegistryState` (registry.py) on the
same books (registry_books.py), under the same lock; pure, no Ray.

Crashes. `reconcile(alive, now, alive_nodes)` compares the registry with the request
actors and the nodes Ray lists as alive (a dead node's slots are removed, and its actors
forgotten as ghosts at once; a draining node's slots leave admission, its idle actors retire,
and its running rows run on, booked, until they end or the node goes):
  - ghosts: registered, not alive, and spawned more than `spawn_grace_s` ago (an actor
    is committed here before it is created, so a young one may not be listed yet; an unused
    spawn lease's actor is not created until its holder uses it, and waits for its lease) —
    forgotten with their reservations (the actor died, or its replica crashed before
    creating it);
  - expired: an actor with a row past its `busy_deadline` — the replica that ran the
    request crashed or the actor hung. Forgotten, and reported for the caller to kill:
    releasing only the reservation would leave a live actor holding uncounted memory;
  - retired: idle hot actors idle for more than `max_idle_s` (None: never), and warm
    actors of a model that has had no request for as long (warm_pool.py) — reported to
    be killed, so idle actors of one model do not hold slots forever from another;
  - orphans: alive request actors the registry does not know (a registry restart, a
    replica that created an actor after its reservation was reclaimed, an actor still
    exiting after `finish`) — reported to be killed: nothing reserves their memory.

Hand-overs. A registry that restarted (or was re-created) comes back empty; each ingress
replica hands it the rows it still relays and the idle hot actors it knows of (`adopt`).
Rows carry the replica relaying them: the rows of a replica that has gone silent
(`release_rows_of`) are released, and an actor that ran only those is reported to be killed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from serve_app.registry_books import Books
from serve_app.registry_records import ActorRecord, AdoptedActor, AdoptedRow, ReconcileReport, RowReservation


class Recovery:
    def __init__(self, books: Books, finish: Callable[[str, str, str, float], bool]) -> None:
        """`finish`: the registry's own end of a row (RegistryState.finish), for rows a silent replica held."""
        self.books = books
        self._finish = finish

    def reconcile(self, alive: set[str], now: float, alive_nodes: set[str] | None = None,
                  draining_nodes: set[str] = frozenset()) -> ReconcileReport:
        """Match the registry to Ray's alive request actors, listed at `now` (see the module doc).

        With `alive_nodes`, every other node's slots are removed, and the actors on them
        forgotten as ghosts at once (however young: nothing runs on a node that is gone), so
        no decision places anything there again. The slots of `draining_nodes` (alive, about to
        go) leave admission (`Books.set_draining`), their idle and warm actors are retired, and
        their running rows run on, booked, until they end or the node goes.
        """
        books = self.books
        dead_slots = {s.slot_id for s in books.slots.values()
                      if alive_nodes is not None and s.node_id not in alive_nodes}
        draining = {s.slot_id for s in books.slots.values() if s.node_id in draining_nodes} - dead_slots
        books.set_draining(draining)
        orphans = tuple(sorted(name for name in alive if name not in books.actors))
        ghosts, expired, retired = [], [], []
        released = 0
        for actor in list(books.actors.values()):
            if actor.slot_id in dead_slots or actor.name not in alive:
                if actor.slot_id not in dead_slots and (now - actor.spawned_at < books.spawn_grace_s
                                                        or actor.start_lease == "spawn"):
                    continue  # not created yet (an unused spawn lease lasts until its lease returns)
                ghosts.append(actor.name)
            elif any(now > r.busy_deadline for r in actor.rows.values() if not r.is_lease):
                expired.append(actor.name)
            elif self._is_retired(actor, now) or (actor.slot_id in draining and not actor.rows):
                retired.append(actor.name)
            else:
                continue
            released += actor.reserved_bytes
            books.forget(actor)
        for slot_id in sorted(dead_slots):
            books.remove_slot(slot_id)
        return ReconcileReport(tuple(ghosts), tuple(expired), tuple(retired), orphans, released,
                               tuple(sorted(dead_slots)))

    def _is_retired(self, actor: ActorRecord, now: float) -> bool:
        max_idle_s = self.books.max_idle_s
        if max_idle_s is None:
            return False
        if actor.state in ("warm", "warming"):
            last = self.books.last_request_at.get(actor.model, actor.spawned_at)
            return now - max(last, actor.spawned_at) > max_idle_s
        return actor.idle_since is not None and now - actor.idle_since > max_idle_s

    def adopt(self, rows: Iterable[AdoptedRow], now: float, idle: Iterable[AdoptedActor] = ()) -> list[str]:
        """Take back the rows an ingress replica still relays, and the idle hot actors it knows of;
        returns the request ids and actor names taken.

        For a registry that restarted empty: those actors are registered again with what they
        hold, so they are not orphans (nor lost capacity). A row already held, an actor already
        known, or one whose slot is unknown or has no room for it, is not taken. An idle actor
        that has died meanwhile is a ghost at the next reconcile.
        """
        books = self.books
        taken = []
        for r in rows:
            slot = books.slots.get(r.slot_id)
            actor = books.actors.get(r.actor_name)
            if slot is None or books.row_holder(r.request_id) is not None:
                continue
            row = RowReservation(r.request_id, r.num_tokens, r.tpot_target_s, r.predicted_end,
                                 now + r.busy_timeout_s, r.request_bytes, r.replica_id, r.is_lease)
            if actor is None:
                if (slot.num_actors >= books.max_actors_per_slot
                        or slot.free_bytes < r.resident_bytes + r.request_bytes):
                    continue
                state = "busy" if r.is_started else "starting"
                books.register(ActorRecord(r.actor_name, r.model, r.slot_id, r.lane, state, r.is_hot,
                                           r.resident_bytes, now, {r.request_id: row}, start_lease=r.start), slot)
            elif (actor.slot_id != r.slot_id or actor.state == "starting"
                  or not books.add_row(actor, row, r.request_bytes)):
                continue
            taken.append(r.request_id)
        for a in idle:
            slot = books.slots.get(a.slot_id)
            if (a.actor_name in books.actors or slot is None or slot.num_actors >= books.max_actors_per_slot
                    or slot.free_bytes < a.resident_bytes):
                continue
            books.register(ActorRecord(a.actor_name, a.model, a.slot_id, a.lane, "idle", True, a.resident_bytes, now,
                                  idle_since=now), slot)
            taken.append(a.actor_name)
        return taken

    def release_rows_of(self, replica_ids: set[str], now: float) -> list[str]:
        """The rows of ingress replicas that are gone (nobody relays them any more) are released.

        An actor left with rows of live replicas keeps running them; one whose rows were all
        of gone replicas is forgotten and reported to be killed, since it still computes them.
        Their leased rows return: the actor is hot, and stays (idle, if nothing else runs there).
        """
        to_kill = []
        for actor in list(self.books.actors.values()):
            for row in [r for r in actor.rows.values() if r.is_lease and r.replica_id in replica_ids]:
                self._finish(actor.name, row.request_id, "cancelled", now)
            if actor.name not in self.books.actors:
                continue
            gone = [r for r in actor.rows.values() if r.replica_id in replica_ids]
            if not gone:
                continue
            if len(gone) == len(actor.rows):
                self.books.forget(actor)
                to_kill.append(actor.name)
                continue
            for row in gone:
                self._finish(actor.name, row.request_id, "cancelled", now)
        return to_kill
