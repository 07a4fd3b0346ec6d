"""The registry's records: slots, actors and their rows as `RegistryState` (registry.py) keeps them.

Mutable records behind the registry's lock, each able to give the frozen view a decision
reads (snapshot.py); and the few names the registry's callers share with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from serve_app.snapshot import ActorState, ActorView, Lane, RowView, SlotView

Outcome = Literal["complete", "cancelled", "failed"]

@dataclass(frozen=True)
class SlotSpec:
    """One accelerator slot (one GPU, or one CPU slot) as the ingress discovers it."""

    slot_id: str
    node_id: str
    total_bytes: int
    # The device its telemetry comes from: a GPU's NVML index, or the node's CPU (index 0).
    device_kind: str = "cpu"
    device_index: int = 0


@dataclass(frozen=True)
class ReconcileReport:
    ghosts: tuple[str, ...] = ()
    expired: tuple[str, ...] = ()
    retired: tuple[str, ...] = ()
    orphans: tuple[str, ...] = ()
    released_bytes: int = 0
    lost_slots: tuple[str, ...] = ()  # slots of nodes no longer alive, removed

    @property
    def to_kill(self) -> tuple[str, ...]:
        return self.expired + self.retired + self.orphans


@dataclass
class SlotRecord:
    slot_id: str
    node_id: str
    total_bytes: int
    reserved_bytes: int = 0
    num_actors: int = 0
    fragmentation: float = 0.0
    utilization: float = 0.0

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.reserved_bytes

    def view(self) -> SlotView:
        return SlotView(self.slot_id, self.node_id, self.total_bytes, self.reserved_bytes,
                        self.num_actors, self.fragmentation, self.utilization)


@dataclass
class RowReservation:
    request_id: str
    num_tokens: int
    tpot_target_s: float | None
    predicted_end: float
    busy_deadline: float
    request_bytes: int = 0  # set by the commit, from the decision's reservation
    replica_id: str = ""  # the ingress replica relaying it ("": none named; it then ends by its deadline)
    # A row leased to `replica_id` (registry_leases.py): it places requests in it without asking, and
    # keeps it after they end; `busy_deadline` is its lease's expiry. Free while `num_tokens` is 0.
    is_lease: bool = False
    # Its prompt tokens still to compute (a joiner's prompt is fed after them, actors/scheduler.py): a leased
    # row's from its admission until its holder reports its first token; 0 where nobody reports it.
    pending_prompt_tokens: int = 0

    @property
    def is_free_lease(self) -> bool:
        return self.is_lease and self.num_tokens == 0

    def view(self) -> RowView:
        return RowView(self.request_bytes, self.num_tokens, self.tpot_target_s, self.predicted_end,
                       self.pending_prompt_tokens)


@dataclass(frozen=True)
class AdoptedRow:
    """A row an ingress replica is still relaying, handed to a registry that restarted empty.

    Everything the lost registry held for it, as the replica knows it from its admission.
    """

    actor_name: str
    model: str
    slot_id: str
    lane: Lane
    is_hot: bool
    is_started: bool  # its actor has sent a token (all its weights are in), so it may batch
    resident_bytes: int
    request_id: str
    request_bytes: int
    num_tokens: int
    tpot_target_s: float | None
    predicted_end: float  # epoch seconds, as the replica's clock reads them (close enough for a retry-after)
    busy_timeout_s: float  # from the adoption on: the registry's own clock sets the deadline
    replica_id: str = ""  # the replica handing it over
    is_lease: bool = False  # a row leased to that replica (num_tokens 0: free)
    start: str = ""  # its start lease's kind while unused (lease.py), else ""


@dataclass(frozen=True)
class AdoptedActor:
    """An idle hot actor an ingress replica knows of, handed to a registry that restarted empty."""

    actor_name: str
    model: str
    slot_id: str
    lane: Lane
    resident_bytes: int


@dataclass
class ActorRecord:
    name: str
    model: str
    slot_id: str
    lane: Lane
    state: ActorState
    is_hot: bool
    resident_bytes: int
    spawned_at: float
    rows: dict[str, RowReservation] = field(default_factory=dict)  # request id -> row, in admission order
    idle_since: float | None = None
    resident_fraction: float = 1.0  # a warm actor's share of its weights in; 0 while warming
    # An unused start lease (registry_leases.py): "warm", a warm actor held for a replica to bind; "spawn", an
    # actor committed for a replica to create. "" once its holder used it, and for every other actor.
    start_lease: str = ""
    # Its engine's measured ÷ rule-predicted step time, as a replica relaying its rows last reported it (1: the
    # rule's own): joins and dispatches on it are priced by it (scorer.py).
    step_correction: float = 1.0
    step_baseline: float = 1.0  # its long-run figure (actors/step_cost.py, StepCheck.baseline): its own once idle
    # False from a warm fill's commit until its filler has created the process (`warm_created`): before that, a
    # request bound to it would find no actor of that name and count it as lost.
    is_created: bool = True

    @property
    def reserved_bytes(self) -> int:
        return self.resident_bytes + sum(r.request_bytes for r in self.rows.values())

    def view(self) -> ActorView:
        return ActorView(self.name, self.model, self.slot_id, self.state, self.lane, self.is_hot,
                         self.resident_bytes, tuple(r.view() for r in self.rows.values()), self.resident_fraction,
                         bool(self.start_lease), self.step_correction, self.is_created)
