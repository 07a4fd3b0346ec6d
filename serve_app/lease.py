"""Leases: rows of hot actors' batches, warm actors to bind and slot bytes to spawn into, each held by one
ingress replica at a time.

The registry (registry.py) stays the authority on slots, actors and memory, but not on every
request. Each replica holds a few rows on hot actors, sized by its own recent demand; it
places a request in a free leased row with the same pure `decide()`, against a view of its
leases alone (lease_book.py), and keeps the row when the request ends — no registry call on
either side. Once a heartbeat (`registry_heartbeat_s`) it sends one `LeaseReport` (what runs
in its rows, the rows it gives back, the rows it wants) and gets one `LeaseGrant` back
(registry_leases.py): new rows, the rows it still holds, and what else runs on their actors.

Start leases. A replica whose rows ran out recently (it bound or spawned an actor within
`demand_window_s`) also holds one *start lease* per model and lane: a warm actor to bind, or, where no
warm actor is free, the bytes and the actor place on a slot to spawn a named actor into. The registry
commits it as its own admission would commit the bind or the spawn, with a free leased row for the
request (registry_leases.py), so no other decision can take the actor or the bytes; the replica
binds or spawns on it with no registry call, and tells the registry with its next report
(`LeaseReport.start_uses`). An unused warm lease that returns leaves its actor warm again; an unused
spawn lease leaves nothing (no process was started).

A request its leases cannot place takes the slow path, the registry's `admit`, before any
refusal; a row the slow path places on a hot actor is leased to that replica from the start,
so a replica's steady demand stops reaching the registry after its first request.

Invariants: a row is leased to at most one replica (it is one `RowReservation` on one actor
in the registry's books, holding its bytes like any row); the leases of a replica that stops
reporting expire after `ttl_s` and their rows return; a replica uses no lease past `ttl_s`
after it sent the report that last renewed it, by its own clock, less one heartbeat.

Plain frozen dataclasses, stdlib only: they travel between replicas and the registry actor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from serve_app.demand import LaneCount
from serve_app.snapshot import ClusterSummary, Lane, RowView, SlotView


@dataclass(frozen=True)
class LeaseConfig:
    # Off: every admission and every row's end is a registry call, as before leases.
    is_enabled: bool = True
    # A lease not renewed for this many heartbeats (`registry_heartbeat_s`) returns to the registry; its
    # holder stops using it one heartbeat earlier. Several, so that one late exchange costs nothing.
    ttl_heartbeats: int = 5
    # Rows a replica holds per model and lane: the most it ran at once over `demand_window_s`,
    # plus this many spare (0: only rows the slow path placed, kept while the demand lasts).
    headroom_rows: int = 1
    demand_window_s: float = 5.0
    # Start leases (module doc): a warm actor to bind, or slot bytes to spawn into, for a replica that bound
    # or spawned within `demand_window_s`. Off: binds and spawns take the slow path.
    is_start_enabled: bool = True

    def __post_init__(self) -> None:
        if self.ttl_heartbeats < 3 or self.headroom_rows < 0 or self.demand_window_s <= 0:
            raise ValueError(f"leases need ttl_heartbeats >= 3, headroom_rows >= 0 and demand_window_s > 0, got "
                             f"{self.ttl_heartbeats}, {self.headroom_rows}, {self.demand_window_s}")


@dataclass(frozen=True)
class SlowPathLease:
    """What a replica with leases adds to a slow-path admission: the ttl of the row it may be leased, and
    its free rows of the request's model, given back first — they could not take the request, but their
    bytes and places may let the registry place it — and its rows in use as they are now (the registry's
    books lag up to a heartbeat: a join decided there must see the prompts just placed on its leases)."""

    ttl_s: float
    returned: tuple[str, ...] = ()
    in_use: dict[str, RowUse] = field(default_factory=dict)  # row id -> its request, as in LeaseReport
    # Actors it holds rows on -> their step correction as it stands now (a prompt of its own overdue there
    # included: lease_book._live_correction), as in LeaseReport: a join the leases refused on that figure must
    # not be taken by the registry on the one a heartbeat ago.
    step_corrections: dict[str, float] = field(default_factory=dict)


StartKind = Literal["", "warm", "spawn"]


@dataclass(frozen=True)
class LeasedRow:
    """One row held for one replica, `row_bytes` of KV cache and workspace reserved: on a hot actor's batch
    (`start` ""), or a start lease's first row: on a warm actor to bind ("warm"), or on an actor not yet
    started, `actor_name`, whose `resident_bytes` are reserved on the slot to spawn it into ("spawn")."""

    row_id: str
    actor_name: str
    model: str
    slot_id: str
    lane: Lane
    row_bytes: int
    resident_bytes: int  # the actor's, as the registry holds them (for a hand-over to a new registry)
    start: StartKind = ""
    keep_hot: bool = True  # a start lease's actor stays hot after its request (the registry counted it so)
    node_id: str = ""  # a start lease's: where a spawn goes
    resident_fraction: float = 1.0  # a warm actor's share of its weights in (the prediction reads it)


@dataclass(frozen=True)
class RowUse:
    """What runs in a leased row, as its holder reports it: the registry's view of the batch (and its
    predictions and retry-after) follows the requests, one heartbeat late."""

    num_tokens: int
    tpot_target_s: float | None
    predicted_end: float  # epoch seconds
    pending_prompt_tokens: int = 0  # its prompt, until its first token arrives


@dataclass(frozen=True)
class LeaseWant:
    """Rows a replica wants to hold for a model and lane (those it holds included), each of `row_bytes`."""

    model: str
    lane: Lane
    num_rows: int
    row_bytes: int
    num_starts: int = 0  # start leases wanted (held ones included): 1 after a recent bind or spawn
    resident_bytes: int = 0  # a new actor's weights and process, for a spawn lease
    max_hot: int = 0  # the policy's hot actors for the model and lane: a start lease's actor stays hot below it
    num_warm: int = 0  # the policy's warm pool for them: no spawn lease takes a slot while the pool is short
    node_cpus: int = 0  # the rule's (scorer.py): no start lease on a node whose busy actors would slow the start


@dataclass(frozen=True)
class LeaseReport:
    replica_id: str
    ttl_s: float  # how long the registry keeps this replica's rows without another report
    returned: tuple[str, ...] = ()  # free rows given back (the holder forgot them before sending)
    in_use: dict[str, RowUse] = field(default_factory=dict)  # row id -> its request
    wanted: tuple[LeaseWant, ...] = ()
    # Every row the replica holds as it sends this. A free row it does not know of was granted by an
    # exchange whose answer it never got: the registry takes it back.
    known: frozenset[str] = frozenset()
    # Its refusals and admissions since its last report, for the capacity planner (demand.py).
    demand: tuple[LaneCount, ...] = ()
    # Start leases it has placed a request in -> whether their actor has sent its first token (then it may
    # batch). Sent until a grant answers them: the registry's books follow the bind or spawn from then on.
    start_uses: dict[str, bool] = field(default_factory=dict)
    # Actors it holds rows on -> their engine's step correction, as their last Started said (scorer.py).
    step_corrections: dict[str, float] = field(default_factory=dict)
    # The same actors -> their engine's long-run step correction (StepCheck.baseline): theirs once idle.
    step_baselines: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchInfo:
    """An actor the replica holds rows on: its slot, and the rows others run there (for predictions)."""

    actor_name: str
    slot: SlotView
    other_rows: tuple[RowView, ...]
    # The actor's long-run step correction as the registry last heard it (StepCheck.baseline): a holder that has
    # heard no Started there yet prices its joins with it, not with the rule's constants.
    step_baseline: float = 1.0


@dataclass(frozen=True)
class LeaseGrant:
    granted: tuple[LeasedRow, ...]
    held: frozenset[str]  # every row id the replica holds now, the new ones included; any other is gone
    batches: tuple[BatchInfo, ...]
    summary: ClusterSummary | None = None  # the registry's counts, for the replica's gauges
    # Models the registry refused for want of capacity within the last ttl: while a model is contended its
    # holders keep no spare rows, and give each row back the moment its request ends (one call), so no
    # request is refused while a row sits free in another replica's lease.
    contended: frozenset[str] = frozenset()
    # Start leases the registry wants back (a hot batch of their model has a place again, the model is
    # contended, or their node is draining). They stay booked: the holder returns each with its next report
    # if it is still unused, and uses none of them meanwhile; one it used just before is reported as used.
    recalled_starts: frozenset[str] = frozenset()
