"""The ingress's metrics, through the metrics system the app hands in: Ray's (`ray.util.metrics`,
exported for Prometheus by every Ray node, which also records nothing harmlessly outside Ray).

Names are prefixed `zq_`; Ray exports them as `ray_zq_*`. `configs/grafana.json` charts them.
"""

from __future__ import annotations

from collections import deque
from types import ModuleType

from serve_app.snapshot import ClusterSummary

_LATENCY_BOUNDARIES = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5]
_DENSITY_BOUNDARIES = [0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0]
_RATIO_BOUNDARIES = [0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4]
_SECONDS_BOUNDARIES = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64]


class IngressMetrics:
    def __init__(self, metrics: ModuleType, window: int = 1024) -> None:
        """`metrics`: a module with Ray's `Counter`, `Histogram` and `Gauge` (ray.util.metrics)."""
        self.dispatch_latency = metrics.Histogram(
            "zq_dispatch_latency_seconds", "Arrival to decision acted on (actor called or request refused).",
            boundaries=_LATENCY_BOUNDARIES, tag_keys=("model",))
        self.decisions = metrics.Counter("zq_decisions_total", "Decisions by kind.", tag_keys=("model", "kind"))
        self.rejections = metrics.Counter("zq_rejections_total", "Refused requests by reason.", tag_keys=("reason",))
        self.errors = metrics.Counter(
            "zq_errors_total", "Error responses and streams ended by an error event, by error type.",
            tag_keys=("type",))
        self.cancellations = metrics.Counter("zq_cancellations_total", "Requests whose client left before the end.")
        self.cold_start = metrics.Histogram(
            "zq_cold_start_seconds", "Actor creation to first token for cold requests.",
            boundaries=_SECONDS_BOUNDARIES, tag_keys=("model",))
        self.ttft = metrics.Histogram(
            "zq_ttft_seconds", "Arrival to first token.", boundaries=_SECONDS_BOUNDARIES, tag_keys=("model", "kind"))
        # zq_ttft_seconds ends where the actor sampled the token; the client has it no sooner than the ingress.
        # Across nodes the two clocks' offset is in it too.
        self.first_token_delivery = metrics.Histogram(
            "zq_first_token_delivery_seconds", "The actor sampling the first token to the ingress receiving it.",
            boundaries=_LATENCY_BOUNDARIES, tag_keys=("model",))
        self.tpot = metrics.Histogram(
            "zq_time_per_output_token_seconds", "Decode time per output token after the first.",
            boundaries=_LATENCY_BOUNDARIES, tag_keys=("model",))
        self.batch_rows = metrics.Histogram(
            "zq_batch_rows", "Rows of the batch each admitted request runs in, itself included (1: alone).",
            boundaries=[1, 2, 3, 4, 6, 8, 12, 16, 32], tag_keys=("model",))
        # Seed 001's per-request dimension in place of a queue length (Completion.compute_density).
        self.compute_density = metrics.Histogram(
            "zq_compute_density", "Engine time on a request over its time from arrival to last token (1: never "
            "waited).", boundaries=_DENSITY_BOUNDARIES, tag_keys=("model", "tier"))
        self.step_rows = metrics.Histogram(
            "zq_step_rows", "Mean rows of the steps each request ran in, itself included: its slot's concurrent work.",
            boundaries=[1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32], tag_keys=("model",))
        # Fewer than actor.compute_threads while the node's other processes are busy (actors/thread_governor.py).
        self.step_threads = metrics.Histogram(
            "zq_step_threads", "Mean threads the steps each request ran in computed on.",
            boundaries=[1, 1.25, 1.5, 1.75, 2, 3, 4, 8], tag_keys=("model",))
        # The engine's step planner checked (actors/step_cost.py): measured over predicted time of each
        # request's steps; 1 is a perfect prediction, above 1 steps ran longer than planned.
        self.step_time_ratio = metrics.Histogram(
            "zq_step_time_ratio", "Measured over predicted time of the engine steps each request ran in.",
            boundaries=_RATIO_BOUNDARIES, tag_keys=("model",))
        self.ttft_ratio = metrics.Histogram(
            "zq_ttft_ratio", "Measured over predicted TTFT of each admitted request, by the tier it ran on.",
            boundaries=_RATIO_BOUNDARIES, tag_keys=("model", "tier"))
        self.evictions = metrics.Counter(
            "zq_evictions_total", "Idle hot or warm actors retired to make room for a request.",
            tag_keys=("model",))
        self.admissions = metrics.Counter(
            "zq_admissions_total", "Admitted requests by the tier they run on: hot, warm or cold.",
            tag_keys=("model", "tier"))
        self.admission_paths = metrics.Counter(
            "zq_admission_paths_total", "Admitted requests by how they were decided: on this replica's leased rows "
            "(no registry call) or by the registry (the slow path).", tag_keys=("path",))
        self.leased_rows = metrics.Gauge("zq_leased_rows", "Rows of hot actors this replica holds on lease.")
        # Gauges of the registry's view, set each heartbeat (`set_cluster`), whether or not /health is polled.
        self.actors = metrics.Gauge("zq_actors", "Request actors by state (registry view).", tag_keys=("state",))
        self.free_slots = metrics.Gauge("zq_free_slots", "Slots with no actor.")
        self.rows = metrics.Gauge("zq_rows", "Requests holding a row on an actor (registry view).")
        self.batch_occupancy = metrics.Gauge(
            "zq_batch_occupancy", "Rows on busy hot actors over the rows they could hold (max_batch each).")
        self.slots = metrics.Gauge("zq_slots", "Slots in the registry (registry view).")
        # The capacity planner's (serve_app/capacity.py), where it is on.
        self.slots_wanted = metrics.Gauge("zq_slots_wanted", "Slots the capacity planner asks Ray's autoscaler for.")
        self.nodes_pending = metrics.Gauge("zq_nodes_pending", "Nodes still to come for the slots wanted.")
        self.refused_for_capacity = metrics.Gauge(
            "zq_refused_for_capacity", "Refusals decided while a slot was on its way, since the registry started.")
        # Recent dispatch latencies (µs) for /health's jitter figures, and recent requests' densities.
        self._recent_dispatch_us: deque[float] = deque(maxlen=window)
        # (density, mean step rows, mean step threads: 0 where the actor did not say)
        self._recent_density: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._window = window
        self._recent_step_ratio: deque[float] = deque(maxlen=window)
        self._recent_ttft_ratio: dict[str, deque[float]] = {}  # by tier

    def set_cluster(self, summary: ClusterSummary) -> None:
        for state, n in summary.actors.items():
            self.actors.set(n, tags={"state": state})
        self.free_slots.set(summary.num_free_slots)
        self.rows.set(summary.num_rows)
        self.batch_occupancy.set(summary.batch_occupancy)
        self.slots.set(summary.num_slots)
        if summary.num_slots_wanted is not None:
            self.slots_wanted.set(summary.num_slots_wanted)
            self.nodes_pending.set(summary.num_nodes_pending)
            self.refused_for_capacity.set(summary.num_refused_for_capacity)

    def observe_dispatch(self, model: str, seconds: float) -> None:
        self.dispatch_latency.observe(seconds, tags={"model": model})
        self._recent_dispatch_us.append(seconds * 1e6)

    def observe_density(self, model: str, tier: str, density: float, step_rows: float, step_threads: float) -> None:
        """One request's density, mean step rows and mean step threads (0: its actor did not say)."""
        self.compute_density.observe(density, tags={"model": model, "tier": tier})
        self.step_rows.observe(step_rows, tags={"model": model})
        if step_threads > 0:
            self.step_threads.observe(step_threads, tags={"model": model})
        self._recent_density.append((density, step_rows, step_threads))

    def observe_step_ratio(self, model: str, ratio: float) -> None:
        self.step_time_ratio.observe(ratio, tags={"model": model})
        self._recent_step_ratio.append(ratio)

    def observe_ttft_ratio(self, model: str, tier: str, ratio: float) -> None:
        self.ttft_ratio.observe(ratio, tags={"model": model, "tier": tier})
        self._recent_ttft_ratio.setdefault(tier, deque(maxlen=self._window)).append(ratio)

    def recent_ttft_prediction(self) -> dict[str, dict[str, float | int]]:
        """Per tier: recent measured ÷ predicted TTFT (p50, p90), for /health."""
        return {tier: _ratios(recent) for tier, recent in sorted(self._recent_ttft_ratio.items())}

    def recent_step_prediction(self) -> dict[str, float | int]:
        """Recent requests' measured ÷ predicted step time (p50, p90) and the median error |ratio - 1|, for /health."""
        if not self._recent_step_ratio:
            return {"count": 0}
        errors = sorted(abs(r - 1.0) for r in self._recent_step_ratio)
        return _ratios(self._recent_step_ratio) | {"median_error": round(_rank(errors, 0.5), 3)}

    def recent_density(self) -> dict[str, float | int]:
        """Recent requests' compute density (p10 / p50: a low one waited), mean step rows and mean step threads (None
        where no actor said), for /health."""
        if not self._recent_density:
            return {"count": 0}
        densities = sorted(d for d, _, _ in self._recent_density)
        n = len(densities)
        threads = [t for _, _, t in self._recent_density if t > 0]
        return {"count": n, "p10": round(_rank(densities, 0.1), 3), "p50": round(_rank(densities, 0.5), 3),
                "mean_step_rows": round(sum(r for _, r, _ in self._recent_density) / n, 2),
                "mean_step_threads": round(sum(threads) / len(threads), 2) if threads else None}

    def dispatch_jitter_us(self) -> dict[str, float | int]:
        """p50/p99/max and the spread (p99 - p50) of recent dispatch latencies, in µs."""
        xs = sorted(self._recent_dispatch_us)
        if not xs:
            return {"count": 0}

        def q(p: float) -> float:
            return round(_rank(xs, p), 1)

        return {"count": len(xs), "p50": q(0.5), "p99": q(0.99), "max": round(xs[-1], 1),
                "jitter": round(q(0.99) - q(0.5), 1)}


def _ratios(recent: deque[float]) -> dict[str, float | int]:
    """Count, p50 and p90 of recent measured ÷ predicted ratios (non-empty)."""
    ratios = sorted(recent)
    return {"count": len(ratios), "p50": round(_rank(ratios, 0.5), 3), "p90": round(_rank(ratios, 0.9), 3)}


def _rank(xs: list[float], p: float) -> float:
    """The value at rank p (0..1) of sorted, non-empty `xs`: /health's recent figures."""
    return xs[min(len(xs) - 1, int(p * len(xs)))]
