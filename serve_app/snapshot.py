"""What a decision sees: one request's features and a snapshot of the cluster's slots, actors and rows.

Plain frozen dataclasses, stdlib only (no Ray, no torch): the registry builds them, the
pure `decide()` (policy.py) reads them, the simulator builds its own.

Actors. An actor is "starting" from its spawn until its first token (its weights are
still streaming in; it serves that one request), then "busy" while it runs rows, and
"idle" with none. A warm actor is started ahead of any request: "warming" until its
embeddings and first layers are resident (`resident_fraction` of its weights), then
"warm"; a request bound to it makes it "starting", as a spawn would. A hot actor (`is_hot`) stays after its rows end and may run up to the
policy's `max_batch` rows at once; each row is one request, holding its KV cache and
workspace (`RequestFeatures.dispatch_bytes`) on the actor's slot while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, Literal

Lane = Literal["short", "long"]
ActorState = Literal["warming", "warm", "starting", "busy", "idle"]
ACTOR_STATES: tuple[str, ...] = ActorState.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class RequestFeatures:
    model: str
    input_tokens: int
    max_tokens: int
    weight_bytes: int
    kv_bytes_per_token: int
    workspace_bytes: int  # this request's transient activations (see `memory.workspace_bytes()`)
    actor_overhead_bytes: int = 0  # per actor process, resident while it lives
    ttft_target_s: float | None = None  # None: no target
    total_target_s: float | None = None
    # Time per output token once decoding; a row joining a batch must not push any row past its own.
    tpot_target_s: float | None = None
    # Sampling settings: features for the scorer only (top_k/top_p cost a sort per token).
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def num_tokens(self) -> int:
        """Positions the request's KV cache holds at most."""
        return self.input_tokens + self.max_tokens

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.num_tokens

    @property
    def dispatch_bytes(self) -> int:
        """Held on a hot actor's slot while the request runs as one of its rows: the weights are already there."""
        return self.kv_bytes + self.workspace_bytes

    @property
    def resident_bytes(self) -> int:
        """Held by a fresh actor for as long as it lives, request or not."""
        return self.weight_bytes + self.actor_overhead_bytes

    @property
    def spawn_bytes(self) -> int:
        return self.resident_bytes + self.dispatch_bytes


@dataclass(frozen=True)
class SlotView:
    slot_id: str
    node_id: str
    total_bytes: int
    reserved_bytes: int
    num_actors: int
    fragmentation: float = 0.0
    utilization: float = 0.0

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.reserved_bytes


@dataclass(frozen=True)
class RowView:
    """One running request on an actor."""

    request_bytes: int  # its KV cache and workspace
    num_tokens: int  # input + max_tokens: the KV positions it reads per step, at most
    tpot_target_s: float | None
    predicted_end: float  # epoch seconds, from the prediction it was admitted with
    # Prompt tokens it has yet to compute, where its holder knows (a leased row: until its first token);
    # 0 where unknown (the registry's own rows).
    pending_prompt_tokens: int = 0


@dataclass(frozen=True)
class ActorView:
    name: str
    model: str
    slot_id: str
    state: ActorState
    lane: Lane
    is_hot: bool  # stays (idle) after its current rows, or is idle now
    resident_bytes: int = 0  # weights + per-process overhead
    rows: tuple[RowView, ...] = ()
    resident_fraction: float = 1.0  # share of the weight bytes loaded (a warm actor's first layers)
    # An unused start lease's actor (lease.py): "starting" for the books, but not loading and not computing —
    # it neither slows its node's starts nor holds its warm pool back.
    is_start_lease: bool = False
    # Its engine's measured ÷ rule-predicted step time, where its holder heard it (Started); 1: the rule's own.
    step_correction: float = 1.0
    # A warming actor whose process its filler has not created yet: counted in its pool and on its slot, but not
    # bound (registry_warm.py).
    is_created: bool = True

    @property
    def reserved_bytes(self) -> int:
        """Resident plus every row's bytes."""
        return self.resident_bytes + sum(r.request_bytes for r in self.rows)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def batch_tokens(self) -> int:
        """KV positions the batch reads per step, at most (every row at its full length)."""
        return sum(r.num_tokens for r in self.rows)

    @property
    def pending_prompt_tokens(self) -> int:
        """Prompt tokens the batch's rows have yet to compute (as far as known)."""
        return sum(r.pending_prompt_tokens for r in self.rows)

    @property
    def prompt_tokens_in_step(self) -> int:
        """Prompt tokens of the step a joiner waits for, as far as known. While every row is still in its prompt
        the step carries all of them, at most what twice the rows' tightest TPOT target allows (actors/scheduler.py;
        the scorer bounds the wait so). Once a row decodes, steps are bounded by its TPOT target: the wait is one
        such step (the rule's `tpot` term). A row whose pending prompt is unknown (0) counts as decoding."""
        if not self.rows or any(r.pending_prompt_tokens == 0 for r in self.rows):
            return 0
        return self.pending_prompt_tokens

    def prompt_tokens_ahead(self, num_prompt_tokens: int) -> int:
        """Of the rows' pending prompt tokens, those the engine computes before a joiner's prompt of
        `num_prompt_tokens` is done: it shares each step's prompt tokens evenly, the shortest prompt first
        (actors/scheduler.py), so no other prompt gets more of them than the joiner's own length."""
        return sum(min(r.pending_prompt_tokens, num_prompt_tokens) for r in self.rows)

    @property
    def min_tpot_target_s(self) -> float | None:
        targets = [r.tpot_target_s for r in self.rows if r.tpot_target_s is not None]
        return min(targets) if targets else None


@dataclass(frozen=True)
class ClusterSnapshot:
    """Slots in a stable order (first fit follows it) and actors, at registry version `version`.

    The per-model indexes `decide` needs are built on first use and cached; they are not
    pickled (see __getstate__), so a snapshot travels at the size of its fields.
    """

    slots: tuple[SlotView, ...]
    actors: tuple[ActorView, ...]
    version: int = 0

    def slot(self, slot_id: str) -> SlotView | None:
        return self._slots_by_id.get(slot_id)

    def idle_actors(self, model: str, lane: Lane) -> list[ActorView]:
        return self._by_state.get((model, lane, "idle"), [])

    def warm_actors(self, model: str, lane: Lane, state: ActorState = "warm") -> list[ActorView]:
        """Warm actors of a model filled for a lane, ready to be bound (or, with "warming", still starting)."""
        return self._by_state.get((model, lane, state), [])

    def warm_count(self, model: str, lane: Lane) -> int:
        """Warm actors of a model and lane, the warming ones included: the pool's size."""
        return len(self.warm_actors(model, lane)) + len(self._by_state.get((model, lane, "warming"), []))

    def busy_hot_actors(self, model: str, lane: Lane) -> list[ActorView]:
        """Busy actors that stay hot: the ones a request may join."""
        return [a for a in self._by_state.get((model, lane, "busy"), []) if a.is_hot]

    def actors_on_slot(self, slot_id: str) -> list[ActorView]:
        return self._by_slot.get(slot_id, [])

    def hot_count(self, model: str, lane: Lane) -> int:
        return self._hot_counts.get((model, lane), 0)

    def num_busy_on_node(self, node_id: str) -> int:
        """Actors starting, busy or warming on a node: they share its host (and, on CPU slots, its cores)."""
        counts = self._states_by_node.get(node_id, {})
        return sum(n for state, n in counts.items() if state not in ("idle", "warm"))

    def num_computing_on_node(self, node_id: str) -> int:
        """Actors using a node's CPU now: starting or warming (a process start, a load), or running a request
        (a hot actor holding only free leased rows is "busy" for the books, but computes nothing)."""
        return self._computing_by_node.get(node_id, 0)

    def num_starting_on_node(self, node_id: str) -> int:
        """Actors loading for a request on a node (spawned or bound, before their first token)."""
        return self._states_by_node.get(node_id, {}).get("starting", 0)

    @cached_property
    def max_total_bytes(self) -> int:
        return max((s.total_bytes for s in self.slots), default=0)

    @cached_property
    def _slots_by_id(self) -> dict[str, SlotView]:
        return {s.slot_id: s for s in self.slots}

    @cached_property
    def _by_state(self) -> dict[tuple[str, Lane, ActorState], list[ActorView]]:
        index: dict[tuple[str, Lane, ActorState], list[ActorView]] = {}
        for a in self.actors:
            index.setdefault((a.model, a.lane, a.state), []).append(a)
        return index

    @cached_property
    def _by_slot(self) -> dict[str, list[ActorView]]:
        index: dict[str, list[ActorView]] = {}
        for a in self.actors:
            index.setdefault(a.slot_id, []).append(a)
        return index

    @cached_property
    def _hot_counts(self) -> dict[tuple[str, Lane], int]:
        counts: dict[tuple[str, Lane], int] = {}
        for a in self.actors:
            if a.is_hot:
                counts[(a.model, a.lane)] = counts.get((a.model, a.lane), 0) + 1
        return counts

    @cached_property
    def _states_by_node(self) -> dict[str, dict[ActorState, int]]:
        counts: dict[str, dict[ActorState, int]] = {}
        for a in self.actors:
            slot = self._slots_by_id.get(a.slot_id)
            if slot is not None and not a.is_start_lease:
                by_state = counts.setdefault(slot.node_id, {})
                by_state[a.state] = by_state.get(a.state, 0) + 1
        return counts

    @cached_property
    def _computing_by_node(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for a in self.actors:
            slot = self._slots_by_id.get(a.slot_id)
            if slot is not None and not a.is_start_lease and (
                    a.state in ("starting", "warming") or any(r.num_tokens > 0 for r in a.rows)):
                counts[slot.node_id] = counts.get(slot.node_id, 0) + 1
        return counts

    def __getstate__(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


@dataclass(frozen=True)
class ClusterSummary:
    """What /health reports and the ingress's gauges show, from one registry snapshot."""

    actors: dict[str, int]  # by state, every state present (0 where none)
    num_rows: int
    num_slots: int
    num_free_slots: int  # slots with no actor
    free_bytes: int
    # Rows on busy hot actors over the rows they could hold (max_batch each); 0.0 when none is busy.
    batch_occupancy: float
    # The capacity planner's (capacity.py), where it is on: the slots it asks Ray for, the nodes still to come
    # for them, and the refusals decided while a slot was on its way (since the registry started).
    num_slots_wanted: int | None = None
    num_nodes_pending: int = 0
    num_refused_for_capacity: int = 0


def summarize(snap: ClusterSnapshot, max_batch: int) -> ClusterSummary:
    """Counts of requests, not reservations: a row leased to a replica with nothing running in it
    (num_tokens 0, lease.py) is not counted, and an actor with only such rows counts as idle."""
    actors = dict.fromkeys(ACTOR_STATES, 0)
    running = {a.name: sum(1 for r in a.rows if r.num_tokens) for a in snap.actors}
    for a in snap.actors:
        actors["idle" if a.state == "busy" and not running[a.name] else a.state] += 1
    batching = [a for a in snap.actors if a.state == "busy" and a.is_hot and running[a.name]]
    capacity = len(batching) * max_batch
    return ClusterSummary(
        actors=actors,
        num_rows=sum(running.values()),
        num_slots=len(snap.slots),
        num_free_slots=sum(1 for s in snap.slots if s.num_actors == 0),
        free_bytes=sum(s.free_bytes for s in snap.slots),
        batch_occupancy=sum(running[a.name] for a in batching) / capacity if capacity else 0.0,
    )
