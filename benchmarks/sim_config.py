"""What one simulation sweep simulates: the cluster, the mix, the loads, the baselines' limits.

`benchmarks.simulate` runs a sweep of a `SimConfig`; the report (`benchmarks.sim_report`,
`benchmarks.sim_report_text`) describes it. Both import it from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from benchmarks.erlang import refusal_floor
from benchmarks.sim_calibration import (
    CPU_MEASURED,
    MIXED_LENGTH,
    ArrivalKind,
    Burst,
    Calibration,
    RequestClass,
    capacity_per_s,
    mean_hot_service_s,
    short_lane_share,
)
from benchmarks.sim_scorer import rows_within
from serve_app.policy import PolicyConfig

DEFAULT_LOADS = tuple(round(0.3 + 0.1 * i, 1) for i in range(13))


@dataclass(frozen=True)
class SimConfig:
    calibration: Calibration = CPU_MEASURED
    mix: tuple[RequestClass, ...] = MIXED_LENGTH
    num_slots: int = 200
    slots_per_node: int = 8  # nodes only matter to a scorer that reads node_num_busy
    max_batch: int = 8  # rows an actor or replica runs at once, in every system (zero-queue's fixed places)
    loads: tuple[float, ...] = DEFAULT_LOADS  # offered load, x capacity
    processes: tuple[ArrivalKind, ...] = ("poisson", "bursty")
    burst: Burst = field(default_factory=Burst)
    duration_services: float = 60.0  # arrivals for this many mean hot service times per load point
    warmup_fraction: float = 0.1  # of the duration, simulated but not measured
    # Slots holding a prewarmed hot actor, as a fraction; they are split between the lanes by each
    # lane's share of the slot-time the mix needs in full batches (sim_calibration.short_lane_share).
    # 1.0: every slot, as every queued replica is always hot; below it the rest are left for cold starts.
    hot_fraction: float = 1.0
    # The Serve baseline's max_ongoing_requests per replica. None: no limit, Ray Serve LLM's default
    # (1e9); Ray Serve's own default, 5, is below the batch and would cap the engine, not queue.
    serve_max_ongoing: int | None = None
    # The bounded FIFO's queue length. None: capacity x half the SLO's slack, so that even the last
    # request of a full queue starts well within the slack at full throughput (a bound of the whole
    # slack leaves the back of the queue right at the limit, and half of it misses). The other
    # baselines are unbounded, Ray Serve's default (max_queued_requests=-1).
    queue_bound: int | None = None
    # Places by prediction: a TPOT target every simulated request states, and the sweep runs zero-queue a second
    # time with it, its joins admitted by the scorer's predicted TPOT (serve_app/policy.py) and its batches capped
    # at `zq_max_batch` rows only for safety; the queued baselines keep `max_batch`. None: no such run. Capacity,
    # loads and the Erlang-B floors stay defined by `max_batch`, so every figure compares with the fixed run.
    tpot_target_s: float | None = None
    zq_max_batch: int = 32
    target_loads: tuple[float, ...] | None = None  # the loads of that run; None: every load
    seed: int = 0

    def base_policy(self) -> PolicyConfig:
        # No eviction: the simulated clusters do not retire idle actors for a request (sim_clusters.py).
        return PolicyConfig(actor_overhead_bytes=self.calibration.actor_overhead_bytes, max_batch=self.max_batch,
                            is_eviction_enabled=False)

    @property
    def num_hot(self) -> tuple[int, int]:
        """Prewarmed hot actors: (short lane, long lane)."""
        total = round(self.num_slots * self.hot_fraction)
        short = round(total * short_lane_share(self.calibration, self.mix, self.base_policy()))
        return short, total - short

    def policy(self, by_prediction: bool = False) -> PolicyConfig:
        """Zero-queue's policy: `max_batch` places per actor, or (`by_prediction`) as many as the TPOT
        target allows, up to the safety cap. The lanes' hot actors are split by full batches of `max_batch`
        either way: the two runs differ in their admission only."""
        short, long = self.num_hot
        cap = self.zq_max_batch if by_prediction else self.max_batch
        return replace(self.base_policy(), max_hot_short_actors=short, max_hot_long_actors=long, max_batch=cap)

    @property
    def measured_target_loads(self) -> tuple[float, ...]:
        """The loads of the places-by-prediction run (none without a target)."""
        if self.tpot_target_s is None:
            return ()
        return self.loads if self.target_loads is None else tuple(x for x in self.loads if x in self.target_loads)

    @property
    def target_rows(self) -> int:
        """Rows per actor the TPOT target allows: slowdown(rows) x one-row step <= target, at most the cap."""
        if self.tpot_target_s is None:
            raise ValueError("no TPOT target set")
        return rows_within(self.calibration, self.tpot_target_s, self.zq_max_batch)

    def erlang_target_floor(self, load: float) -> float:
        """B(c, A) with c = slots x the rows the target allows: the floor of the places by prediction."""
        return refusal_floor(self.num_slots * self.target_rows, load * self.capacity_per_s, self.mean_service_s)

    @property
    def mean_service_s(self) -> float:
        """Mean hot service time, each request alone on its actor: the time unit of the runs and the floor."""
        return mean_hot_service_s(self.calibration, self.mix)

    @property
    def capacity_per_s(self) -> float:
        return capacity_per_s(self.calibration, self.mix, self.num_slots, self.max_batch)

    @property
    def num_places(self) -> int:
        """Requests that can run at once: c of the Erlang-B floor."""
        return self.num_slots * self.max_batch

    def erlang_floor(self, load: float) -> float:
        """B(c, A): c = slots x max_batch, A = offered rate x mean hot service time (module doc)."""
        return refusal_floor(self.num_places, load * self.capacity_per_s, self.mean_service_s)

    def erlang_full_batch(self, load: float) -> float:
        """B(c, A) with every request held as long as in a full batch (c / capacity on average): what a
        pooled system without a queue refuses at full-batch speed. A reference, not a floor: rows of
        batches that are not full run faster."""
        return refusal_floor(self.num_places, load * self.capacity_per_s, self.num_places / self.capacity_per_s)

    @property
    def bounded_queue(self) -> int:
        if self.queue_bound is not None:
            return self.queue_bound
        return round(self.capacity_per_s * self.calibration.slo_extra_s / 2)

    @property
    def horizon_s(self) -> float:
        return self.duration_services * self.mean_service_s

    @property
    def work_capacity(self) -> float:
        """Seconds of hot, one-row service the cluster completes per second at capacity."""
        return self.capacity_per_s * self.mean_service_s
