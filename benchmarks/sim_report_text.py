"""The prose of the simulation report: the model, the goals (computed from the results), the limits."""

from __future__ import annotations

from collections.abc import Callable

from actors.sampling_params import SamplingParams
from benchmarks.sim_config import SimConfig
from benchmarks.sim_format import num, pct
from benchmarks.sim_results import SYSTEM_NAMES, ClassMetrics, PointResult, point
from serve_app.memory import request_features

ZQ, FIFO, BOUNDED, SERVE = SYSTEM_NAMES


def serve_words(cfg: SimConfig) -> str:
    """The Serve baseline's routing and per-replica limit, in words."""
    if cfg.serve_max_ongoing is None:
        return ("Ray Serve's routing with Ray Serve LLM's default `max_ongoing_requests` (no limit): every request "
                "goes to a replica at once and waits in that replica's own queue")
    return f"Ray Serve's routing with `max_ongoing_requests={cfg.serve_max_ongoing}` per replica"


def overload_floor(load: float) -> float:
    """No system can complete more than capacity: above it at least 1 - capacity/offered is refused
    (or, queued, never served in time)."""
    return max(0.0, 1.0 - 1.0 / load)


def model_text(cfg: SimConfig, floor: dict[str, ClassMetrics], lane_probability: Callable) -> list[str]:
    cal, policy = cfg.calibration, cfg.policy()
    burst, (num_short, num_long) = cfg.burst, cfg.num_hot
    full = cal.slowdown(cfg.max_batch)
    num_free = cfg.num_slots - num_short - num_long
    lines = [
        "## What is simulated", "",
        f"- **Cluster**: {cfg.num_slots} accelerator slots ({cfg.slots_per_node} per node), one actor or replica "
        f"per slot, each running up to **{cfg.max_batch} requests at once as one batch** in every system"
        f"{' (places by prediction aside: below)' if cfg.measured_target_loads else ''}. A "
        f"decode step of b rows takes 1 + {cal.batch_row_cost:g} × (b − 1) one-row steps ({num(full)}× for a full "
        f"batch of {cfg.max_batch}; the per-row figure is benchmarks/results/batch.md's, at context 128). A "
        "request that joins a running batch waits for its next step boundary (one step of the batch with it in "
        "it), then prefills at its hot speed; while it decodes, every change in the batch's size changes its "
        "speed (sim_model.py has the model and what it leaves out).",
        f"- **zero-queue**: every slot{'' if num_free == 0 else ' but ' + str(num_free)} holds a prewarmed hot "
        f"actor: **{num_short} of the short lane and {num_long} of the long lane**, split by each lane's share "
        "of the slot-time the mix needs in full batches. Every arrival builds its `RequestFeatures` and a "
        "`ClusterSnapshot` and calls the real `serve_app.policy.decide` (the rule scorer priced with this "
        "calibration, benchmarks/sim_scorer.py), which commits as "
        "`RegistryState` does: Dispatch → an idle hot actor runs it alone; Join → it becomes one more row of a "
        "busy hot actor of its own lane (the rule scorer picks, among the "
        f"{policy.max_candidates} least loaded such actors, the batch with the fewest rows and KV positions); "
        "Spawn → a fresh actor cold-starts on a free slot"
        + (" (there is none: every slot holds a hot actor)" if num_free == 0 else "")
        + "; Reject → answered at once with 503 and counted. A short request may take an idle long-lane actor "
        "but never joins one; a long request never touches a short-lane actor. Each row's end releases just that "
        "row; the actors stay hot. Policy: `PolicyConfig` defaults (short lane: input ≤ "
        f"{policy.short_max_input_tokens} and output ≤ {policy.short_max_output_tokens} tokens; max_candidates "
        f"{policy.max_candidates} per kind; one actor per slot; max_batch {policy.max_batch}) with "
        f"max_hot_short_actors = {num_short} and max_hot_long_actors = {num_long}, never retired. Nothing is "
        "ever queued.",
        *([f"- **zero-queue, places by prediction**: the same cluster on the same arrivals, every request stating a "
           f"TPOT target of {1000 * cfg.tpot_target_s:.1f} ms: a join is admitted only where the scorer predicts the "
           f"batch within every row's target, up to a safety cap of {cfg.zq_max_batch} rows (the target allows "
           f"{cfg.target_rows}); its own section below."] if cfg.measured_target_loads else []),
        "- **queued FIFO**: one long-lived replica per slot, weights always resident, batching exactly as the "
        "zero-queue actors do; one central FIFO queue in front, unbounded: a request is sent to a replica as "
        "soon as one has a free row (power of two choices among those, the one with fewer rows), else it waits "
        "its turn. The best case for a queue's latency while it keeps up.",
        f"- **queued FIFO, bounded**: the same with at most {cfg.bounded_queue} requests waiting (capacity × "
        f"half the SLO's {cal.slo_extra_s:g} s of slack, so that the last of a full queue still starts well "
        "within it); an arrival that finds the queue full gets a 503 at once, as Serve's `max_queued_requests` "
        "does.",
        f"- **queued Serve default**: {serve_words(cfg)} — beyond its batch's {cfg.max_batch} rows, while "
        "another replica may have rows free (power of two choices on each replica's ongoing requests). Ray "
        "Serve's own default of 5 ongoing requests would cap every replica at 5 rows, a smaller engine rather "
        "than a queue (`--serve-max-ongoing 5` runs it).",
        "", "**The mixed-length mix** (token counts uniform over the stated integers; every request generates its "
        "max_tokens):", "",
        "| class | share | input tokens | output tokens | on the short lane | unloaded TTFT P50 / P99 | unloaded "
        "e2e P50 / P99 / P99÷P50 |", "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for c in cfg.mix:
        m = floor[c.name]
        lines.append(f"| {c.name} | {100 * c.share:.0f}% | {c.input_tokens[0]}–{c.input_tokens[1]} "
                     f"| {c.output_tokens[0]}–{c.output_tokens[1]} | {100 * lane_probability(cal, c, policy):.0f}% "
                     f"| {num(m.ttft_s[0])} / {num(m.ttft_s[1])} s | {num(m.e2e_s[0], 1)} / {num(m.e2e_s[1], 1)} s / "
                     f"{num(m.e2e_ratio)} |")
    spike_s, period_s = burst.spike_services * cfg.mean_service_s, burst.period_services * cfg.mean_service_s
    one_at_a_time = cfg.num_slots / cfg.mean_service_s
    lines += [
        "", "'Unloaded' is each request alone on a hot actor with no wait: the floor no scheduler can beat, and "
        "the P99/P50 the mix's own spread of lengths gives.", "",
        f"- **Capacity** = what always-hot replicas running full batches of {cfg.max_batch} serve at most = "
        f"{cfg.num_slots} × {cfg.max_batch} / (mean time a request holds its row in a full batch, "
        f"{cfg.num_places / cfg.capacity_per_s:.2f} s) = **{cfg.capacity_per_s:.1f} requests/s**, "
        f"{cfg.capacity_per_s / one_at_a_time:.2f}× what they serve one request at a time "
        f"({one_at_a_time:.1f}/s, mean hot service {cfg.mean_service_s:.2f} s). Offered load is a multiple of "
        f"it, {cfg.loads[0]:.1f} to {cfg.loads[-1]:.1f}.",
        f"- **Arrivals**: Poisson; and bursty: a base rate with a {burst.multiplier:g}× spike lasting "
        f"{spike_s:.1f} s ({burst.spike_services:g} mean service times) in the middle of every {period_s:.0f} s "
        f"({burst.period_services:g} mean service times), the base set so that the mean is the offered load.",
        f"- **Length of a run**: arrivals for {cfg.horizon_s:.0f} s ({cfg.duration_services:g} mean hot service "
        f"times) per load point; the first {100 * cfg.warmup_fraction:.0f}% is warm-up, simulated and not "
        "measured; the simulation goes on until every admitted request has ended. All four systems get the very "
        "same arrivals (one seed per point).",
        "- **Metrics**: latency percentiles (numpy, linear interpolation) and rejection rates over the requests "
        "that arrived in the measured window; done/s and goodput/s count the completions inside it. **SLO**: a "
        f"request is good when its TTFT is at most its own unloaded (hot) TTFT + {cal.slo_extra_s:g} s — it "
        "waited (in a queue, for a batch's step, or for a cold start) no more than that. Decode is stretched by "
        "the batch the same way in every system, so end-to-end latency grows with the batch as well as with "
        "any wait.",
    ]
    return lines


def _memory_text(cfg: SimConfig) -> str:
    policy, numbers = cfg.policy(), cfg.calibration.model_numbers()
    longest = max(cfg.mix, key=lambda c: c.input_tokens[1] + c.output_tokens[1])
    need = request_features("sim", numbers, longest.input_tokens[1],
                            SamplingParams(max_tokens=longest.output_tokens[1]), policy)
    full = need.resident_bytes + cfg.max_batch * need.dispatch_bytes
    if full <= cfg.calibration.slot_bytes:
        return (f"- **Memory never binds**: a slot's {cfg.calibration.slot_bytes / 2**30:.0f} GiB holds the "
                f"resident actor and {cfg.max_batch} rows of the longest request ({full / 2**30:.2f} GiB), so "
                "every refusal here is for want of a row, not of memory.")
    return (f"- **Memory binds**: {cfg.max_batch} rows of the longest request with the resident actor take "
            f"{full / 2**30:.2f} GiB of a {cfg.calibration.slot_bytes / 2**30:.0f} GiB slot, so some batches are "
            "cut short by memory (the registry's own accounting, as in the cluster).")


def _range(values: list[float]) -> str:
    lo, hi = num(min(values)), num(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def _spread(m: Callable, load: float, system: str) -> float:
    rates = [m(system, load, c).reject_rate for c in ("short", "medium", "long")]
    return max(rates) - min(rates)


def _row(results: list[PointResult], process: str, load: float, system: str, cls: str) -> ClassMetrics:
    return point(results, process, load, system).metrics[cls]


def _nearest(loads: tuple[float, ...], x: float) -> float:
    return min(loads, key=lambda v: abs(v - x))


def _floor_text(cfg: SimConfig, m: Callable, process: str) -> list[str]:
    loads = cfg.loads
    picks = tuple(dict.fromkeys(_nearest(loads, x) for x in (0.3, 0.6, 0.9, 1.2)))
    first = next((x for x in loads if m(ZQ, x).reject_rate > 0.001), None)
    over = [x for x in loads if x > 1.0]
    lines = [
        f"**Refusals against the floor** ({process}). Zero-queue refuses / Erlang-B floor / Erlang-B at "
        "full-batch speed: " + "; ".join(
            f"{pct(m(ZQ, x).reject_rate)}% / {pct(cfg.erlang_floor(x))}% / {pct(cfg.erlang_full_batch(x))}% "
            f"at {x:.1f}" for x in picks) + "."
        + (f" It refuses nothing (under 0.1%) below load {first:.1f}." if first is not None and first > loads[0]
           else "")
        + f" The floor itself is {pct(max(cfg.erlang_floor(x) for x in loads))}% at most over the sweep: with "
        f"c = {cfg.num_places} places and every request charged only its time alone, A stays below c up to load "
        f"{cfg.num_places / (cfg.capacity_per_s * cfg.mean_service_s):.2f}. A full batch stretches decode "
        f"{num(cfg.calibration.slowdown(cfg.max_batch))}×, which that floor does not count: it is the least a "
        "system without a queue that admits whenever a place is free refuses, not what one near capacity does."]
    if over:
        worst = max(over, key=lambda x: abs(m(ZQ, x).reject_rate - cfg.erlang_full_batch(x)))
        gap = abs(m(ZQ, worst).reject_rate - cfg.erlang_full_batch(worst))
        lines[-1] += (
            f" Above capacity no system completes the excess (at least 1 − 1/load refused or served late: "
            f"{pct(overload_floor(over[-1]))}% at {over[-1]:.1f}), and there zero-queue refuses within "
            f"{num(100 * gap, 1)} points of the full-batch Erlang-B reference (the largest gap, at {worst:.1f})")
        lines[-1] += (": what it refuses beyond the floor is, in this model, the batching slowdown (the engine's "
                      "physics), not the admission." if gap < 0.01 else ".")
    return lines


def goals_text(cfg: SimConfig, results: list[PointResult], floor: dict[str, ClassMetrics]) -> list[str]:
    loads, lines = cfg.loads, ["## The goals, against these results", ""]
    process = "poisson" if "poisson" in cfg.processes else cfg.processes[0]
    lo, mid, one, hi = loads[0], _nearest(loads, 0.9), _nearest(loads, 1.0), loads[-1]

    def m(system: str, load: float, cls: str = "all", proc: str = process) -> ClassMetrics:
        return _row(results, proc, load, system, cls)

    def span(system: str, proc: str, attr: str = "e2e_ratio") -> tuple[float, float, float]:
        values = [getattr(m(system, x, "short", proc), attr) for x in loads]
        return min(values), max(values), loads[values.index(max(values))]

    lines += [*_floor_text(cfg, m, process), ""]

    zq_lo, zq_hi, zq_at = span(ZQ, process)
    lines.append(
        f"**P99/P50 near 1.1 instead of above 3** (short requests, end to end). {process}: zero-queue "
        f"{num(zq_lo)}–{num(zq_hi)} over loads {lo:.1f}–{hi:.1f} (worst at {zq_at:.1f}; TTFT: "
        f"{num(span(ZQ, process, 'ttft_ratio')[0])}–{num(span(ZQ, process, 'ttft_ratio')[1])}), the unbounded FIFO "
        f"{num(span(FIFO, process)[0])}–{num(span(FIFO, process)[1])}.")
    for proc in cfg.processes:
        if proc != process:
            z, f = span(ZQ, proc), span(FIFO, proc)
            lines[-1] += (f" {proc}: zero-queue {num(z[0])}–{num(z[1])}, the FIFO {num(f[0])}–{num(f[1])} (worst at "
                          f"{f[2]:.1f}).")
    worst = max(span(ZQ, p)[1] for p in cfg.processes)
    z_lo, f_lo = m(ZQ, lo, "short"), m(FIFO, lo, "short")
    lines[-1] += (
        f" Against 1.1 zero-queue **misses by {num(100 * (worst / 1.1 - 1), 0)}%** at its worst. (1) The unloaded "
        f"floor of this mix is already {num(floor['short'].e2e_ratio)} for short requests: outputs of "
        f"{cfg.mix[0].output_tokens[0]}–{cfg.mix[0].output_tokens[1]} tokens make some requests 4× longer than "
        "others with no waiting at all. (2) Batching spreads it further: a row's decode runs "
        f"1–{num(cfg.calibration.slowdown(cfg.max_batch))}× slower with the size of its batch. Slowdown "
        "(latency ÷ the request's own unloaded latency) removes (1); its P99 for short requests, zero-queue / "
        "FIFO / bounded FIFO: " + "; ".join(
            f"{num(m(ZQ, x, 'short').slowdown_p99)} / {num(m(FIFO, x, 'short').slowdown_p99)} / "
            f"{num(m(BOUNDED, x, 'short').slowdown_p99)} at {x:.1f}" for x in dict.fromkeys((lo, mid, one, hi))) + ".")
    if z_lo.slowdown_p99 > f_lo.slowdown_p99 + 0.05:
        lines[-1] += (
            f" At {lo:.1f} zero-queue's tail is the longer one ({num(z_lo.slowdown_p99)} against "
            f"{num(f_lo.slowdown_p99)}; a full batch is {num(cfg.calibration.slowdown(cfg.max_batch))}).")
    lines[-1] += (" Where zero-queue's tail is short under overload it is partly because requests were refused "
                  "(the rejection columns).")
    lines.append("")

    z_hi, f_hi, b_hi, s_hi = (m(x, hi) for x in (ZQ, FIFO, BOUNDED, SERVE))
    lines += [
        "**No 503s from queue overflow.** Zero-queue has no queue to overflow; it refuses at admission instead "
        "(503 overloaded_error with retry-after): " + ", ".join(
            f"{pct(m(ZQ, x).reject_rate)}% at load {x:.1f}" for x in dict.fromkeys((mid, one, hi)))
        + f" ({process}); short / medium / long requests {pct(m(ZQ, hi, 'short').reject_rate)} / "
        f"{pct(m(ZQ, hi, 'medium').reject_rate)} / {pct(m(ZQ, hi, 'long').reject_rate)}% at {hi:.1f}"
        + (" — alike: each lane's hot actors are sized to its share of the work"
           if _spread(m, hi, ZQ) < 0.02 else "") + ". The unbounded queues never answer 503 and let "
        f"waits grow instead: the FIFO's P99 TTFT at {hi:.1f} is {num(f_hi.ttft_s[1], 0)} s, and grows with the "
        f"length of the overload ({cfg.horizon_s:.0f} s here). The bounded FIFO refuses "
        f"{pct(b_hi.reject_rate)}% at {hi:.1f} and keeps its P99 TTFT at {num(b_hi.ttft_s[1])} s.", "",
        f"Goodput at {hi:.1f} ({process}): zero-queue {num(z_hi.goodput_per_s, 1)}/s, FIFO "
        f"{num(f_hi.goodput_per_s, 1)}/s, bounded FIFO {num(b_hi.goodput_per_s, 1)}/s, Serve default "
        f"{num(s_hi.goodput_per_s, 1)}/s, against a capacity of {cfg.capacity_per_s:.1f}/s; as a share of the "
        f"work the cluster completes at capacity: {pct(z_hi.good_work_fraction)}%, "
        f"{pct(f_hi.good_work_fraction)}%, {pct(b_hi.good_work_fraction)}%, {pct(s_hi.good_work_fraction)}%.", "",
    ]

    z_one, b_one = m(ZQ, one, "short"), m(BOUNDED, one, "short")
    gap = b_hi.good_work_fraction - z_hi.good_work_fraction
    verdict = (f"in work done within the SLO the two are level at {hi:.1f} ({num(100 * abs(gap), 1)} points apart)"
               if abs(gap) < 0.02 else
               f"in work done within the SLO the {'bounded queue' if gap > 0 else 'zero-queue cluster'} leads by "
               f"{num(100 * abs(gap), 1)} points at {hi:.1f}")
    lines += [
        "**Against a bounded queue.** A FIFO bounded at "
        f"{cfg.bounded_queue} requests (half the SLO's slack at full throughput) also refuses at once when full "
        "and keeps its tail short: short requests' P99 TTFT zero-queue / bounded FIFO "
        f"{num(z_one.ttft_s[1])} / {num(b_one.ttft_s[1])} s at {one:.1f} (rejected {pct(z_one.reject_rate)}% / "
        f"{pct(b_one.reject_rate)}%), {num(m(ZQ, hi, 'short').ttft_s[1])} / {num(m(BOUNDED, hi, 'short').ttft_s[1])} "
        f"s at {hi:.1f} (rejected {pct(m(ZQ, hi, 'short').reject_rate)}% / "
        f"{pct(m(BOUNDED, hi, 'short').reject_rate)}%); {verdict}. What zero-queue keeps is that an admitted "
        f"request never waits for more than a step (short TTFT P50 {num(m(ZQ, hi, 'short').ttft_s[0])} s at "
        f"{hi:.1f}, the bounded FIFO's {num(m(BOUNDED, hi, 'short').ttft_s[0])} s) and that nothing is held in a "
        "queue.", "",
    ]

    lines += [
        "**Long requests isolated.** Under zero-queue a short request never waits behind a long one: it runs "
        "alone on an idle actor or joins a batch of its own lane at the next step. Short-request P99 TTFT, "
        "zero-queue vs Serve's per-replica queues (where a short request can wait behind a replica's running "
        "batch while another replica has rows free): " + ", ".join(
            f"{num(m(ZQ, x, 'short').ttft_s[1])} s vs {num(m(SERVE, x, 'short').ttft_s[1])} s at {x:.1f}"
            for x in dict.fromkeys((lo, mid, one))) + ". A central FIFO isolates them as well until it "
        "saturates. " + (
            f"With every slot hot, long requests do not cold-start (their TTFT P50 at {lo:.1f}: "
            f"{num(m(ZQ, lo, 'long').ttft_s[0])} s, against {num(m(FIFO, lo, 'long').ttft_s[0])} s in the FIFO); "
            "the price of the isolation is the split into lanes." if m(ZQ, lo, "long").cold_rate < 0.01 else
            f"The price is paid by long requests that cold-start: {pct(m(ZQ, lo, 'long').cold_rate)}% of them at "
            f"{lo:.1f}, TTFT P50 {num(m(ZQ, lo, 'long').ttft_s[0])} s against {num(m(FIFO, lo, 'long').ttft_s[0])} "
            "s in the FIFO."), "",
    ]

    if "bursty" in cfg.processes:
        b_lo = _nearest(loads, 0.5)
        z, f, b = (m(x, b_lo, proc="bursty") for x in (ZQ, FIFO, BOUNDED))
        zs, zl = m(ZQ, b_lo, "short", "bursty"), m(ZQ, b_lo, "long", "bursty")
        rej = [m(ZQ, x, "short", "bursty").reject_rate for x in loads]
        tails = [m(ZQ, x, "short", "bursty").ttft_s[1] for x in loads]
        lines += [
            f"**Bursts** (load {b_lo:.1f} on average, {cfg.burst.multiplier:g}× spikes): zero-queue refuses "
            f"{pct(z.reject_rate)}% (the spikes' excess: Erlang-B for Poisson arrivals of that mean is "
            f"{pct(cfg.erlang_full_batch(b_lo))}% even at full-batch speed) and serves the rest at once (P99 TTFT "
            f"{num(z.ttft_s[1])} s, goodput {num(z.goodput_per_s, 1)}/s); the FIFO refuses nothing and queues the "
            f"spikes (P99 TTFT {num(f.ttft_s[1])} s, goodput {num(f.goodput_per_s, 1)}/s); the bounded FIFO "
            f"refuses {pct(b.reject_rate)}% (P99 TTFT {num(b.ttft_s[1])} s, goodput {num(b.goodput_per_s, 1)}/s). "
            "A queue absorbs a short spike that zero-queue turns away: below capacity on average, refusing is the "
            "price of never waiting."
            + (f" The lanes add to it: at {b_lo:.1f} zero-queue refuses {pct(zs.reject_rate)}% of short requests "
               f"and {pct(zl.reject_rate)}% of long ones: a spike fills the short lane's batches while the long "
               "lane's have rows free, and a short request may not join a long-lane batch."
               if zs.reject_rate > zl.reject_rate + 0.01 else "")
            + f" Zero-queue's short-request P99 TTFT stays {_range(tails)} s at every bursty load while it "
            f"refuses {pct(min(rej))}–{pct(max(rej))}% of short requests: a tail that looks good because the "
            "spikes were refused.", "",
        ]
    return lines


def not_modelled_text(cfg: SimConfig) -> list[str]:
    cal = cfg.calibration
    return [
        "## What the simulation does not model", "",
        f"- **The batch's step time is one figure**: + {cal.batch_row_cost:g} of a one-row step per extra row "
        "(sim_calibration.py), benchmarks/results/batch.md's fit at 128-token contexts. A row's step cost does not "
        "grow with its context here, though batch.md measures that it does (1,024-token rows made a batch of 8 "
        "2.2x slower than one row, against 1.4x at 128 tokens), a joining row's prefill runs at its hot speed and is not charged to the "
        "running rows (the engine chunks it into their steps), and the wait for a step boundary is charged as a "
        "whole step. The rule scorer that ranks joins and predicts their TPOT is priced with these figures "
        "(benchmarks/sim_scorer.py), so its predicted steps are the simulated ones; a real engine's are not "
        "(serve_app/ttft_check.py and the actors' step corrections exist for that).",
        _memory_text(cfg),
        "- **Measured on a CPU.** Every measured figure of the default calibration is from this project's 2-core "
        "CPU runs of a 100M-parameter model; what matters for the comparison is the ratio of cold start to "
        f"service time ({num(float(cal.cold_ttft_s(160) - cal.hot_ttft_s(160)), 1)} s against a mean service of "
        f"{cfg.mean_service_s:.1f} s here), and only when some slots are left for cold starts (`--hot-fraction` "
        "below 1). On a GPU decode is far faster while the Ray worker start is not, so cold starts weigh more; "
        "`--preset gpu-estimate` runs such a what-if (estimates, not measurements).",
        "- **Noise and contention.** Service and cold-start times are deterministic functions of the token "
        "counts (no run-to-run spread, no interference between actors on one node, no page-cache misses: the "
        "calibration is the page-cache row).",
        "- **Overheads common to both**: HTTP, the ingress, tokenisation, the registry call (~µs–ms), Ray's "
        "stream relay (10–35 ms per request in cold_start.md's hot rows, client against actor) are not added.",
        "- **Hot-pool management**: fixed pools of prewarmed actors per lane, split by the mix's average; no "
        "retirement of idle actors (`max_idle_s`), no autoscaling of either system, one model. Clients do not "
        "retry after a 503 and do not time out or cancel while queued (an unbounded queue's waits are what a "
        "patient client sees).",
        "- **Failures**: no actor crashes, no reconcile, no stale snapshots (one registry, decisions serialised).",
    ]
