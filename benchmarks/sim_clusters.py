"""The zero-queue cluster's books, two interchangeable ways: the real `RegistryState`, or kept incrementally.

Both answer `admit(features, now, request)` with the decision of the real
`serve_app.policy.decide` and commit it as `RegistryState` does (Dispatch: an idle hot
actor takes the request as its one row; Join: a busy hot actor of the request's lane
takes it as one more row of its batch; Spawn: a new actor, "starting" until its first
token (`started`), holding its resident bytes and the row's; Reject: nothing changes),
and `finish(name, request, now)` releases that one row (an actor that is not hot is
forgotten after its last row, a hot one goes idle). sim_model.py drives them in time.

- `RegistryCluster` drives the real `RegistryState` (`admit` = decide on the full snapshot +
  commit, `actor_started`, `finish`). Exact by construction; a snapshot of hundreds of slots
  costs hundreds of microseconds per decision, so it is the reference, not the default.
- `IncrementalCluster` keeps the same books incrementally and hands `decide` a snapshot
  restricted to what the decision can look at, which yields the identical decision:
  * hot candidates: `decide` walks the idle actors of the request's lanes in snapshot order
    (spawn order: the registry's dict order) and keeps the first `max_candidates` whose slot
    has room; the restricted snapshot holds, per lane, the first `max_candidates` idle actors
    with room, in spawn order, so the walk finds the same ones in the same order;
  * join candidates: `decide` takes the `max_candidates` least loaded (fewest rows, then KV
    positions, then spawn order) of the busy hot actors of the request's lane with a free row
    and room; the books keep those actors sorted so, and the restricted snapshot holds the
    first `max_candidates` of them with room, in that order, each with its rows, so a
    candidate's `batch_rows` and `batch_tokens` are the registry's and `decide` picks the same
    ones in the same order (listing every such actor gave the same decisions, at a cost that
    grows with the cluster once batches are seldom full: places by prediction);
  * cold candidates: `decide` walks the slots in order and keeps the first `max_candidates`
    with room and fewer than `max_actors_per_slot` actors; the restricted snapshot holds
    exactly those (any other slot it holds either has no room or comes later in the order,
    after the walk has stopped);
  * `hot_count(model, lane)` and `num_busy_on_node(node)` (= `num_computing_on_node`) count every hot (busy) actor, not
    just the listed ones, so the snapshot is a `ClusterSnapshot` subclass that answers them
    from the incremental counts;
  * with no candidate at all it holds the largest slot, so `too_large` vs `no_capacity`
    comes out the same.
  It does not compute a refusal's retry-after (the simulated clients do not retry).
  `tests/unit/test_simulate.py` checks that the two give identical outcomes.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from serve_app.decisions import Decision, Dispatch, Join, Reject, Spawn
from serve_app.policy import PolicyConfig, decide
from serve_app.registry import RegistryState, RowReservation, SlotSpec
from serve_app.scorer import RULE_SCORER, Scorer
from serve_app.snapshot import ActorView, ClusterSnapshot, Lane, RequestFeatures, RowView, SlotView

MODEL = "sim-model"


def slot_name(i: int) -> str:
    return f"s{i:05d}"  # zero-padded: the registry orders slots by id, so name order is index order


def actor_name(seq: int) -> str:
    return f"a{seq}"


def node_name(slot: int, slots_per_node: int) -> str:
    return f"n{slot // slots_per_node:05d}"


def prewarm_plan(num_short: int, num_long: int) -> list[tuple[int, Lane]]:
    """(slot, lane) of each prewarmed hot actor: the short lane's on the first slots, then the long lane's."""
    return [(i, "short") for i in range(num_short)] + [(num_short + i, "long") for i in range(num_long)]


def _predicted_end(decision: Decision, now: float) -> float:
    prediction = decision.prediction  # type: ignore[union-attr]
    return now + (prediction.total_s if prediction is not None else 0.0)


class RegistryCluster:
    """The real `RegistryState`: decide on its full snapshot and commit in one call."""

    def __init__(self, slot_bytes: Sequence[int], policy: PolicyConfig, resident_bytes: int,
                 num_prewarmed: int = 0, scorer: Scorer = RULE_SCORER, slots_per_node: int = 8,
                 num_prewarmed_long: int = 0) -> None:
        self.policy, self.scorer = policy, scorer
        self.state = RegistryState(policy.max_actors_per_slot, max_batch=policy.max_batch)
        self.state.register_slots(SlotSpec(slot_name(i), node_name(i, slots_per_node), b)
                                  for i, b in enumerate(slot_bytes))
        self._next_seq = 0
        for slot, lane in prewarm_plan(num_prewarmed, num_prewarmed_long):
            # As if a first request had spawned it and finished: idle, hot, only its resident bytes held.
            name, request = actor_name(self._next_seq), f"prewarm-{self._next_seq}"
            self._next_seq += 1
            row = RowReservation(request, 1, None, 0.0, math.inf)
            if not self.state.try_spawn(Spawn(slot_name(slot), lane, True, resident_bytes, resident_bytes), name,
                                        MODEL, row, 0.0):
                raise ValueError(f"cannot prewarm an actor on slot {slot}")
            self.state.actor_started(name)
            self.state.finish(name, request, "complete", 0.0)

    def admit(self, features: RequestFeatures, now: float, request: int) -> tuple[Decision, str | None]:
        name = actor_name(self._next_seq)
        decision = self.state.admit(features, self.policy, name, str(request), now, self.scorer)
        if isinstance(decision, Spawn):
            self._next_seq += 1
            return decision, name
        return decision, None if isinstance(decision, Reject) else decision.actor_name

    def first_token(self, request: int) -> None:
        """Its prompt is done: nothing here waits on it (the registry hears of prompts from lease holders)."""

    def started(self, name: str) -> None:
        self.state.actor_started(name)

    def finish(self, name: str, request: int, now: float) -> None:
        self.state.finish(name, str(request), "complete", now)

    def check_books(self) -> None:
        self.state.check_invariants()


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

    def num_computing_on_node(self, node_id: str) -> int:
        # A simulated busy actor always computes (its rows are requests, never leased free rows).
        return self.num_busy_on_node(node_id)


class _Actor:
    __slots__ = ("seq", "name", "slot", "lane", "state", "is_hot", "resident", "rows", "view", "is_idle_listed",
                 "join_key")

    def __init__(self, seq: int, slot: int, lane: Lane, is_hot: bool, resident: int) -> None:
        self.seq, self.name, self.slot, self.lane = seq, actor_name(seq), slot, lane
        self.state, self.is_hot, self.resident = "starting", is_hot, resident
        self.rows: dict[int, RowView] = {}  # request -> its row, in admission order
        self.view: ActorView | None = None  # rebuilt only when the actor changes
        self.is_idle_listed = False
        self.join_key: tuple[int, int, int] | None = None  # (rows, KV positions, seq) where listed as joinable


class IncrementalCluster:
    """The registry's books kept incrementally; `decide` sees a restricted snapshot (module doc)."""

    def __init__(self, slot_bytes: Sequence[int], policy: PolicyConfig, resident_bytes: int,
                 num_prewarmed: int = 0, scorer: Scorer = RULE_SCORER, slots_per_node: int = 8,
                 num_prewarmed_long: int = 0) -> None:
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
        self.by_seq: dict[int, _Actor] = {}
        # Seqs, ascending = spawn order = the registry's snapshot order.
        self.idle: dict[str, list[int]] = {"short": [], "long": []}
        # Busy, hot, a row free: their join keys, ascending = decide's order of preference among joins.
        self.joinable: dict[str, list[tuple[int, int, int]]] = {"short": [], "long": []}
        self.hot = {"short": 0, "long": 0}
        self._next_seq = 0
        for slot, lane in prewarm_plan(num_prewarmed, num_prewarmed_long):
            a = self._spawn(Spawn(slot_name(slot), lane, True, resident_bytes, resident_bytes), slot, -1, 1, 0.0)
            self.started(a.name)
            self.finish(a.name, -1, 0.0)

    # ---- the snapshot ---------------------------------------------------------------

    def _slot_view(self, i: int) -> SlotView:
        view = self.views[i]
        if view is None:
            view = self.views[i] = SlotView(self.names[i], self.node[i], self.total[i], self.reserved[i],
                                            self.num_actors[i])
        return view

    def _actor_view(self, a: _Actor) -> ActorView:
        if a.view is None:
            a.view = ActorView(a.name, MODEL, self.names[a.slot], a.state, a.lane, a.is_hot,  # type: ignore[arg-type]
                               a.resident, tuple(a.rows.values()))
        return a.view

    def snapshot(self, features: RequestFeatures) -> RestrictedSnapshot:
        policy = self.policy
        limit, lane = policy.max_candidates, policy.lane(features.input_tokens, features.max_tokens)
        slots: set[int] = set()
        views: list[ActorView] = []
        need = features.dispatch_bytes
        # decide() keeps the first `limit` idle actors with room, short lane first for a short request,
        # then the least loaded `limit` of the busy hot actors of the request's lane with a free row and
        # room: the first `limit` of those with room in that order are listed, so it finds the same ones. A long
        # request that nothing else can take looks at the first `limit` idle short-lane actors with room too.
        lists = [self.idle["short"], self.idle["long"]] if lane == "short" else [self.idle["long"]]
        joins = [key[2] for key in self.joinable[lane]]  # seqs, least loaded first
        groups = [(lists, limit), *([([self.idle["short"]], limit)] if lane == "long" else []),
                  ([joins] if policy.max_batch > 1 else [], limit)]
        for group, cap in groups:
            found = 0
            for seqs in group:
                for seq in seqs:
                    if found == cap:
                        break
                    a = self.by_seq[seq]
                    if self.total[a.slot] - self.reserved[a.slot] >= need:
                        views.append(self._actor_view(a))
                        slots.add(a.slot)
                        found += 1
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

    # ---- commits --------------------------------------------------------------------

    def admit(self, features: RequestFeatures, now: float, request: int) -> tuple[Decision, str | None]:
        decision = decide(features, self.snapshot(features), self.policy, self.scorer)
        if isinstance(decision, Reject):
            return decision, None
        end = _predicted_end(decision, now)
        if isinstance(decision, Spawn):
            return decision, self._spawn(decision, int(decision.slot_id[1:]), request, features.num_tokens, end,
                                         features.tpot_target_s).name
        a = self.actors[decision.actor_name]
        if isinstance(decision, Dispatch):
            if a.state != "idle":
                raise RuntimeError(f"{decision} names an actor that is not idle")
            if a.is_hot and not decision.keep_hot:
                self.hot[a.lane] -= 1
            a.is_hot = decision.keep_hot
            a.state = "busy"
            self.busy_on_node[self.node[a.slot]] += 1
        elif not (isinstance(decision, Join) and a.state == "busy" and a.is_hot
                  and len(a.rows) < self.policy.max_batch):
            raise RuntimeError(f"{decision} names an actor that cannot take a row")
        a.rows[request] = RowView(decision.reserve_bytes, features.num_tokens, features.tpot_target_s, end)
        self._reserve(a.slot, decision.reserve_bytes)
        self._changed(a)
        return decision, a.name

    def _spawn(self, decision: Spawn, slot: int, request: int, num_tokens: int, end: float,
               tpot_target_s: float | None = None) -> _Actor:
        if (self.total[slot] - self.reserved[slot] < decision.reserve_bytes
                or self.num_actors[slot] >= self.policy.max_actors_per_slot):
            raise RuntimeError(f"{decision} does not fit slot {slot}")
        a = _Actor(self._next_seq, slot, decision.lane, decision.keep_hot, decision.resident_bytes)
        # Its TPOT target as the registry keeps it: a later join must keep this row within it too.
        a.rows[request] = RowView(decision.reserve_bytes - decision.resident_bytes, num_tokens, tpot_target_s, end)
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

    def first_token(self, request: int) -> None:
        """Its prompt is done: nothing here waits on it (the registry hears of prompts from lease holders)."""

    def started(self, name: str) -> None:
        a = self.actors.get(name)
        if a is not None and a.state == "starting":
            a.state = "busy"
            self._changed(a)

    def finish(self, name: str, request: int, now: float) -> None:
        a = self.actors[name]
        self._reserve(a.slot, -a.rows.pop(request).request_bytes)
        if not a.rows:
            self.busy_on_node[self.node[a.slot]] -= 1
            if not a.is_hot:  # it exits after its last row
                self._forget(a)
                return
            a.state = "idle"
        self._changed(a)

    def _forget(self, a: _Actor) -> None:
        a.state = "gone"
        self._sync_lists(a)
        self._reserve(a.slot, -a.resident)
        if self.num_actors[a.slot] == self.policy.max_actors_per_slot:
            bisect.insort(self.open, a.slot)
        self.num_actors[a.slot] -= 1
        del self.actors[a.name], self.by_seq[a.seq]

    def _changed(self, a: _Actor) -> None:
        a.view = None
        self._sync_lists(a)

    def _sync_lists(self, a: _Actor) -> None:
        """Keep `idle` and `joinable` to exactly the actors the registry's snapshot would list there."""
        is_idle = a.state == "idle"
        seqs = self.idle[a.lane]
        if a.is_idle_listed and not is_idle:
            seqs.pop(bisect.bisect_left(seqs, a.seq))
        elif is_idle and not a.is_idle_listed:
            bisect.insort(seqs, a.seq)
        a.is_idle_listed = is_idle
        is_joinable = a.state == "busy" and a.is_hot and len(a.rows) < self.policy.max_batch
        key = (len(a.rows), sum(r.num_tokens for r in a.rows.values()), a.seq) if is_joinable else None
        if key != a.join_key:
            keys = self.joinable[a.lane]
            if a.join_key is not None:
                keys.pop(bisect.bisect_left(keys, a.join_key))
            if key is not None:
                bisect.insort(keys, key)
            a.join_key = key

    def _reserve(self, i: int, delta: int) -> None:
        self.reserved[i] += delta
        self.views[i] = None

    def check_books(self) -> None:
        """Raise AssertionError unless every count and list matches the actors exactly."""
        reserved, counts = [0] * len(self.total), [0] * len(self.total)
        hot, busy = {"short": 0, "long": 0}, dict.fromkeys(self.node, 0)
        for a in self.actors.values():
            reserved[a.slot] += a.resident + sum(r.request_bytes for r in a.rows.values())
            counts[a.slot] += 1
            hot[a.lane] += a.is_hot
            busy[self.node[a.slot]] += a.state != "idle"
            assert (a.state == "idle") == (not a.rows), f"{a.name} is {a.state} with {len(a.rows)} rows"
            assert len(a.rows) <= self.policy.max_batch and (len(a.rows) <= 1 or a.is_hot), f"{a.name} rows"
        assert reserved == self.reserved and counts == self.num_actors, "slot books differ from the actors"
        assert all(r <= t for r, t in zip(reserved, self.total, strict=True)), "a slot is over-committed"
        assert hot == self.hot and busy == self.busy_on_node, "hot or busy counts differ from the actors"
        assert self.open == [i for i, n in enumerate(counts) if n < self.policy.max_actors_per_slot]
        for lane in ("short", "long"):
            lane_actors = sorted((a for a in self.actors.values() if a.lane == lane), key=lambda a: a.seq)
            assert self.idle[lane] == [a.seq for a in lane_actors if a.state == "idle"]
            assert self.joinable[lane] == sorted(
                (len(a.rows), sum(r.num_tokens for r in a.rows.values()), a.seq) for a in lane_actors
                if a.state == "busy" and a.is_hot and len(a.rows) < self.policy.max_batch)
