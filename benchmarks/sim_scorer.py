"""The rule scorer priced with the simulation's own model, and the places a TPOT target allows.

`decide` admits a join by the scorer's predicted TPOT of the batch with the newcomer in it. With
the default `RULE_SCORER` (placeholder constants: a 30 ms step, +5% a row, KV reads at 20 GB/s)
that prediction is not what the simulated engine then does (a 41 ms step, +5.6% a row, no KV
term), so a TPOT target would be kept or missed by accident. `sim_scorer(calibration)` builds a
`RuleScorer` from the same `Calibration` the engines run on:

| RuleScorer field      | from the calibration                                   | maps?                        |
|-----------------------|--------------------------------------------------------|------------------------------|
| decode_s_per_token    | decode_s_per_token (a one-row step)                    | exactly                      |
| batch_row_cost        | batch_row_cost: step(b) = step x (1 + cost x (b - 1))  | exactly                      |
| kv_read_bytes_per_s   | infinite: the fluid model's step has no KV term        | exactly (both leave it out)  |
| prefill_tokens_per_s  | the hot-TTFT points' slope, first to last point        | roughly: the simulation      |
|                       |                                                        | interpolates the points      |
| attention_pairs_per_s | infinite (the default): no attention term              | folded into the slope above  |
| actor_start_s         | spawn_to_start_s                                       | exactly                      |
| load_bytes_per_s      | weight bytes / all_resident_s (all weights resident    | not the overlap: the rule    |
|                       | that long after the actor starts)                      | adds load and prefill, the   |
|                       |                                                        | simulation overlaps them     |
| overhead_s, node_cpus | 0: no control-plane time, no contention between actors | exactly (neither models it)  |

So every predicted step, a join's TPOT included, is the simulated step: a join the scorer
predicts within every row's target keeps them there in the simulation too (the batch's rows
only ever slow down by the rows it holds). The TTFT predictions only rank candidates here (the
simulated requests state no TTFT target): with a TPOT target the rule predicts a joiner's
prompt fed in chunks within the target (actors/scheduler.py), while the simulation prefills it
whole after one step of the batch (sim_model.py); the ranking — an idle hot actor first, then
the batch with the fewest rows — is the same either way.
"""

from __future__ import annotations

import math

from benchmarks.sim_calibration import Calibration
from serve_app.scorer import RuleScorer


def prefill_tokens_per_s(cal: Calibration) -> float:
    """The mean prefill rate over the measured range: the hot-TTFT points' slope, first to last."""
    (x0, y0), (x1, y1) = cal.hot_ttft_points[0], cal.hot_ttft_points[-1]
    return (x1 - x0) / (y1 - y0)


def sim_scorer(cal: Calibration) -> RuleScorer:
    """The rule scorer priced with `cal` (module doc: what maps and what does not)."""
    return RuleScorer(
        prefill_tokens_per_s=prefill_tokens_per_s(cal),
        decode_s_per_token=cal.decode_s_per_token,
        load_bytes_per_s=cal.model_numbers().weight_bytes / cal.all_resident_s,
        actor_start_s=cal.spawn_to_start_s,
        batch_row_cost=cal.batch_row_cost,
        kv_read_bytes_per_s=math.inf,
        attention_pairs_per_s=math.inf,
        overhead_s=0.0,
        node_cpus=0,
    )


def rows_within(cal: Calibration, tpot_target_s: float, cap: int) -> int:
    """The most rows an actor runs with every step within `tpot_target_s`: slowdown(rows) x one-row step <= target,
    at most `cap` (0 where even one row misses it)."""
    if cal.decode_s_per_token > tpot_target_s:
        return 0
    if cal.batch_row_cost == 0:
        return cap
    rows = 1 + math.floor((tpot_target_s / cal.decode_s_per_token - 1) / cal.batch_row_cost + 1e-9)
    while rows > 1 and cal.slowdown(rows) * cal.decode_s_per_token > tpot_target_s:  # the float floor's edge
        rows -= 1
    return min(rows, cap)
