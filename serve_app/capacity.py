"""Elastic capacity: how many slots the demand needs, and when a slot asked for will be ready (pure: no Ray).

A zero-queue deployment has no queue length to scale on; its demand signal is the refused
traffic itself. By Little's law, requests refused for want of capacity at `refused_per_s`,
each of which would have held its row for `hold_s`, are `refused_per_s × hold_s` rows of
concurrency missing; at the rows one actor of that model and lane has been seen to run at
once, that is a number of slots. So, per model and lane:

    slots needed = peak busy slots + ceil(missing rows / rows per slot) + its warm pool's slots

summed over lanes, kept within [min_slots, max_slots]. The plan rises at once (a request
refused now is refused until a node is up) and falls only after the need has stayed below the
slots wanted for `scale_down_delay_s`, and then only to the highest need seen meanwhile: a
lull between bursts does not give a node back that the next burst needs again.

The registry actor runs `plan_slots` every `interval_s` and states the plan to Ray's autoscaler
(`ray.autoscaler.sdk.request_resources`, one bundle per slot, registry_actor.py). Nothing
waits for it: a request that found no place is refused at once, with a retry-after of
`ready_in_s` when a slot is on its way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CapacityConfig:
    # Off: capacity is what the cluster has at deploy time (and whatever nodes join by themselves).
    is_enabled: bool = False
    min_slots: int = 0
    max_slots: int = 0
    interval_s: float = 2.0  # how often the planner runs (at most once a reconcile pass: RegistryConfig)
    # Refusals and admissions are counted over this window; the rates the plan uses are per second of it.
    demand_window_s: float = 20.0
    # The plan falls only after the need has stayed below it this long (hysteresis).
    scale_down_delay_s: float = 60.0
    # From the request to Ray until a new node's slots are in the registry: the provider's node start
    # (measured: a few seconds for Ray's fake local provider, minutes for a cloud GPU node).
    node_start_s: float = 120.0
    # Rows a slot is assumed to take for a model and lane that has not run an actor yet.
    assumed_rows_per_slot: int = 1
    # One slot's bundle for the autoscaler, set by the app builder from the slots' kind ({"GPU": 1} for GPU
    # slots; the slot resource for `resource` slots).
    slot_bundle: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.min_slots < 0 or self.max_slots < self.min_slots:
            raise ValueError(f"capacity needs 0 <= min_slots <= max_slots, got {self.min_slots}, {self.max_slots}")
        if self.is_enabled and self.max_slots < 1:
            raise ValueError("capacity.is_enabled needs max_slots >= 1")
        if min(self.interval_s, self.demand_window_s, self.node_start_s) <= 0:
            raise ValueError("capacity's interval_s, demand_window_s and node_start_s must be > 0")
        if self.scale_down_delay_s < 0 or self.assumed_rows_per_slot < 1:
            raise ValueError("capacity needs scale_down_delay_s >= 0 and assumed_rows_per_slot >= 1")


@dataclass(frozen=True)
class LaneDemand:
    """One model and lane's demand over the window, as the registry sees it."""

    model: str
    lane: str
    num_busy_slots: int  # the most slots its actors held with rows running (or starting) within the window
    max_rows_per_actor: int  # the most rows one of its actors ran at once within the window (0: none ran)
    refused_per_s: float  # refusals for want of capacity, per second of the window
    hold_s: float  # how long a refused request would have held its row, predicted (mean over the window)
    num_warm_slots: int = 0  # slots its warm pool's actors need while the model has demand


@dataclass(frozen=True)
class CapacityPlan:
    num_wanted: int  # the slots stated to the autoscaler
    num_needed: int  # what the demand needs now, within the bounds (the plan follows it with hysteresis)
    # While the need is below the plan: since when, and the highest need seen since (what the plan falls to).
    lower_since: float | None = None
    peak_need: int = 0


def bundles(num_slots: int, config: CapacityConfig) -> tuple[dict[str, float], ...]:
    """What `request_resources` is given for `num_slots`: one bundle per slot (its total, not an increment)."""
    return tuple(dict(config.slot_bundle) for _ in range(num_slots))


def slots_needed(demand: LaneDemand, config: CapacityConfig) -> int:
    """Busy slots, plus the refused concurrency in slots at the density the lane has shown, plus its warm pool."""
    missing_rows = demand.refused_per_s * demand.hold_s
    rows_per_slot = demand.max_rows_per_actor or config.assumed_rows_per_slot
    # A rate times a mean is fuzzy: a hair over a whole number of slots is that number (1e-9 of a slot).
    missing_slots = math.ceil(missing_rows / rows_per_slot - 1e-9) if missing_rows > 0 else 0
    return demand.num_busy_slots + missing_slots + demand.num_warm_slots


def plan_slots(demands: list[LaneDemand], previous: CapacityPlan | None, now: float,
               config: CapacityConfig) -> CapacityPlan:
    """The slots to ask for now (see the module doc): up at once, down after `scale_down_delay_s`."""
    need = min(config.max_slots, max(config.min_slots, sum(slots_needed(d, config) for d in demands)))
    wanted = previous.num_wanted if previous is not None else config.min_slots
    if need >= wanted:
        return CapacityPlan(need, need)
    is_lowering = previous is not None and previous.lower_since is not None
    since = previous.lower_since if is_lowering else now
    # The highest need since the fall began: never above the plan itself (a fall never raises it).
    peak = min(wanted, max(previous.peak_need, need)) if is_lowering else need
    if now - since >= config.scale_down_delay_s:
        # Down to the highest need of the delay; if the need is lower still, its own delay starts now.
        return CapacityPlan(peak, need, now if need < peak else None, need)
    return CapacityPlan(wanted, need, since, peak)


def ready_in_s(short_since: float | None, now: float, config: CapacityConfig, actor_start_s: float) -> float | None:
    """Seconds until the first slot asked for at `short_since` can serve: the node's start left, then an
    actor's start on it. None when no slot is on its way. A node later than predicted counts as due now."""
    if short_since is None:
        return None
    return max(0.0, short_since + config.node_start_s - now) + actor_start_s


def nodes_pending(num_wanted: int, num_present: int, slots_per_node: int) -> int:
    """Nodes still to come for the plan, at the most slots one node has shown (1 before any did)."""
    return math.ceil(max(0, num_wanted - num_present) / max(1, slots_per_node))
