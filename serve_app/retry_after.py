"""When a refused request could come back and be served: the `retry-after` of a 503, predicted.

Every running row carries the end its admission predicted (`RowView.predicted_end`: the
registry's clock at admission plus the scorer's predicted total time). For a refused
request, `retry_after_s` walks each slot's row ends in time order, freeing what each end
frees — the row's bytes; for an actor that does not stay hot, after its last row, the
actor itself (its resident bytes and its place on the slot) — and stops at the first
instant the request would fit:

- as a new row of a hot actor of its model and lane (the slot has its `dispatch_bytes` free,
  fewer than `max_batch` rows are left, and few enough that the scorer predicts the join
  within the request's targets and the batch's tightest TPOT, as `decide` checks them: the
  places admission counts by prediction, not the cap), or
- on a fresh actor (the slot has `spawn_bytes` free and room for one more actor).

Each row that ends after that instant frees one more place; a row already past its
predicted end counts as ending now. The answer is the earliest such place over all slots
that no earlier refusal was told (`num_promised` of them are still ahead: refused clients
told the same instant would all come back at once, one would be admitted and the rest
refused again, and on a CPU node a closed loop of such refusals takes the cores from the
batches), minus now, kept within [min_retry_after_s, max_retry_after_s].

Places are told at least a *place gap* apart — the refused request's own predicted hold over
the rows that could make room, the rate at which a batch in steady state frees places — and
the places past the last known row end follow it at that gap: rows that overran their
predictions (a slowed CPU) would all "end now", and the rows' count is not the number of
clients waiting, so without the gap a crowd of refusals would be told one instant and come
back together.

Where nothing running would ever make room (every slot held by idle actors of other models,
say, or no slot at all), it is `policy.retry_after_s`. While the capacity planner has a slot
on its way for the demand, the answer is that slot's predicted readiness instead. Pure and
stdlib-only, like `decide`.
"""

from __future__ import annotations

from dataclasses import replace

from serve_app.demand import refused_hold_s
from serve_app.policy import PolicyConfig, candidate, meets_targets, predict
from serve_app.scorer import RULE_SCORER, Scorer, rule_of
from serve_app.snapshot import ActorView, ClusterSnapshot, RequestFeatures, SlotView


def retry_after_s(features: RequestFeatures, snapshot: ClusterSnapshot, policy: PolicyConfig, now: float,
                  capacity: tuple[float, bool] | None = None, scorer: Scorer = RULE_SCORER,
                  num_promised: int = 0) -> float:
    """Seconds from `now` until a place that fits the request is predicted to free up (see the module doc).

    `capacity`: (seconds, whether it is on its way) until a slot the capacity planner asks for serves
    (registry_capacity.py). On its way, it is quoted instead of a running slot's place, as it is, beyond
    `max_retry_after_s`: the demand is over the capacity, so a place that frees goes to the next arrival,
    and a client told to come back then would only be refused again. Not yet asked for, it is quoted only
    where no slot present would ever free a place (no slot at all, say)."""
    if capacity is not None and capacity[1]:
        return max(policy.min_retry_after_s, capacity[0])
    lane = policy.lane(features.input_tokens, features.max_tokens)
    places = sorted(t for slot in snapshot.slots for t in _slot_frees_at(features, lane, slot, snapshot, policy,
                                                                         now, scorer))
    if not places:
        return policy.retry_after_s if capacity is None else max(policy.min_retry_after_s, capacity[0])
    t = promised_place(places, num_promised, place_gap_s(features, snapshot, lane, scorer))
    return min(policy.max_retry_after_s, max(policy.min_retry_after_s, t - now))


def place_gap_s(features: RequestFeatures, snapshot: ClusterSnapshot, lane: str, scorer: Scorer) -> float:
    """How far apart places for the request free in steady state: each of the rows that could make room
    for it (its model's and lane's) ends about once per hold, taken as the request's own as the rule
    predicts it (as the edge's early refusals take it, admission.py)."""
    num_rows = sum(a.num_rows for a in snapshot.actors if a.model == features.model and a.lane == lane)
    return refused_hold_s(features, rule_of(scorer)) / max(1, num_rows)


def promised_place(places: list[float], num_promised: int, gap_s: float) -> float:
    """The place after the `num_promised` already told: the known places (sorted) kept `gap_s` apart, then
    one every `gap_s` after the last of them."""
    t = places[0]
    for k in range(1, min(num_promised, len(places) - 1) + 1):
        t = max(places[k], t + gap_s)
    return t + max(0, num_promised - (len(places) - 1)) * gap_s


def _slot_frees_at(features: RequestFeatures, lane: str, slot: SlotView, snapshot: ClusterSnapshot,
                   policy: PolicyConfig, now: float, scorer: Scorer) -> list[float]:
    """The instants places for the request free on `slot`: the first that fits, then each later row end."""
    actors = snapshot.actors_on_slot(slot.slot_id)
    ends = sorted((max(now, row.predicted_end), row.request_bytes, i)
                  for i, actor in enumerate(actors) for row in actor.rows)
    free, num_actors = slot.free_bytes, slot.num_actors
    rows_left = [a.num_rows for a in actors]
    max_rows = [_rows_a_join_fits(features, snapshot, slot, a, policy, scorer)
                if a.model == features.model and a.is_hot and a.lane == lane else -1 for a in actors]
    for k, (t, freed, i) in enumerate(ends):
        free += freed
        rows_left[i] -= 1
        actor = actors[i]
        if rows_left[i] == 0 and not actor.is_hot:
            free += actor.resident_bytes  # it exits after its last row
            num_actors -= 1
        joinable = any(rows_left[j] <= max_rows[j] for j in range(len(actors)))
        if ((joinable and free >= features.dispatch_bytes)
                or (free >= features.spawn_bytes and num_actors < policy.max_actors_per_slot)):
            return [t, *(end for end, _, _ in ends[k + 1:])]
    return []


def _rows_a_join_fits(features: RequestFeatures, snapshot: ClusterSnapshot, slot: SlotView, actor: ActorView,
                      policy: PolicyConfig, scorer: Scorer) -> int:
    """The most rows `actor` may be running for the request to be admitted as one more: under `max_batch`,
    and predicted within the targets as `decide` checks them (-1: not even onto an empty batch).

    The running rows' KV is scaled with their count (the rows that end first are not known to be the
    shortest); prompts still to prefill are taken as done by then. Every row count is priced in one
    `predict` call: a refusal's path is where a storm of them spends its CPU.
    """
    limit = actor.min_tpot_target_s
    if limit is None and all(t is None for t in (features.ttft_target_s, features.total_target_s,
                                                 features.tpot_target_s)):
        return policy.max_batch - 1
    join = candidate("join", snapshot, slot, actor, features.input_tokens)
    counts = range(min(actor.num_rows, policy.max_batch - 1), -1, -1)
    shrunk = [replace(join, batch_rows=rows, batch_tokens=actor.batch_tokens * rows // max(1, actor.num_rows),
                      batch_pending_prompt_tokens=0, batch_step_prompt_tokens=0) for rows in counts]
    for rows, p in zip(counts, predict(scorer, features, shrunk), strict=True):
        if meets_targets(features, p, limit):
            return rows
    return -1
