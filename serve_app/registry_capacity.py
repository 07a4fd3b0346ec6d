"""The registry's side of elastic capacity: demand in, the plan out (pure: no Ray).

A collaborator of `RegistryState` (registry.py) on the same books and under the same lock,
like the warm pools and the leases. The replicas' demand counts arrive with their lease
exchanges (`record`); every `interval_s` the registry actor calls `step`, which reads the books
(busy slots, rows per actor, slots present), plans with `plan_slots` (capacity.py) and keeps the
moment the plan first exceeded the slots present (`short_since`): what a refusal's retry-after
counts a new node's start from. The actor then states the plan to Ray's autoscaler.
"""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.capacity import CapacityConfig, CapacityPlan, nodes_pending, plan_slots, ready_in_s
from serve_app.demand import DemandMeter, LaneCount, warm_slots_needed
from serve_app.registry_books import Books
from serve_app.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class CapacityStatus:
    """What the gauges and /health show, and what tests read of the plan."""

    is_enabled: bool
    num_wanted: int
    num_needed: int
    num_present: int  # slots in the registry now that can take requests (a draining node's cannot)
    num_nodes: int  # nodes those slots are on
    num_nodes_pending: int
    short_since: float | None  # epoch seconds: the plan has exceeded the slots present since then
    # Refusals decided while a slot was on its way or about to be asked for (since the registry started).
    num_refused_for_capacity: int
    bundles: tuple[dict[str, float], ...]  # what was last stated to the autoscaler (() before anything)


class CapacityBooks:
    def __init__(self, books: Books, config: CapacityConfig | None = None) -> None:
        self.books = books
        self.configure(config or CapacityConfig())
        self.plan: CapacityPlan | None = None
        self.short_since: float | None = None
        self.num_refused_for_capacity = 0
        # What Ray's autoscaler was last told; None: nothing yet (a new registry states its plan, even an
        # empty one, so a request its previous incarnation left standing is replaced).
        self.bundles: tuple[dict[str, float], ...] | None = None
        # The slots present at the last step (None before the first): a growth forgets the refusals before it.
        self._num_present: int | None = None

    def configure(self, config: CapacityConfig) -> None:
        """A (re)deploy's capacity config; the demand counted so far is kept when its window is unchanged."""
        meter = getattr(self, "meter", None)
        if meter is None or meter.window_s != config.demand_window_s:
            self.meter = DemandMeter(config.demand_window_s)
        self.config = config

    @property
    def is_enabled(self) -> bool:
        return self.config.is_enabled

    @property
    def num_present(self) -> int:
        """Slots that can take requests: a draining node's are leaving."""
        return len(self.books.slots) - len(self.books.draining)

    def record(self, counts: tuple[LaneCount, ...], now: float) -> None:
        """A replica's refusals (its lease report); kept only while planning is on, and only for the window."""
        if counts and self.is_enabled:
            self.meter.record(counts, now)

    def observe(self, snapshot: ClusterSnapshot, now: float) -> None:
        """The books at a refusal for want of capacity (DemandMeter.observe); nothing while planning is off."""
        if self.is_enabled:
            self.meter.observe(snapshot, now)

    def step(self, now: float, warm_per_model: dict[str, int]) -> CapacityPlan:
        """Plan from the demand and the books now. `warm_per_model`: each model's warm pool size."""
        present = self.num_present
        if self._num_present is not None and present > self._num_present:
            # The slots those refusals asked for are here and take that demand now (it shows as busy slots):
            # counted on top, it would ask for them again.
            self.meter.forget_refusals()
        self._num_present = present
        per_slot = self.books.max_actors_per_slot
        warm = {m: warm_slots_needed(n, per_slot) for m, n in warm_per_model.items()}
        demands = self.meter.lane_demands(self.books.snapshot(), now, warm)
        self.plan = plan_slots(demands, self.plan, now, self.config)
        if self.plan.num_wanted <= present:
            self.short_since = None
        elif self.short_since is None:
            self.short_since = now
        return self.plan

    def ready_in_s(self, now: float, actor_start_s: float) -> tuple[float, bool] | None:
        """When a slot asked of the autoscaler can serve a refused request: (seconds, whether it is on its way).

        On its way (the plan exceeds the slots present): what is left of `node_start_s`, then an actor's start.
        Not yet asked, below `max_slots`: as if asked now (the planner asks within `interval_s`), which a
        refusal quotes only where no slot present would free a place (registry.py). None: planning is off,
        the plan is at `max_slots` with every slot present, or the node is overdue by a whole `node_start_s`
        (the autoscaler cannot add it: pods pending, a quota) — then a slot's own end is the best answer.
        """
        if not self.is_enabled:
            return None
        if self.short_since is not None:
            if now - self.short_since > 2 * self.config.node_start_s:
                return None
            return ready_in_s(self.short_since, now, self.config, actor_start_s), True
        if self.num_present >= self.config.max_slots:
            return None
        return ready_in_s(now + self.config.interval_s, now, self.config, actor_start_s), False

    def status(self) -> CapacityStatus:
        nodes: dict[str, int] = {}
        for s in self.books.slots.values():
            if s.slot_id not in self.books.draining:
                nodes[s.node_id] = nodes.get(s.node_id, 0) + 1
        present = self.num_present
        plan = self.plan or CapacityPlan(self.config.min_slots, self.config.min_slots)
        return CapacityStatus(self.is_enabled, plan.num_wanted, plan.num_needed, present, len(nodes),
                              nodes_pending(plan.num_wanted, present, max(nodes.values(), default=1))
                              if self.is_enabled else 0,
                              self.short_since, self.num_refused_for_capacity, self.bundles or ())
