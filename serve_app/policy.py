"""The zero-queue decision: run a request now on an idle hot actor or a fresh one, or refuse it now.

`decide(features, snapshot, policy, scorer) -> Dispatch | Spawn | Reject` is a pure
function of its arguments (stdlib only: no Ray, no torch), so the ingress, the
registry and the simulator all call the same code.

1. Lane. A request is *short* when input_tokens <= short_max_input_tokens and
   max_tokens <= short_max_output_tokens, else *long*. Short requests use hot actors
   kept for them; long requests get dedicated actors (by default not kept hot), so a
   long generation never holds a short request back.
2. Feasible candidates, in a stable order:
   - hot: idle actors of the model whose slot has `dispatch_bytes` free (the weights are
     already resident; the request adds its KV cache and workspace). A short request
     takes a short-lane actor first, then an idle long-lane one (it is idle, so nothing
     waits on it, and it skips a cold start). A long request never takes a short-lane
     actor: that is the isolation the short lane exists for.
   - cold: the first `max_candidates` slots, in snapshot order, with `spawn_bytes` free
     and fewer than `max_actors_per_slot` actors.
3. The scorer predicts TTFT and total time per candidate; the fastest (TTFT, then total,
   then candidate order) that meets the request's latency targets wins, and the decision
   carries the chosen candidate and its prediction (for traces; not compared). Predictions
   that are malformed (wrong count, NaN, negative, ttft > total) or a scorer that raises
   fall back to the rule scorer for this decision: a scorer only ranks what is feasible.
4. No candidate: `too_large` when `spawn_bytes` exceeds every slot's total (it can never
   fit: the ingress answers 400 invalid_request_error), else `no_capacity` (503
   overloaded_error with retry-after).

Memory (design invariant 3). A fresh actor needs

    spawn_bytes    = weight_bytes + actor_overhead_bytes           (resident while it lives)
                   + kv_bytes_per_token * (input_tokens + max_tokens) + workspace_bytes
    dispatch_bytes = the second line alone                         (held while a request runs)

`actor_overhead_bytes` (CUDA context, cuBLAS workspace, allocator slack) is per process,
so a hot actor already holds it; `workspace_bytes` is the request's prefill activations,
derived in `serve_app.memory.workspace_bytes()` from the model's sizes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, Literal

from serve_app.scorer import RULE_SCORER, Candidate, Prediction, Scorer

log = logging.getLogger(__name__)

Lane = Literal["short", "long"]
ActorState = Literal["starting", "busy", "idle"]
RejectReason = Literal["no_capacity", "too_large", "latency_target"]
LANES: tuple[Lane, ...] = ("short", "long")
ACTOR_STATES: tuple[ActorState, ...] = ("starting", "busy", "idle")
MiB = 1 << 20


@dataclass(frozen=True)
class PolicyConfig:
    short_max_input_tokens: int = 2048
    short_max_output_tokens: int = 512
    # Actors kept hot per model and lane: idle, or serving a request they will stay after.
    max_hot_short_actors: int = 1
    max_hot_long_actors: int = 0  # 0: long requests get dedicated actors that exit
    # Per-model exceptions: (model, max_hot_short_actors, max_hot_long_actors).
    hot_overrides: tuple[tuple[str, int, int], ...] = ()
    # A CUDA context with cuBLAS handles takes a few hundred MB per process; measure and set.
    actor_overhead_bytes: int = 512 * MiB
    max_actors_per_slot: int = 1  # 1 for num_gpus=1 actors
    max_candidates: int = 8  # per kind (hot, cold) handed to the scorer
    retry_after_s: float = 1.0
    # Bounds (not estimates) that set a reservation's expiry; see `busy_timeout_s`.
    max_load_s: float = 300.0
    max_seconds_per_token: float = 0.5
    busy_margin_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("short_max_input_tokens", "short_max_output_tokens", "max_actors_per_slot", "max_candidates"):
            if getattr(self, name) < 1:
                raise ValueError(f"PolicyConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_hot_short_actors", "max_hot_long_actors", "actor_overhead_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"PolicyConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("retry_after_s", "max_load_s", "max_seconds_per_token", "busy_margin_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PolicyConfig.{name} must be > 0, got {getattr(self, name)}")
        for model, short, long in self.hot_overrides:
            if short < 0 or long < 0:
                raise ValueError(f"PolicyConfig.hot_overrides for {model!r} must be >= 0, got ({short}, {long})")

    def lane(self, input_tokens: int, max_tokens: int) -> Lane:
        if input_tokens <= self.short_max_input_tokens and max_tokens <= self.short_max_output_tokens:
            return "short"
        return "long"

    def max_hot(self, model: str, lane: Lane) -> int:
        for name, short, long in self.hot_overrides:
            if name == model:
                return short if lane == "short" else long
        return self.max_hot_short_actors if lane == "short" else self.max_hot_long_actors

    def busy_timeout_s(self, features: RequestFeatures, is_cold: bool) -> float:
        """How long a reservation may be held before the registry reclaims it (and kills the actor).

        A bound on a healthy request: every token, prompt and output, at
        `max_seconds_per_token`, plus the whole load for a cold actor, plus a margin. Only
        a crashed replica or a hung actor outlives it.
        """
        tokens = features.input_tokens + features.max_tokens
        return (self.max_load_s if is_cold else 0.0) + tokens * self.max_seconds_per_token + self.busy_margin_s


# ---------------------------------------------------------------- messages


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
    # Sampling settings: features for the scorer only (top_k/top_p cost a sort per token).
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * (self.input_tokens + self.max_tokens)

    @property
    def dispatch_bytes(self) -> int:
        """Held on a hot actor's slot while the request runs: the weights are already there."""
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
class ActorView:
    name: str
    model: str
    slot_id: str
    state: ActorState
    lane: Lane
    is_hot: bool  # stays (idle) after its current request, or is idle now
    reserved_bytes: int


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
        return self._idle.get((model, lane), [])

    def hot_count(self, model: str, lane: Lane) -> int:
        return self._hot_counts.get((model, lane), 0)

    def num_busy_on_node(self, node_id: str) -> int:
        """Actors starting or busy on a node: they share its host (and, on CPU slots, its cores)."""
        return self._busy_by_node.get(node_id, 0)

    @cached_property
    def max_total_bytes(self) -> int:
        return max((s.total_bytes for s in self.slots), default=0)

    @cached_property
    def _slots_by_id(self) -> dict[str, SlotView]:
        return {s.slot_id: s for s in self.slots}

    @cached_property
    def _idle(self) -> dict[tuple[str, Lane], list[ActorView]]:
        idle: dict[tuple[str, Lane], list[ActorView]] = {}
        for a in self.actors:
            if a.state == "idle":
                idle.setdefault((a.model, a.lane), []).append(a)
        return idle

    @cached_property
    def _hot_counts(self) -> dict[tuple[str, Lane], int]:
        counts: dict[tuple[str, Lane], int] = {}
        for a in self.actors:
            if a.is_hot:
                counts[(a.model, a.lane)] = counts.get((a.model, a.lane), 0) + 1
        return counts

    @cached_property
    def _busy_by_node(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for a in self.actors:
            slot = self._slots_by_id.get(a.slot_id) if a.state != "idle" else None
            if slot is not None:
                counts[slot.node_id] = counts.get(slot.node_id, 0) + 1
        return counts

    def __getstate__(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


@dataclass(frozen=True)
class Dispatch:
    actor_name: str
    slot_id: str
    lane: Lane  # the request's lane; the actor keeps its own
    keep_hot: bool  # the actor stays idle after this request
    reserve_bytes: int  # added to the slot while the request runs (= dispatch_bytes)
    candidate: Candidate | None = field(default=None, compare=False)
    prediction: Prediction | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Spawn:
    slot_id: str
    lane: Lane
    keep_hot: bool
    reserve_bytes: int  # reserved on the slot from now on (= spawn_bytes)
    resident_bytes: int  # the part that stays reserved while the actor idles hot
    candidate: Candidate | None = field(default=None, compare=False)
    prediction: Prediction | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.resident_bytes <= self.reserve_bytes:
            raise ValueError(f"Spawn needs 0 <= resident_bytes <= reserve_bytes, got "
                             f"{self.resident_bytes} and {self.reserve_bytes}")


@dataclass(frozen=True)
class Reject:
    reason: RejectReason
    retry_after_s: float | None  # None when retrying cannot help (too_large)
    message: str

    @property
    def http_status(self) -> int:
        """400 invalid_request_error for too_large; 503 overloaded_error otherwise."""
        return 400 if self.reason == "too_large" else 503


Decision = Dispatch | Spawn | Reject


# ---------------------------------------------------------------- the decision


def decide(
    features: RequestFeatures, snapshot: ClusterSnapshot, policy: PolicyConfig, scorer: Scorer = RULE_SCORER
) -> Decision:
    """Dispatch to an idle hot actor, spawn onto a free slot, or reject — see the module docstring.

    Raises ValueError for malformed features (non-positive token counts, negative bytes).
    """
    _check_features(features)
    lane = policy.lane(features.input_tokens, features.max_tokens)
    hot, hot_lanes = _hot_candidates(features, lane, snapshot, policy.max_candidates)
    cold = _cold_candidates(features, snapshot, policy)
    candidates = hot + cold
    if not candidates:
        return _no_candidate(features, snapshot, policy)

    predictions = _predict(scorer, features, candidates)
    best = _fastest(features, predictions)
    if best is None:
        fastest = min(p.ttft_s for p in predictions)
        return Reject("latency_target", policy.retry_after_s,
                      f"no placement meets the latency target (fastest predicted TTFT {fastest:.3f}s)")
    chosen, predicted, model = candidates[best], predictions[best], features.model
    if best < len(hot):
        actor_lane = hot_lanes[best]
        # The idle actor is already counted among the hot ones: keep it unless over the limit.
        keep_hot = snapshot.hot_count(model, actor_lane) <= policy.max_hot(model, actor_lane)
        return Dispatch(chosen.actor_name, chosen.slot_id, lane, keep_hot, features.dispatch_bytes, chosen, predicted)
    keep_hot = snapshot.hot_count(model, lane) < policy.max_hot(model, lane)
    return Spawn(chosen.slot_id, lane, keep_hot, features.spawn_bytes, features.resident_bytes, chosen, predicted)


def _hot_lanes(lane: Lane) -> tuple[Lane, ...]:
    return ("short", "long") if lane == "short" else ("long",)


def _hot_candidates(
    features: RequestFeatures, lane: Lane, snapshot: ClusterSnapshot, limit: int
) -> tuple[list[Candidate], list[Lane]]:
    """Idle actors of the model whose slot has room for the request, and each one's lane."""
    need = features.dispatch_bytes
    candidates: list[Candidate] = []
    lanes: list[Lane] = []
    for actor_lane in _hot_lanes(lane):
        for actor in snapshot.idle_actors(features.model, actor_lane):
            slot = snapshot.slot(actor.slot_id)
            if slot is None or slot.free_bytes < need:
                continue
            candidates.append(Candidate("hot", slot.slot_id, actor.name, slot.free_bytes, slot.num_actors,
                                        slot.fragmentation, slot.utilization,
                                        snapshot.num_busy_on_node(slot.node_id)))
            lanes.append(actor_lane)
            if len(candidates) == limit:
                return candidates, lanes
    return candidates, lanes


def _cold_candidates(features: RequestFeatures, snapshot: ClusterSnapshot, policy: PolicyConfig) -> list[Candidate]:
    """First fit: slots in snapshot order with room for a fresh actor, up to max_candidates."""
    need, max_actors, limit = features.spawn_bytes, policy.max_actors_per_slot, policy.max_candidates
    out: list[Candidate] = []
    for slot in snapshot.slots:
        if slot.total_bytes - slot.reserved_bytes >= need and slot.num_actors < max_actors:
            out.append(Candidate("cold", slot.slot_id, None, slot.free_bytes, slot.num_actors,
                                 slot.fragmentation, slot.utilization, snapshot.num_busy_on_node(slot.node_id)))
            if len(out) == limit:
                break
    return out


def _no_candidate(features: RequestFeatures, snapshot: ClusterSnapshot, policy: PolicyConfig) -> Reject:
    need = features.spawn_bytes
    if need > snapshot.max_total_bytes and snapshot.slots:
        return Reject("too_large", None,
                      f"{features.model}: this request needs {need} bytes (weights, KV cache for "
                      f"{features.input_tokens} + {features.max_tokens} tokens, workspace) and the largest "
                      f"slot holds {snapshot.max_total_bytes}; shorten the prompt or max_tokens")
    return Reject("no_capacity", policy.retry_after_s,
                  f"{features.model}: no idle actor or free slot can take {need} bytes now")


def _predict(scorer: Scorer, features: RequestFeatures, candidates: list[Candidate]) -> Sequence[Prediction]:
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
        ttft, total = float(p.ttft_s), float(p.total_s)
    except (AttributeError, TypeError, ValueError):
        return False
    return math.isfinite(ttft) and math.isfinite(total) and 0.0 <= ttft <= total


def _fastest(features: RequestFeatures, predictions: Sequence[Prediction]) -> int | None:
    """Index of the lowest (ttft, total) that meets the targets; the first on ties."""
    best, best_key = None, None
    for i, p in enumerate(predictions):
        if features.ttft_target_s is not None and p.ttft_s > features.ttft_target_s:
            continue
        if features.total_target_s is not None and p.total_s > features.total_target_s:
            continue
        key = (p.ttft_s, p.total_s)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def _check_features(f: RequestFeatures) -> None:
    if f.input_tokens < 1 or f.max_tokens < 1:
        raise ValueError(f"input_tokens and max_tokens must be >= 1, got {f.input_tokens} and {f.max_tokens}")
    if min(f.weight_bytes, f.kv_bytes_per_token, f.workspace_bytes, f.actor_overhead_bytes) < 0:
        raise ValueError(f"{f.model}: byte counts must be >= 0, got {f}")
