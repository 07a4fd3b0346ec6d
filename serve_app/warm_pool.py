"""The warm pool's plan: which warm actors to start, and on which slots (pure: no Ray).

A warm actor is started ahead of any request (actors/request_actor.py, `warm_layers`): its
process is up, its model allocated, its tokenizer built and its embeddings and first N
layers resident, so a request bound to it (policy.Bind) skips the process start. Each
model keeps `policy.num_warm(model, lane)` of them per lane, warming ones included.

Placement is first fit over the slots with room for the actor's resident bytes (weights
+ per-process overhead: reserved exactly as any actor's) and fewer than
`max_actors_per_slot` actors — the same room a fresh actor needs, so a refill takes a
slot only where a spawn could have gone, and eviction (policy.py) gives it back to a
request that needs it. A refill waits while a request's actor on the same node is still
"starting" (loading its weights, before its first token): a process start and a load
take the node's host CPU, which that request's load and prefill need now; the pool is
for the next request, not worth this one's first token. For the same reason a refill waits
while its node's cores are all computing (`WarmSpec.node_cpus`, the rule's: as many actors
starting, warming or running a request as cores, this plan's own fills counted): a start beside them would take its CPU from their steps, stretching every
running row's tokens and every joiner's prompt, for a request that may never come. It fills
once a core is free again (the fillers retry every `warm_refresh_s`).

Idleness. A model's warm actors exist to catch its next request: once the model has had
no request for `policy.max_idle_s`, its warm actors retire and the pool is not refilled
until a request comes (`is_model_active`); the registry starts that clock when the pool
is first asked for, so a fresh deployment fills its pools at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from serve_app.policy import PolicyConfig
from serve_app.snapshot import ClusterSnapshot, Lane, SlotView

LANES: tuple[Lane, ...] = ("short", "long")


@dataclass(frozen=True)
class WarmSpec:
    """What a warm actor of one model holds while it waits."""

    model: str
    resident_bytes: int  # weights + per-process overhead
    # The cores of a node (rule_scorer.node_cpus): no refill where that many actors compute or start; 0: no limit.
    node_cpus: int = 0

    def __post_init__(self) -> None:
        if self.resident_bytes < 0:
            raise ValueError(f"{self.model}: resident_bytes must be >= 0, got {self.resident_bytes}")
        if self.node_cpus < 0:
            raise ValueError(f"{self.model}: node_cpus must be >= 0, got {self.node_cpus}")


@dataclass(frozen=True)
class WarmFill:
    """One warm actor to start: committed in the registry before it is created."""

    model: str
    lane: Lane
    slot_id: str
    resident_bytes: int
    node_id: str = field(default="", compare=False)  # where the actor is pinned


def warm_specs(models: Iterable[Any], policy: PolicyConfig, node_cpus: int) -> list[WarmSpec]:
    """Each served model's warm actor (`models`: LoadedModels, not imported here: loaded_model.py imports the
    config, which imports the registry and so this module): its weights and the process's overhead, on nodes of
    `node_cpus` cores."""
    return [WarmSpec(m.id, m.numbers.weight_bytes + policy.actor_overhead_bytes, node_cpus) for m in models]


def pool_size(policy: PolicyConfig, model: str) -> int:
    """The warm actors the policy keeps for `model`, over every lane."""
    return sum(policy.num_warm(model, lane) for lane in LANES)


def models_without_a_ready_actor(snapshot: ClusterSnapshot, models: Iterable[str],
                                 policy: PolicyConfig) -> set[str]:
    """The models among `models` that keep a warm pool but have no actor to take a request now: none warm (its
    process up, its layers in) and none hot (idle or batching). A model with no pool is never waited for: each
    of its requests is a fresh spawn anyway."""
    return {m for m in models if pool_size(policy, m) > 0 and not any(
        snapshot.warm_actors(m, lane) or snapshot.idle_actors(m, lane) or snapshot.busy_hot_actors(m, lane)
        for lane in LANES)}


def is_model_active(last_request_at: float, now: float, policy: PolicyConfig) -> bool:
    return policy.max_idle_s is None or now - last_request_at <= policy.max_idle_s


def plan_fills(snapshot: ClusterSnapshot, specs: Sequence[WarmSpec], policy: PolicyConfig,
               active_models: set[str]) -> list[WarmFill]:
    """The warm actors missing from each active model's pool, each on the first slot that fits."""
    added_bytes: dict[str, int] = {}
    added_actors: dict[str, int] = {}  # by slot
    added_on_node: dict[str, int] = {}  # the fills this plan starts, by node: they compute too
    computing: dict[str, int] = {}  # node -> actors computing there, counted once per plan
    fills: list[WarmFill] = []
    for spec in specs:
        if spec.model not in active_models:
            continue
        for lane in LANES:
            missing = policy.num_warm(spec.model, lane) - snapshot.warm_count(spec.model, lane)
            for _ in range(max(0, missing)):
                slot = _first_fit(snapshot, spec, policy.max_actors_per_slot, added_bytes, added_actors, added_on_node,
                                  computing)
                if slot is None:
                    break
                added_bytes[slot.slot_id] = added_bytes.get(slot.slot_id, 0) + spec.resident_bytes
                added_actors[slot.slot_id] = added_actors.get(slot.slot_id, 0) + 1
                added_on_node[slot.node_id] = added_on_node.get(slot.node_id, 0) + 1
                fills.append(WarmFill(spec.model, lane, slot.slot_id, spec.resident_bytes, slot.node_id))
    return fills


def _first_fit(snapshot: ClusterSnapshot, spec: WarmSpec, max_actors: int, added_bytes: dict[str, int],
               added_actors: dict[str, int], added_on_node: dict[str, int],
               computing: dict[str, int]) -> SlotView | None:
    for slot in snapshot.slots:
        if snapshot.num_starting_on_node(slot.node_id):
            continue
        if slot.node_id not in computing:
            computing[slot.node_id] = snapshot.num_computing_on_node(slot.node_id)
        if spec.node_cpus and computing[slot.node_id] + added_on_node.get(slot.node_id, 0) >= spec.node_cpus:
            continue  # every core computes: a start now would slow them all (module docstring)
        free = slot.free_bytes - added_bytes.get(slot.slot_id, 0)
        if free >= spec.resident_bytes and slot.num_actors + added_actors.get(slot.slot_id, 0) < max_actors:
            return slot
    return None
