"""The registry's books: slots, the actors on them and their rows, and the bytes each slot has reserved.

What every part of the registry reads and changes (pure, no Ray): the commits of admissions
(registry.py), the warm pools (registry_warm.py) and recovery (registry_recovery.py) each hold
these books and change them only through the few operations below, which keep a slot's
`reserved_bytes` equal to the sum over its actors and its cached view current:

    register   a new actor on a slot, holding everything it reserves
    add_row    one more row on an actor (its KV cache and workspace reserved)
    end_row    a row given back
    forget     an actor gone, with everything it held
    touch_*    a record changed in place: its view is rebuilt, the snapshot invalidated

Views are rebuilt only for what changed, so a snapshot of 1,000 slots stays cheap.
"""

from __future__ import annotations

from collections.abc import Iterable

from serve_app.registry_records import ActorRecord, RowReservation, SlotRecord, SlotSpec
from serve_app.snapshot import ActorView, ClusterSnapshot, SlotView


class Books:
    def __init__(self, max_actors_per_slot: int = 1, spawn_grace_s: float = 10.0,
                 max_idle_s: float | None = None, max_batch: int = 32) -> None:
        if max_actors_per_slot < 1 or max_batch < 1:
            raise ValueError(f"max_actors_per_slot and max_batch must be >= 1, got {max_actors_per_slot}, {max_batch}")
        if spawn_grace_s < 0 or (max_idle_s is not None and max_idle_s < 0):
            raise ValueError(f"spawn_grace_s and max_idle_s must be >= 0, got {spawn_grace_s}, {max_idle_s}")
        self.max_actors_per_slot = max_actors_per_slot
        self.max_batch = max_batch
        self.spawn_grace_s = spawn_grace_s
        self.max_idle_s = max_idle_s
        self.slots: dict[str, SlotRecord] = {}  # ordered by slot_id: the first-fit order
        self.actors: dict[str, ActorRecord] = {}
        self.last_request_at: dict[str, float] = {}  # model -> its latest admission (or its pool's first fill)
        # Every row by id, and the leased ones by holder: kept by register / add_row / end_row / forget, so that
        # finding a row, or one replica's leases, does not scan every actor of a large cluster.
        self._holders: dict[str, dict[str, ActorRecord]] = {}  # row id -> {actor name -> actor} holding it
        self._leased: dict[str, dict[tuple[str, str], ActorRecord]] = {}  # replica -> {(actor, row id) -> actor}
        self._slot_views: dict[str, SlotView] = {}  # the admissible slots': a draining slot has none
        # Slots whose node is being drained: out of admission (no view, so no decision sees them), while the
        # actors on them stay booked until their rows end or the node goes.
        self.draining: frozenset[str] = frozenset()
        self._actor_views: dict[str, ActorView] = {}
        self._version = 0
        self._snapshot: ClusterSnapshot | None = None

    def set_limits(self, max_actors_per_slot: int, max_idle_s: float | None, max_batch: int) -> None:
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
            slot = self.slots.get(spec.slot_id)
            if slot is None:
                slot = self.slots[spec.slot_id] = SlotRecord(spec.slot_id, spec.node_id, spec.total_bytes)
            elif spec.total_bytes < slot.reserved_bytes:
                raise ValueError(f"slot {spec.slot_id}: total_bytes {spec.total_bytes} is below the "
                                 f"{slot.reserved_bytes} bytes already reserved on it")
            slot.node_id, slot.total_bytes = spec.node_id, spec.total_bytes
            self.touch_slot(slot)
        self.slots = dict(sorted(self.slots.items()))
        self._slot_views = {k: self._slot_views[k] for k in self.slots if k in self._slot_views}

    def set_draining(self, slot_ids: Iterable[str]) -> None:
        """The slots now being drained (every other one is admissible again)."""
        draining = frozenset(s for s in slot_ids if s in self.slots)
        if draining == self.draining:
            return
        self.draining = draining
        self._slot_views = {k: s.view() for k, s in self.slots.items() if k not in draining}
        self._changed()

    def update_slot_stats(self, slot_id: str, fragmentation: float, utilization: float) -> None:
        slot = self.slots.get(slot_id)
        if slot is None:
            raise KeyError(f"unknown slot {slot_id!r}")
        slot.fragmentation, slot.utilization = fragmentation, utilization
        self.touch_slot(slot)

    def remove_slot(self, slot_id: str) -> None:
        """A slot whose node is gone (its actors forgotten first)."""
        del self.slots[slot_id]
        self._slot_views.pop(slot_id, None)
        self.draining = self.draining - {slot_id}
        self._changed()

    # ---- reads -----------------------------------------------------------------------

    def snapshot(self) -> ClusterSnapshot:
        if self._snapshot is None:
            self._snapshot = ClusterSnapshot(
                tuple(self._slot_views.values()), tuple(self._actor_views.values()), self._version
            )
        return self._snapshot

    def row_holder(self, request_id: str) -> ActorRecord | None:
        """The actor holding `request_id`'s row, if any."""
        holders = self._holders.get(request_id)
        if not holders:
            return None
        if len(holders) == 1:
            return next(iter(holders.values()))
        # The same id on several actors (the API allows it: rows are named by actor and id): the first registered.
        return next(a for a in self.actors.values() if a.name in holders)

    def leased_to(self, replica_id: str) -> dict[str, tuple[ActorRecord, RowReservation]]:
        """Every row leased to `replica_id`: row id -> (its actor, the row)."""
        return {row_id: (a, a.rows[row_id]) for (_, row_id), a in self._leased.get(replica_id, {}).items()}

    def leased_rows(self) -> list[tuple[ActorRecord, RowReservation]]:
        """Every leased row, whoever holds it."""
        return [(a, a.rows[row_id]) for rows in self._leased.values() for (_, row_id), a in rows.items()]

    def check_invariants(self) -> None:
        """Raise AssertionError unless every slot's books match its actors and their rows exactly."""
        reserved = dict.fromkeys(self.slots, 0)
        counts = dict.fromkeys(self.slots, 0)
        for a in self.actors.values():
            assert a.slot_id in self.slots, f"actor {a.name} is on unknown slot {a.slot_id}"
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
        for s in self.slots.values():
            assert s.reserved_bytes == reserved[s.slot_id], (
                f"slot {s.slot_id}: reserved {s.reserved_bytes} != sum over its actors {reserved[s.slot_id]}")
            assert s.reserved_bytes <= s.total_bytes, f"slot {s.slot_id} over-committed"
            assert s.num_actors == counts[s.slot_id] <= self.max_actors_per_slot, (
                f"slot {s.slot_id}: {s.num_actors} actors recorded, {counts[s.slot_id]} registered")
        rows = {(r, a.name) for a in self.actors.values() for r in a.rows}
        assert {(r, name) for r, actors in self._holders.items() for name in actors} == rows, "stale rows' index"
        leased = {(r.replica_id, a.name, r.request_id) for a in self.actors.values() for r in a.rows.values()
                  if r.is_lease}
        assert {(h, *key) for h, keys in self._leased.items() for key in keys} == leased, "stale leases' index"
        assert self.snapshot() == ClusterSnapshot(
            tuple(s.view() for s in self.slots.values() if s.slot_id not in self.draining),
            tuple(a.view() for a in self.actors.values()),
            self._version), "the cached snapshot is stale"

    # ---- changes ---------------------------------------------------------------------

    def register(self, actor: ActorRecord, slot: SlotRecord) -> None:
        """A new actor on `slot`, holding everything it reserves from now on."""
        if actor.name in self.actors:
            raise ValueError(f"actor {actor.name} is already registered")
        self.actors[actor.name] = actor
        for row in actor.rows.values():
            self._index(actor, row)
        slot.reserved_bytes += actor.reserved_bytes
        slot.num_actors += 1
        self.touch_slot(slot)
        self.touch_actor(actor)

    def add_row(self, actor: ActorRecord, row: RowReservation, request_bytes: int) -> bool:
        """One more row on `actor` ("busy" from now on), if its slot has `request_bytes` free."""
        slot = self.slots[actor.slot_id]
        if slot.free_bytes < request_bytes:
            return False
        row.request_bytes = request_bytes
        actor.rows[row.request_id] = row
        self._index(actor, row)
        actor.state, actor.idle_since = "busy", None
        slot.reserved_bytes += request_bytes
        self.touch_slot(slot)
        self.touch_actor(actor)
        return True

    def end_row(self, actor: ActorRecord, request_id: str) -> None:
        """A row given back; the caller sets the actor's state, then touches it (or forgets it)."""
        row = actor.rows.pop(request_id)
        self._unindex(actor, row)
        slot = self.slots[actor.slot_id]
        slot.reserved_bytes -= row.request_bytes
        self.touch_slot(slot)

    def forget(self, actor: ActorRecord) -> None:
        for row in actor.rows.values():
            self._unindex(actor, row)
        slot = self.slots[actor.slot_id]
        slot.reserved_bytes -= actor.reserved_bytes
        slot.num_actors -= 1
        del self.actors[actor.name]
        del self._actor_views[actor.name]
        self.touch_slot(slot)

    def touch_slot(self, slot: SlotRecord) -> None:
        if slot.slot_id not in self.draining:
            self._slot_views[slot.slot_id] = slot.view()
        self._changed()

    def touch_actor(self, actor: ActorRecord) -> None:
        self._actor_views[actor.name] = actor.view()
        self._changed()

    def _index(self, actor: ActorRecord, row: RowReservation) -> None:
        self._holders.setdefault(row.request_id, {})[actor.name] = actor
        if row.is_lease:
            self._leased.setdefault(row.replica_id, {})[(actor.name, row.request_id)] = actor

    def _unindex(self, actor: ActorRecord, row: RowReservation) -> None:
        holders = self._holders.get(row.request_id, {})
        holders.pop(actor.name, None)
        if not holders:
            self._holders.pop(row.request_id, None)
        if row.is_lease:
            leased = self._leased.get(row.replica_id, {})
            leased.pop((actor.name, row.request_id), None)
            if not leased:
                self._leased.pop(row.replica_id, None)

    def _changed(self) -> None:
        self._version += 1
        self._snapshot = None
