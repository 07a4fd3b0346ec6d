"""The two simulated clusters: zero-queue (the real `decide()`) and the queued baseline.

Both are discrete-event simulations in simulated seconds: arrivals are generated up front
(sorted), request ends sit in a heapq, and at equal times an end is handled before an
arrival, so a slot freed at t can take a request arriving at t.

Zero-queue. Every arrival builds its `RequestFeatures` (serve_app.memory.request_features)
and a `ClusterSnapshot`, calls `serve_app.policy.decide` and commits the decision the way
`RegistryState` does: Dispatch -> the idle actor turns busy and the request's bytes are
reserved; Spawn -> a new actor on the slot with its resident + request bytes; Reject -> the
request is answered at once. At its end a request's actor goes idle if the decision kept it
hot, else it is forgotten and its slot frees. Two interchangeable backends:

- `RegistryCluster` drives the real `RegistryState` (`admit` = decide on the full snapshot +
  commit, `finish`). Exact by construction; a snapshot of 1,000 slots costs hundreds of
  microseconds per decision, so it is the reference, not the default.
- `IncrementalCluster` keeps the same books incrementally and hands `decide` a snapshot
  restricted to what the decision can look at, which yields the identical decision:
  * hot candidates: `decide` walks the idle actors of the request's lanes in snapshot order
    (spawn order: the registry's dict order) and keeps the first `max_candidates` whose
    slot has room; the restricted snapshot holds, per lane, the first `max_candidates` idle
    actors with room, in spawn order, so the walk finds the same ones in the same order;
  * cold candidates: `decide` walks the slots in order and keeps the first `max_candidates`
    with room and fewer than `max_actors_per_slot` actors; the restricted snapshot holds
    exactly those (any other slot it holds either has no room or comes later in the order,
    after the walk has stopped);
  * `hot_count(model, lane)` and `num_busy_on_node(node)` count every hot (busy) actor,
    not just the listed ones, so the snapshot is a `ClusterSnapshot` subclass that answers
    them from the incremental counts;
  * with no candidate at all it holds the largest slot, so `too_large` vs `no_capacity`
    comes out the same.
  `tests/unit/test_simulate.py` checks the two backends give identical outcomes.

Queued baseline. One long-lived replica per slot, weights always resident (every request
runs at its hot service time), a FIFO queue in front (unbounded unless `max_queued`), and
Ray Serve's routing: a request goes to a replica with fewer than `max_ongoing` requests
(power of two choices among those with room), which runs them one at a time in arrival
order; when every replica is full the rest wait in the FIFO. `max_ongoing=1` is a single
central FIFO queue (M/G/N), the best case for a queue; Ray Serve's default is 5.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.sim_calibration import ServiceTimes, Workload
from serve_app.memory import ModelNumbers, request_features
from serve_app.policy import (
    ActorView,
    ClusterSnapshot,
    Decision,
    Dispatch,
    Lane,
    PolicyConfig,
    Reject,
    RequestFeatures,
    SlotView,
    Spawn,
    decide,
)
from serve_app.registry import RegistryState, SlotSpec
from serve_app.scorer import RULE_SCORER, Scorer

MODEL = "sim-model"
REJECT_REASONS = ("no_capacity", "too_large", "latency_target")


@dataclass(eq=False)
class Outcome:
    """Per request, in arrival order. Rejected requests have NaN latencies."""

    ttft_s: np.ndarray
    e2e_s: np.ndarray
    is_rejected: np.ndarray
    is_cold: np.ndarray  # zero-queue: served by an actor spawned for it
    slot: np.ndarray  # the slot (replica) index that served it, -1 if rejected
    reject_reason: np.ndarray  # index into REJECT_REASONS, -1 if admitted

    @classmethod
    def empty(cls, n: int) -> Outcome:
        return cls(np.full(n, np.nan), np.full(n, np.nan), np.zeros(n, bool), np.zeros(n, bool),
                   np.full(n, -1, np.int32), np.full(n, -1, np.int8))


def slot_name(i: int) -> str:
    return f"s{i:05d}"  # zero-padded: the registry orders slots by id, so name order is index order


def actor_name(seq: int) -> str:
    return f"a{seq}"


def node_name(slot: int, slots_per_node: int) -> str:
    return f"n{slot // slots_per_node:05d}"


# ---------------------------------------------------------------- zero-queue backends


class RegistryCluster:
    """The real `RegistryState`: decide on its full snapshot and commit in one call."""

    def __init__(self, slot_bytes: Sequence[int], policy: PolicyConfig, resident_bytes: int,
                 num_prewarmed: int = 0, scorer: Scorer = RULE_SCORER, slots_per_node: int = 8) -> None:
        self.policy, self.scorer = policy, scorer
        self.state = RegistryState(policy.max_actors_per_slot)
        self.state.register_slots(SlotSpec(slot_name(i), node_name(i, slots_per_node), b)
                                  for i, b in enumerate(slot_bytes))
        self._next_seq = 0
        for i in range(num_prewarmed):
            # As if a first request had spawned it and finished: idle, hot, only its resident bytes held.
            name = self._new_name()
            spawn = Spawn(slot_name(i), "short", True, resident_bytes, resident_bytes)
            if not self.state.try_spawn(spawn, name, MODEL, 0.0, math.inf):
                raise ValueError(f"cannot prewarm an actor on slot {i}")
            self.state.finish(name, stays_hot=True, now=0.0)

    def _new_name(self) -> str:
        self._next_seq += 1
        return actor_name(self._next_seq - 1)

    def admit(self, features: RequestFeatures, now: float) -> tuple[Decision, str | None]:
        name = actor_name(self._next_seq)
        decision = self.state.admit(features, self.policy, name, now, self.scorer)
        if isinstance(decision, Spawn):
            self._next_seq += 1
            return decision, name
        return decision, decision.actor_name if isinstance(decision, Dispatch) else None

    def finish(self, name: str, stays_hot: bool, now: float) -> None:
        self.state.finish(name, stays_hot, now)


@dataclass(frozen=True)
class RestrictedSnapshot(ClusterSnapshot):
    """A snapshot holding only what `decide` can look at, with the whole cluster's counts."""

    hot_counts: tuple[tuple[str, str, int], ...] = ()  # (model, lane, hot actors)
    node_busy: tuple[tuple[str, int], ...] = ()  # (node, actors starting or busy), for the listed slots' nodes

    def hot_count(self, model: str, lane: Lane) -> int:
        for m, actor_lane, count in self.hot_counts:
            if m == model and actor_lane == lane:
                return count
        return 0

    def num_busy_on_node(self, node_id: str) -> int:
        for node, count in self.node_busy:
            if node == node_id:
                return count
        return 0


class _Actor:
    __slots__ = ("seq", "name", "slot", "lane", "is_hot", "idle_view", "resident", "request")

    def __init__(self, seq: int, slot: int, lane: Lane, is_hot: bool, resident: int, request: int) -> None:
        self.seq, self.name, self.slot, self.lane = seq, actor_name(seq), slot, lane
        self.is_hot, self.resident, self.request = is_hot, resident, request
        self.idle_view: ActorView | None = None  # set while idle


class IncrementalCluster:
    """The registry's books kept incrementally; `decide` sees a restricted snapshot (module doc)."""

    def __init__(self, slot_bytes: Sequence[int], policy: PolicyConfig, resident_bytes: int,
                 num_prewarmed: int = 0, scorer: Scorer = RULE_SCORER, slots_per_node: int = 8) -> None:
        self.policy, self.scorer = policy, scorer
        self.total = list(slot_bytes)
        self.reserved = [0] * len(self.total)
        self.num_actors = [0] * len(self.total)
        self.names = [slot_name(i) for i in range(len(self.total))]
        self.node = [node_name(i, slots_per_node) for i in range(len(self.total))]
        self.busy_on_node = dict.fromkeys(self.node, 0)  # actors starting or busy
        self.views: list[SlotView | None] = [None] * len(self.total)  # rebuilt only when a slot changes
        self.largest = max(range(len(self.total)), key=self.total.__getitem__)
        self.open: list[int] = list(range(len(self.total)))  # slots with room for another actor, in order
        self.actors: dict[str, _Actor] = {}
        self.idle: dict[str, list[int]] = {"short": [], "long": []}  # seqs, ascending = spawn order
        self.by_seq: dict[int, _Actor] = {}
        self.hot = {"short": 0, "long": 0}
        self._next_seq = 0
        for i in range(num_prewarmed):
            actor = self._spawn(Spawn(slot_name(i), "short", True, resident_bytes, resident_bytes), i)
            self.finish(actor.name, True, 0.0)

    def _slot_view(self, i: int) -> SlotView:
        view = self.views[i]
        if view is None:
            view = self.views[i] = SlotView(self.names[i], self.node[i], self.total[i], self.reserved[i],
                                            self.num_actors[i])
        return view

    def _reserve(self, i: int, delta: int) -> None:
        self.reserved[i] += delta
        self.views[i] = None

    def snapshot(self, features: RequestFeatures) -> RestrictedSnapshot:
        limit = self.policy.max_candidates
        lane = self.policy.lane(features.input_tokens, features.max_tokens)
        slots: set[int] = set()
        views: list[ActorView] = []
        need = features.dispatch_bytes
        # decide() keeps the first `limit` idle actors with room, short lane first for a short request.
        for actor_lane in (("short", "long") if lane == "short" else ("long",)):
            for seq in self.idle[actor_lane]:
                if len(views) == limit:
                    break
                a = self.by_seq[seq]
                if self.total[a.slot] - self.reserved[a.slot] >= need:
                    views.append(a.idle_view)
                    slots.add(a.slot)
        need, found = features.spawn_bytes, 0
        for i in self.open:
            if self.total[i] - self.reserved[i] >= need:
                slots.add(i)
                found += 1
                if found == limit:
                    break
        if not slots:
            slots.add(self.largest)
        ordered = sorted(slots)
        nodes = {self.node[i] for i in ordered}
        return RestrictedSnapshot(tuple(self._slot_view(i) for i in ordered), tuple(views), 0,
                                  ((MODEL, "short", self.hot["short"]), (MODEL, "long", self.hot["long"])),
                                  tuple((n, self.busy_on_node[n]) for n in nodes))

    def admit(self, features: RequestFeatures, now: float) -> tuple[Decision, str | None]:
        decision = decide(features, self.snapshot(features), self.policy, self.scorer)
        if isinstance(decision, Spawn):
            return decision, self._spawn(decision, int(decision.slot_id[1:])).name
        if isinstance(decision, Dispatch):
            a = self.actors[decision.actor_name]
            if a.idle_view is None:
                raise RuntimeError(f"{decision} names an actor that is not idle")
            self.idle[a.lane].pop(bisect.bisect_left(self.idle[a.lane], a.seq))
            a.idle_view, a.request = None, decision.reserve_bytes
            if a.is_hot and not decision.keep_hot:
                self.hot[a.lane] -= 1
            a.is_hot = decision.keep_hot
            self._reserve(a.slot, decision.reserve_bytes)
            self.busy_on_node[self.node[a.slot]] += 1
            return decision, a.name
        return decision, None

    def _spawn(self, decision: Spawn, slot: int) -> _Actor:
        if (self.total[slot] - self.reserved[slot] < decision.reserve_bytes
                or self.num_actors[slot] >= self.policy.max_actors_per_slot):
            raise RuntimeError(f"{decision} does not fit slot {slot}")
        a = _Actor(self._next_seq, slot, decision.lane, decision.keep_hot, decision.resident_bytes,
                   decision.reserve_bytes - decision.resident_bytes)
        self._next_seq += 1
        self.actors[a.name], self.by_seq[a.seq] = a, a
        self._reserve(slot, decision.reserve_bytes)
        self.num_actors[slot] += 1
        if self.num_actors[slot] == self.policy.max_actors_per_slot:
            self.open.pop(bisect.bisect_left(self.open, slot))
        if a.is_hot:
            self.hot[a.lane] += 1
        self.busy_on_node[self.node[slot]] += 1
        return a

    def finish(self, name: str, stays_hot: bool, now: float) -> None:
        a = self.actors[name]
        self.busy_on_node[self.node[a.slot]] -= 1
        if stays_hot:  # RegistryState.finish: idle, hot, its request bytes released
            self._reserve(a.slot, -a.request)
            a.request = 0
            if not a.is_hot:
                self.hot[a.lane] += 1
            a.is_hot = True
            a.idle_view = ActorView(a.name, MODEL, self.names[a.slot], "idle", a.lane, True, a.resident)
            bisect.insort(self.idle[a.lane], a.seq)
            return
        if a.is_hot:
            self.hot[a.lane] -= 1
        self._reserve(a.slot, -(a.resident + a.request))
        if self.num_actors[a.slot] == self.policy.max_actors_per_slot:
            bisect.insort(self.open, a.slot)
        self.num_actors[a.slot] -= 1
        del self.actors[name], self.by_seq[a.seq]


# ---------------------------------------------------------------- the engines


def run_zero_queue(workload: Workload, service: ServiceTimes, cluster: RegistryCluster | IncrementalCluster,
                   numbers: ModelNumbers) -> Outcome:
    arrivals, ins, outs = workload.arrival_s.tolist(), workload.input_tokens.tolist(), workload.output_tokens.tolist()
    hot, cold, decode = service.hot_ttft_s.tolist(), service.cold_ttft_s.tolist(), service.decode_s.tolist()
    out = Outcome.empty(len(arrivals))
    ttft, e2e, slot, is_cold = out.ttft_s, out.e2e_s, out.slot, out.is_cold
    policy = cluster.policy
    ends: list[tuple[float, int, str, bool]] = []  # (end time, request, actor, stays hot)
    for i, now in enumerate(arrivals):
        while ends and ends[0][0] <= now:
            end, _, name, stays_hot = heapq.heappop(ends)
            cluster.finish(name, stays_hot, end)
        features = request_features(MODEL, numbers, ins[i], outs[i], policy)
        decision, name = cluster.admit(features, now)
        if isinstance(decision, Reject):
            out.is_rejected[i] = True
            out.reject_reason[i] = REJECT_REASONS.index(decision.reason)
            continue
        first = cold[i] if isinstance(decision, Spawn) else hot[i]
        ttft[i], e2e[i] = first, first + decode[i]
        slot[i], is_cold[i] = int(decision.slot_id[1:]), isinstance(decision, Spawn)
        heapq.heappush(ends, (now + first + decode[i], i, name, decision.keep_hot))
    while ends:  # every admitted request ends, so every reservation is released or left idle-hot
        end, _, name, stays_hot = heapq.heappop(ends)
        cluster.finish(name, stays_hot, end)
    return out


def run_queued(workload: Workload, service: ServiceTimes, num_replicas: int, max_ongoing: int = 1,
               max_queued: int | None = None, seed: int = 0) -> Outcome:
    """The queued baseline (module doc). `max_queued=None`: an unbounded FIFO, Ray Serve's default."""
    if num_replicas < 1 or max_ongoing < 1 or (max_queued is not None and max_queued < 0):
        raise ValueError(f"need num_replicas >= 1, max_ongoing >= 1, max_queued >= 0; got "
                         f"{num_replicas}, {max_ongoing}, {max_queued}")
    rng = random.Random(seed)
    arrivals = workload.arrival_s.tolist()
    work = service.hot_e2e_s.tolist()
    out = Outcome.empty(len(arrivals))
    start = [math.nan] * len(arrivals)
    ongoing = [0] * num_replicas
    local: list[deque[int]] = [deque() for _ in range(num_replicas)]  # assigned, waiting behind the running one
    room, where = list(range(num_replicas)), list(range(num_replicas))  # replicas with room; index in `room`
    central: deque[int] = deque()
    ends: list[tuple[float, int, int]] = []  # (end time, request, replica)

    def run(i: int, r: int, now: float) -> None:
        start[i] = now
        out.slot[i] = r
        heapq.heappush(ends, (now + work[i], i, r))

    def assign(i: int, now: float) -> None:
        if len(room) >= 2:  # power of two choices among the replicas with room
            a, b = rng.sample(room, 2)
            r = a if ongoing[a] <= ongoing[b] else b
        else:
            r = room[0]
        ongoing[r] += 1
        if ongoing[r] == max_ongoing:  # swap-remove from `room`
            last = room.pop()
            if last != r:
                room[where[r]], where[last] = last, where[r]
        if ongoing[r] == 1:
            run(i, r, now)
        else:
            local[r].append(i)

    def finish(r: int, now: float) -> None:
        ongoing[r] -= 1
        if ongoing[r] == max_ongoing - 1:
            where[r] = len(room)
            room.append(r)
        if local[r]:
            run(local[r].popleft(), r, now)
        while central and room:
            assign(central.popleft(), now)

    for i, now in enumerate(arrivals):
        while ends and ends[0][0] <= now:
            end, _, r = heapq.heappop(ends)
            finish(r, end)
        if room and not central:
            assign(i, now)
        elif max_queued is None or len(central) < max_queued:
            central.append(i)
        else:
            out.is_rejected[i] = True
            out.reject_reason[i] = 0  # Serve's own 503 when its queue is full
    while ends:
        end, _, r = heapq.heappop(ends)
        finish(r, end)
    waited = np.array(start) - workload.arrival_s
    out.ttft_s[:] = waited + service.hot_ttft_s
    out.e2e_s[:] = waited + service.hot_e2e_s
    return out
