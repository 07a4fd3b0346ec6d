"""The zero-queue decision: run a request now — alone on an idle hot actor, as a new row of a hot
actor's batch, on a warm actor, or on a fresh actor — or refuse it now.

`decide(features, snapshot, policy, scorer) -> Dispatch | Join | Bind | Spawn | Reject` is a pure
function of its arguments (stdlib only: no Ray, no torch), so the ingress, the registry
and the simulator all call the same code.

1. Lane. A request is *short* when input_tokens <= short_max_input_tokens and
   max_tokens <= short_max_output_tokens, else *long*. Short requests use hot actors
   kept for them; long requests get actors of the long lane, so a long generation never
   holds a short request back (it never shares a short actor's steps).
2. Feasible candidates, in a stable order:
   - hot: idle actors of the model whose slot has `dispatch_bytes` free (the weights are
     already resident; the request adds its KV cache and workspace). A short request
     takes a short-lane actor first, then an idle long-lane one (it is idle, so nothing
     waits on it, and it skips a cold start). A long request takes a short-lane actor only
     where it would otherwise be refused (step 3): the short lane exists for isolation, not
     to turn requests away from an idle server.
   - join: busy hot actors of the model *and of the request's lane* with fewer than
     `max_batch` rows (a safety cap: targets, below, set a batch's size), whose slot has
     `dispatch_bytes` free — the `max_candidates` least loaded of them (fewest rows, then
     fewest KV positions). The request becomes one more row; it waits for nothing but the
     actor's next step boundary.
   - warm: warm actors of the model filled for the request's lane (started ahead of any
     request, their first layers resident: warm_pool.py) whose slot has `dispatch_bytes`
     free. Binding one skips the process start; the rest of its weights stream in while
     its first layers compute.
   - cold: the first `max_candidates` slots, in snapshot order, with `spawn_bytes` free
     and fewer than `max_actors_per_slot` actors.
   A warm actor filled for the other lane is bound only where the request would otherwise
   pay a process start (the best candidate is cold) or be refused: a lane's warm actors are
   there for its own requests first. Failing those, a *warming* actor of the model (its
   process starting, for the pool) is bound in place of a fresh one: further along, on a
   slot the pool already holds — a fresh deployment serves its first requests this way
   instead of refusing them until its pool is warm.
3. The scorer predicts TTFT, total time and TPOT per candidate; the fastest (TTFT, then
   total, then the most TPOT slack, then candidate order) that meets the request's latency
   targets wins — and a join must also keep every row already running within its own TPOT
   target, since the new row slows every step of that batch. Where the model's hot actors are
   at `max_hot` (a bound or fresh actor would exit after its request), an idle hot actor or a
   join that meets the targets is taken before any warm bind or spawn, however much faster:
   such a bind costs a process start to refill the pool, and a spawn one now, on the cores or
   the device the running batches share, for every request that could have joined. The
   decision carries the chosen candidate and its prediction. A long request that nothing of its
   lane can take within its targets (nor a warm or warming actor of the other lane) is dispatched
   to an idle short-lane actor that meets them, before it is refused, or else binds the short lane's warm actor,
   which then stays hot in the short lane where that lane has room. Predictions that are malformed (wrong count, NaN, negative, ttft >
   total) or a scorer that raises fall back to the rule scorer for this decision: a
   scorer only ranks what is feasible.
4. No candidate: eviction, if a slot held only by idle hot or warm actors would fit a
   fresh actor once they are gone — a Spawn that names the actors to retire (`evict`),
   fewest hot ones first, then fewest actors. A warm (or warming) actor of the request's
   own model is never retired for it: it is further along than a fresh actor would be. Else `too_large` when
   `spawn_bytes` exceeds every slot's total (it can never fit: the ingress answers 400
   invalid_request_error), else `no_capacity` (503 overloaded_error). The registry fills
   in `retry_after_s` from its own prediction of when a fitting place frees up
   (retry_after.py).

Memory-aware batching (which batch a row joins). A decode step reads every weight once
for the whole batch and, per row, that row's KV cache: step time ~ weights read + the
batch's KV bytes read + compute. So a batch of rows with long contexts is slow for all of
them, and one more long row slows it further, while a short row adds almost nothing.
The candidates carry each batch's rows and KV positions (`batch_rows`, `batch_tokens`;
KV bytes read per step = batch_tokens x kv_bytes_per_token) and the scorer predicts the
batch's step time with the new row in it: the fastest join is the batch whose KV reads
the new row complements — a long-context request goes to the batch reading the least
KV, short ones fill in beside long ones — and a join that would push a running row past
its TPOT target is not taken at all.

Memory (design invariant 3). A fresh actor needs

    spawn_bytes    = weight_bytes + actor_overhead_bytes           (resident while it lives)
                   + kv_bytes_per_token * (input_tokens + max_tokens) + workspace_bytes
    dispatch_bytes = the second line alone                         (held while its row runs)

`actor_overhead_bytes` (CUDA context, cuBLAS workspace, allocator slack) is per process,
so a hot actor already holds it; `workspace_bytes` is the request's prefill activations,
derived in `serve_app.memory.workspace_bytes()` from the model's sizes. A batched actor
holds resident bytes plus the sum of its rows' dispatch bytes, and back to resident bytes
when its batch drains.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serve_app.decisions import Bind, Decision, Dispatch, Join, Reject, Spawn
from serve_app.scorer import RULE_SCORER, Candidate, Prediction, Scorer
from serve_app.snapshot import ActorView, ClusterSnapshot, Lane, RequestFeatures

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class PolicyConfig:
    short_max_input_tokens: int = 2048
    short_max_output_tokens: int = 512
    # Actors kept hot per model and lane: idle, or serving requests they will stay after.
    max_hot_short_actors: int = 1
    max_hot_long_actors: int = 0  # 0: long requests get dedicated actors that exit
    # Per-model exceptions: (model, max_hot_short_actors, max_hot_long_actors).
    hot_overrides: tuple[tuple[str, int, int], ...] = ()
    # Warm actors kept per model and lane, started ahead of requests (warm_pool.py).
    num_warm_short_actors: int = 0
    num_warm_long_actors: int = 0
    # Per-model exceptions: (model, num_warm_short_actors, num_warm_long_actors).
    warm_overrides: tuple[tuple[str, int, int], ...] = ()
    # Retire idle hot or warm actors for a request that has nowhere else to go (module doc, 4).
    is_eviction_enabled: bool = True
    # An idle hot actor retires after this long idle; a model's warm actors retire (and are
    # not refilled) once the model has had no request for this long. None: never.
    max_idle_s: float | None = None
    # A safety cap on the rows a hot actor runs at once, not the policy: a row joins while the
    # batch's predicted step keeps every row within its TPOT target and the slot has room for its
    # KV (module doc, 3). Without TPOT targets only this and memory bound a batch. 1 turns joining off.
    max_batch: int = 32
    # Per actor process beyond its weights (a GPU actor's CUDA context): unmeasured here; set it per deployment.
    actor_overhead_bytes: int = 512 * MiB
    max_actors_per_slot: int = 1  # 1 for num_gpus=1 actors
    max_candidates: int = 8  # per kind (hot, join, cold) handed to the scorer
    # A refusal's retry-after: the registry's estimate of when a fitting place frees up, kept
    # within these bounds; `retry_after_s` is the answer when nothing running would make room.
    retry_after_s: float = 1.0
    min_retry_after_s: float = 0.05
    max_retry_after_s: float = 30.0
    # Bounds (not estimates) that set a reservation's expiry; see `busy_timeout_s`.
    max_load_s: float = 300.0
    max_seconds_per_token: float = 0.5
    busy_margin_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("short_max_input_tokens", "short_max_output_tokens", "max_actors_per_slot", "max_candidates",
                     "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"PolicyConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_hot_short_actors", "max_hot_long_actors", "actor_overhead_bytes",
                     "num_warm_short_actors", "num_warm_long_actors"):
            if getattr(self, name) < 0:
                raise ValueError(f"PolicyConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("retry_after_s", "min_retry_after_s", "max_retry_after_s", "max_load_s",
                     "max_seconds_per_token", "busy_margin_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PolicyConfig.{name} must be > 0, got {getattr(self, name)}")
        if not self.min_retry_after_s <= self.retry_after_s <= self.max_retry_after_s:
            raise ValueError("PolicyConfig needs min_retry_after_s <= retry_after_s <= max_retry_after_s, got "
                             f"{self.min_retry_after_s}, {self.retry_after_s}, {self.max_retry_after_s}")
        for field_name in ("hot_overrides", "warm_overrides"):
            for model, short, long in getattr(self, field_name):
                if short < 0 or long < 0:
                    raise ValueError(f"PolicyConfig.{field_name} for {model!r} must be >= 0, got ({short}, {long})")
        if self.max_idle_s is not None and not self.max_idle_s > 0:
            raise ValueError(f"PolicyConfig.max_idle_s must be > 0 or None, got {self.max_idle_s}")

    def lane(self, input_tokens: int, max_tokens: int) -> Lane:
        if input_tokens <= self.short_max_input_tokens and max_tokens <= self.short_max_output_tokens:
            return "short"
        return "long"

    def max_hot(self, model: str, lane: Lane) -> int:
        for name, short, long in self.hot_overrides:
            if name == model:
                return short if lane == "short" else long
        return self.max_hot_short_actors if lane == "short" else self.max_hot_long_actors

    def num_warm(self, model: str, lane: Lane) -> int:
        for name, short, long in self.warm_overrides:
            if name == model:
                return short if lane == "short" else long
        return self.num_warm_short_actors if lane == "short" else self.num_warm_long_actors

    def busy_timeout_s(self, features: RequestFeatures, is_cold: bool) -> float:
        """How long a reservation may be held before the registry reclaims it (and kills the actor).

        A bound on a healthy request: every token, prompt and output, at
        `max_seconds_per_token`, plus the whole load for a cold actor, plus a margin. Only
        a crashed replica or a hung actor outlives it.
        """
        tokens = features.input_tokens + features.max_tokens
        return (self.max_load_s if is_cold else 0.0) + tokens * self.max_seconds_per_token + self.busy_margin_s


# ---------------------------------------------------------------- the decision


def decide(
    features: RequestFeatures, snapshot: ClusterSnapshot, policy: PolicyConfig, scorer: Scorer = RULE_SCORER
) -> Decision:
    """Dispatch to an idle hot actor, join a hot batch, spawn onto a free slot, or reject — see the module docstring.

    Raises ValueError for malformed features (non-positive token counts, negative bytes).
    """
    _check_features(features)
    lane = policy.lane(features.input_tokens, features.max_tokens)
    hot, hot_lanes = _hot_candidates(features, lane, snapshot, policy.max_candidates)
    joins, running_tpot = _join_candidates(features, lane, snapshot, policy)
    warm = warm_candidates(features, (lane,), snapshot, policy.max_candidates)
    cold = _cold_candidates(features, snapshot, policy)
    candidates = hot + joins + warm + cold
    model = features.model
    keep_new_hot = snapshot.hot_count(model, lane) < policy.max_hot(model, lane)

    best, predictions = None, []
    if candidates:
        predictions = predict(scorer, features, candidates)
        limits = [None] * len(hot) + running_tpot + [None] * (len(warm) + len(cold))
        num_resident = len(hot) + len(joins)  # candidates that start no process, now or to refill a pool
        best = None if keep_new_hot else _fastest(features, predictions[:num_resident], limits[:num_resident])
        if best is None:
            best = _fastest(features, predictions, limits)
    if best is None and lane == "long":
        # Better than a refusal: an idle short-lane actor (nothing waits on it), before a warm one, whose pool would
        # refill with a process start. Only where the long lane has nothing within the targets: a request with no
        # max_tokens is long, and a fresh actor for it on a CPU is predicted past a 1 s TTFT, so such requests to
        # an idle `make serve` were refused.
        idle, _ = _hot_candidates(features, "short", snapshot, policy.max_candidates, lanes=("short",))
        if idle:
            idle_predictions = predict(scorer, features, idle)
            i = _fastest(features, idle_predictions, [None] * len(idle))
            if i is not None:
                keep_hot = snapshot.hot_count(model, "short") <= policy.max_hot(model, "short")
                return Dispatch(idle[i].actor_name, idle[i].slot_id, lane, keep_hot, features.dispatch_bytes, idle[i],
                                idle_predictions[i])
    if best is None or candidates[best].kind == "cold":
        # Better than a process start or a refusal: the other lane's warm actors, then a warming one
        # (its process is starting already: further along than a fresh actor, if not yet warm).
        other_lanes = tuple(x for x in ("short", "long") if x != lane)
        for fallback in (warm_candidates(features, other_lanes, snapshot, policy.max_candidates),
                         warm_candidates(features, ("short", "long"), snapshot, policy.max_candidates, "warming")):
            if not fallback:
                continue
            fallback_predictions = predict(scorer, features, fallback)
            i = _fastest(features, fallback_predictions, [None] * len(fallback))
            if i is not None:
                bind_lane, keep_hot = lane, keep_new_hot
                actor_lane = next(a.lane for a in snapshot.actors if a.name == fallback[i].actor_name)
                if not keep_hot and actor_lane != lane and snapshot.hot_count(model, actor_lane) < policy.max_hot(
                        model, actor_lane):
                    # The request's lane keeps no more hot actors, the actor's does: it stays hot in its own lane
                    # (a long request on the short lane's warm actor), where it would have exited after this
                    # request and left the next one nothing but a process start.
                    bind_lane, keep_hot = actor_lane, True
                return Bind(fallback[i].actor_name, fallback[i].slot_id, bind_lane, keep_hot,
                            features.dispatch_bytes, fallback[i], fallback_predictions[i])
    if not candidates:
        return _evict_or_reject(features, snapshot, policy, keep_new_hot, scorer)
    if best is None:
        fastest = min(range(len(predictions)), key=lambda i: predictions[i].ttft_s)
        return Reject("latency_target", policy.retry_after_s,
                      f"no placement meets the latency targets (fastest predicted TTFT "
                      f"{predictions[fastest].ttft_s:.3f}s, a {candidates[fastest].kind} of "
                      f"{len(candidates)} candidates)")
    chosen, predicted = candidates[best], predictions[best]
    if best < len(hot):
        actor_lane = hot_lanes[best]
        # The idle actor is already counted among the hot ones: keep it unless over the limit.
        keep_hot = snapshot.hot_count(model, actor_lane) <= policy.max_hot(model, actor_lane)
        return Dispatch(chosen.actor_name, chosen.slot_id, lane, keep_hot, features.dispatch_bytes, chosen, predicted)
    if best < len(hot) + len(joins):
        return Join(chosen.actor_name, chosen.slot_id, lane, features.dispatch_bytes, chosen, predicted)
    if chosen.kind == "warm":
        return Bind(chosen.actor_name, chosen.slot_id, lane, keep_new_hot, features.dispatch_bytes, chosen, predicted)
    return Spawn(chosen.slot_id, lane, keep_new_hot, features.spawn_bytes, features.resident_bytes, chosen, predicted,
                 node_id=snapshot.slot(chosen.slot_id).node_id)


def _hot_lanes(lane: Lane) -> tuple[Lane, ...]:
    return ("short", "long") if lane == "short" else ("long",)


def candidate(kind: str, snapshot: ClusterSnapshot, slot, actor: ActorView | None,
              num_prompt_tokens: int = 0) -> Candidate:
    """The scorer's view of placing a request of `num_prompt_tokens` on `actor` (None: a fresh one) on `slot`."""
    return Candidate(kind, slot.slot_id, actor.name if actor else None, slot.free_bytes, slot.num_actors,
                     slot.fragmentation, slot.utilization, snapshot.num_computing_on_node(slot.node_id),
                     actor.num_rows if actor else 0, actor.batch_tokens if actor else 0,
                     actor.resident_fraction if actor else 0.0,
                     actor.min_tpot_target_s if actor is not None and kind == "join" else None,
                     actor.prompt_tokens_ahead(num_prompt_tokens) if actor is not None and kind == "join" else 0,
                     actor.step_correction if actor is not None and kind in ("hot", "join") else 1.0,
                     actor.prompt_tokens_in_step if actor is not None and kind == "join" else 0)


def _hot_candidates(
    features: RequestFeatures, lane: Lane, snapshot: ClusterSnapshot, limit: int,
    lanes: tuple[Lane, ...] | None = None,
) -> tuple[list[Candidate], list[Lane]]:
    """Idle actors of the model whose slot has room for the request, and each one's lane (of `lanes`: by default
    the ones a request of `lane` takes)."""
    need = features.dispatch_bytes
    candidates: list[Candidate] = []
    actor_lanes: list[Lane] = []
    for actor_lane in lanes or _hot_lanes(lane):
        for actor in snapshot.idle_actors(features.model, actor_lane):
            slot = snapshot.slot(actor.slot_id)
            if slot is None or slot.free_bytes < need:
                continue
            candidates.append(candidate("hot", snapshot, slot, actor))
            actor_lanes.append(actor_lane)
            if len(candidates) == limit:
                return candidates, actor_lanes
    return candidates, actor_lanes


def _join_candidates(features: RequestFeatures, lane: Lane, snapshot: ClusterSnapshot,
                     policy: PolicyConfig) -> tuple[list[Candidate], list[float | None]]:
    """Busy hot batches of the model and lane with a free row and room, and each one's tightest TPOT target."""
    if policy.max_batch < 2:
        return [], []
    need = features.dispatch_bytes
    feasible = []
    for i, actor in enumerate(snapshot.busy_hot_actors(features.model, lane)):
        slot = snapshot.slot(actor.slot_id)
        if actor.num_rows < policy.max_batch and slot is not None and slot.free_bytes >= need:
            feasible.append((actor.num_rows, actor.batch_tokens, i, actor, slot))
    # The least loaded batches, not the first ones: taking the first `max_candidates` in
    # spawn order would fill the oldest actors' batches while later ones ran a row each.
    chosen = heapq.nsmallest(policy.max_candidates, feasible, key=lambda t: t[:3])
    return ([candidate("join", snapshot, slot, actor, features.input_tokens) for *_, actor, slot in chosen],
            [actor.min_tpot_target_s for *_, actor, _ in chosen])


def warm_candidates(features: RequestFeatures, lanes: Sequence[Lane], snapshot: ClusterSnapshot,
                     limit: int, state: str = "warm") -> list[Candidate]:
    """Warm (or warming) actors of the model filled for `lanes`, whose slot has room for the request.

    A warming actor's process is still starting: its candidate is scored as a cold one. Not less the
    start it has behind it: on a busy node (a fresh deployment's own start) a process start takes
    several times the idle machine's, and crediting the time elapsed admitted a newcomer's first
    request into 5 s of waiting.
    """
    need = features.dispatch_bytes
    kind = "warm" if state == "warm" else "cold"
    out: list[Candidate] = []
    for lane in lanes:
        for actor in snapshot.warm_actors(features.model, lane, state):
            if not actor.is_created:  # its filler has not made the process yet: nothing to send a request to
                continue
            slot = snapshot.slot(actor.slot_id)
            if slot is not None and slot.free_bytes >= need:
                out.append(candidate(kind, snapshot, slot, actor))
                if len(out) == limit:
                    return out
    return out


def _cold_candidates(features: RequestFeatures, snapshot: ClusterSnapshot, policy: PolicyConfig) -> list[Candidate]:
    """First fit: slots in snapshot order with room for a fresh actor, up to max_candidates."""
    need, max_actors, limit = features.spawn_bytes, policy.max_actors_per_slot, policy.max_candidates
    out: list[Candidate] = []
    for slot in snapshot.slots:
        if slot.total_bytes - slot.reserved_bytes >= need and slot.num_actors < max_actors:
            out.append(candidate("cold", snapshot, slot, None))
            if len(out) == limit:
                break
    return out


def _evict_or_reject(features: RequestFeatures, snapshot: ClusterSnapshot, policy: PolicyConfig,
                     keep_hot: bool, scorer: Scorer) -> Spawn | Reject:
    """A fresh actor on a slot freed by retiring its idle hot or warm actors, else the refusal."""
    need, best, best_key = features.spawn_bytes, None, None
    for slot in snapshot.slots if policy.is_eviction_enabled else ():
        actors = snapshot.actors_on_slot(slot.slot_id)
        if not actors or any(a.state not in ("idle", "warm", "warming") for a in actors):
            continue  # nothing to retire, or something running there
        if any(a.state != "idle" and a.model == features.model for a in actors):
            continue  # its own model's warm actor is further along than a fresh one would be
        freed = sum(a.reserved_bytes for a in actors)
        if slot.free_bytes + freed < need or slot.num_actors - len(actors) >= policy.max_actors_per_slot:
            continue
        key = (sum(a.state == "idle" for a in actors), len(actors))
        if best_key is None or key < best_key:
            best, best_key = (slot, actors), key
    if best is None:
        return _no_candidate(features, snapshot, policy)
    slot, actors = best
    fresh = candidate("cold", snapshot, slot, None)
    prediction = predict(scorer, features, [fresh])[0]
    if not meets_targets(features, prediction, None):
        # Retiring idle actors for a process start predicted past the request's targets would admit it into
        # seconds of waiting (long prompts on a busy 2-core host: predicted 2.4-2.9 s against a 1 s target, taken,
        # measured 10-18 s) and leave the next request fewer actors.
        return Reject("latency_target", policy.retry_after_s,
                      f"no placement meets the latency targets (fastest predicted TTFT {prediction.ttft_s:.3f}s, a "
                      f"cold start in place of {len(actors)} idle actor{'s' if len(actors) > 1 else ''})")
    return Spawn(slot.slot_id, policy.lane(features.input_tokens, features.max_tokens), keep_hot,
                 features.spawn_bytes, features.resident_bytes, fresh, prediction,
                 evict=tuple(a.name for a in actors), node_id=slot.node_id)


def _no_candidate(features: RequestFeatures, snapshot: ClusterSnapshot, policy: PolicyConfig) -> Reject:
    need = features.spawn_bytes
    if need > snapshot.max_total_bytes and snapshot.slots:
        return Reject("too_large", None,
                      f"{features.model}: this request needs {need} bytes (weights, KV cache for "
                      f"{features.input_tokens} + {features.max_tokens} tokens, workspace) and the largest "
                      f"slot holds {snapshot.max_total_bytes}; shorten the prompt or max_tokens")
    # A fresh deployment's first seconds: its warm actor holds the slot and is not yet up to take a request.
    is_starting = any(a.model == features.model and a.state == "warming" for a in snapshot.actors)
    return Reject("no_capacity", policy.retry_after_s,
                  f"{features.model}: {'its actor is still starting; ' if is_starting else ''}no idle actor, "
                  f"batch row or free slot can take {need} bytes now")


def predict(scorer: Scorer, features: RequestFeatures, candidates: list[Candidate]) -> Sequence[Prediction]:
    """The scorer's predictions if every one is well-formed, else the rule's."""
    if scorer is RULE_SCORER:
        return RULE_SCORER.predict(features, candidates)
    try:
        predictions = list(scorer.predict(features, candidates))
    except Exception:
        log.exception("scorer %s failed; using the rule scorer for this decision", type(scorer).__name__)
        return RULE_SCORER.predict(features, candidates)
    if len(predictions) != len(candidates) or not all(_is_well_formed(p) for p in predictions):
        log.warning("scorer %s returned malformed predictions for %d candidates; using the rule scorer",
                    type(scorer).__name__, len(candidates))
        return RULE_SCORER.predict(features, candidates)
    return predictions


def _is_well_formed(p: Any) -> bool:
    try:
        ttft, total, tpot = float(p.ttft_s), float(p.total_s), float(p.tpot_s)
    except (AttributeError, TypeError, ValueError):
        return False
    return all(math.isfinite(x) for x in (ttft, total, tpot)) and 0.0 <= ttft <= total and tpot >= 0.0


def meets_targets(features: RequestFeatures, p: Prediction, running_tpot_limit: float | None) -> bool:
    """The prediction keeps the request within its own targets, and a batch it joins within its tightest TPOT.
    TTFT: its upper bound (`Prediction.ttft_bound_s`), where measurements gave one: a target is a tail's."""
    return ((features.ttft_target_s is None or p.ttft_bound_s <= features.ttft_target_s)
            and (features.total_target_s is None or p.total_s <= features.total_target_s)
            and (features.tpot_target_s is None or p.tpot_s <= features.tpot_target_s)
            # joining would slow a running row past its own target
            and (running_tpot_limit is None or p.tpot_s <= running_tpot_limit))


def _fastest(features: RequestFeatures, predictions: Sequence[Prediction],
             running_tpot_limits: Sequence[float | None]) -> int | None:
    """Index of the lowest (ttft, total) that meets the targets, its own and its batch's; on ties the one with
    the most TPOT slack (the batch whose rows, this one included, are furthest within their targets), then
    the first."""
    best, best_key = None, None
    for i, (p, limit) in enumerate(zip(predictions, running_tpot_limits, strict=True)):
        if not meets_targets(features, p, limit):
            continue
        targets = [t for t in (features.tpot_target_s, limit) if t is not None]
        slack = min(targets) - p.tpot_s if targets else math.inf
        key = (p.ttft_s, p.total_s, -slack)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def _check_features(f: RequestFeatures) -> None:
    if f.input_tokens < 1 or f.max_tokens < 1:
        raise ValueError(f"input_tokens and max_tokens must be >= 1, got {f.input_tokens} and {f.max_tokens}")
    if min(f.weight_bytes, f.kv_bytes_per_token, f.workspace_bytes, f.actor_overhead_bytes) < 0:
        raise ValueError(f"{f.model}: byte counts must be >= 0, got {f}")
