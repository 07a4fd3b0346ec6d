"""When a refused request could come back and be served: the `retry-after` of a 503, predicted.

Every running row carries the end its admission predicted (`RowView.predicted_end`: the
registry's clock at admission plus the scorer's predicted total time). For a refused
request, `retry_after_s` walks each slot's row ends in time order, freeing what each end
frees — the row's bytes; for an actor that does not stay hot, after its last row, the
actor itself (its resident bytes and its place on the slot) — and stops at the first
instant the request would fit:

- as a new row of a hot actor of its model and lane (fewer than `max_batch` rows left,
  and the slot has its `dispatch_bytes` free), or
- on a fresh actor (the slot has `spawn_bytes` free and room for one more actor).

The answer is the earliest such instant over all slots, minus now, kept within
[min_retry_after_s, max_retry_after_s]; a row already past its predicted end counts as
ending now. Where nothing running would ever make room (every slot held by idle actors of
other models, say, or no slot at all), it is `policy.retry_after_s`. While the capacity planner
has a slot on its way for the demand, the answer is that slot's predicted readiness instead. Pure and stdlib-only, like `decide`.
"""

from __future__ import annotations

import math

from serve_app.policy import PolicyConfig
from serve_app.snapshot import ActorView, ClusterSnapshot, RequestFeatures, SlotView


def retry_after_s(features: RequestFeatures, snapshot: ClusterSnapshot, policy: PolicyConfig, now: float,
                  capacity: tuple[float, bool] | None = None) -> float:
    """Seconds from `now` until a place that fits the request is predicted to free up (see the module doc).

    `capacity`: (seconds, whether it is on its way) until a slot the capacity planner asks for serves
    (registry_capacity.py). On its way, it is quoted instead of a running slot's place, as it is, beyond
    `max_retry_after_s`: the demand is over the capacity, so a place that frees goes to the next arrival,
    and a client told to come back then would only be refused again. Not yet asked for, it is quoted only
    where no slot present would ever free a place (no slot at all, say)."""
    if capacity is not None and capacity[1]:
        return max(policy.min_retry_after_s, capacity[0])
    lane = policy.lane(features.input_tokens, features.max_tokens)
    earliest = math.inf
    for slot in snapshot.slots:
        t = _slot_frees_at(features, lane, slot, snapshot.actors_on_slot(slot.slot_id), policy, now)
        earliest = min(earliest, t)
    if math.isinf(earliest):
        return policy.retry_after_s if capacity is None else max(policy.min_retry_after_s, capacity[0])
    return min(policy.max_retry_after_s, max(policy.min_retry_after_s, earliest - now))


def _slot_frees_at(features: RequestFeatures, lane: str, slot: SlotView, actors: list[ActorView],
                   policy: PolicyConfig, now: float) -> float:
    ends = sorted((max(now, row.predicted_end), row.request_bytes, i)
                  for i, actor in enumerate(actors) for row in actor.rows)
    free, num_actors = slot.free_bytes, slot.num_actors
    rows_left = [a.num_rows for a in actors]
    for t, freed, i in ends:
        free += freed
        rows_left[i] -= 1
        actor = actors[i]
        if rows_left[i] == 0 and not actor.is_hot:
            free += actor.resident_bytes  # it exits after its last row
            num_actors -= 1
        joinable = any(a.model == features.model and a.is_hot and a.lane == lane and rows_left[j] < policy.max_batch
                       for j, a in enumerate(actors))
        if joinable and free >= features.dispatch_bytes:
            return t
        if free >= features.spawn_bytes and num_actors < policy.max_actors_per_slot:
            return t
    return math.inf
