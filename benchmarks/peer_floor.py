"""bench_peer's refusal floor: the Erlang-B floor of the places zeroqueue's latency targets allow.

Issue 23 asks that, driven by GuideLLM, zeroqueue refuse no more than "the Erlang-B floor of the
places the targets allow + 2 points". Per rate:

- places c: the most rows the app could run at once with every row of this profile (GuideLLM's
  mean prompt and output tokens) predicted within the default targets, priced as the app prices a
  join (serve_app/scorer.py's rule with `configs/serve.yaml`'s constants and the step correction
  the router priced that rate's admissions at, P50 from the traces: how many times the rule's
  time the engine's steps took, beside the load generator, at its thread count): the largest
  batch a newcomer joins with TTFT and TPOT predicted within their targets (no prompt pending
  ahead of it, and no TTFT margin: the most generous reading), at most `max_batch`, times the
  actors that may hold batches (the hot ones and the warm ones a burst binds). A place is a row, as a server without a queue counts it.
- offered load A = rate x the mean time a served request held its row (GuideLLM's request
  latency, arrival to last token): what the rows were held for at that rate.
- floor = B(c, A) (benchmarks/erlang.py): what a system with c places and no queue refuses of
  Poisson arrivals at least. GuideLLM's constant rate is smoother than Poisson, so a little less
  is possible; the floor is a reference, not a bound.

Erlang-B counts places, not CPU: c rows that the targets allow on paper may be more than the
host's cores can step within them once the arrivals' prompts take their share. So beside it,
the capacity floor: 1 - X / rate, X = the engines that compute side by side (one a CPU slot that keeps a
hot actor) / the engine seconds one request takes in a full batch of c rows (the rule times the same
correction: its prompt, and its share of its decode steps). The correction is what the steps took at
the threads they had, so two engines on a core each count their own one-thread speed. No admission
policy completes more than X a second on these cores, so none refuses less than that.
What zeroqueue refuses beyond it is its admission's margin (a TTFT target is a tail's, and a
batch near capacity has prompts queued ahead of a joiner's) and what the engines did not use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks.cpu_share import shares_of_cores
from benchmarks.erlang import erlang_b
from serve_app.policy import meets_targets
from serve_app.scorer import Candidate, RuleScorer
from serve_app.snapshot import RequestFeatures


def places_per_actor(rule: RuleScorer, features: RequestFeatures, max_batch: int, step_correction: float) -> int:
    """The largest batch (rows) whose newest row is predicted within the request's TTFT and TPOT targets."""
    best = 1
    for rows in range(1, max_batch):  # joining a batch of `rows` makes rows + 1
        join = Candidate("join", "s", "a", 1 << 40, 1, 0.0, 0.0, batch_rows=rows,
                         batch_tokens=rows * features.num_tokens, batch_tpot_target_s=features.tpot_target_s,
                         step_correction=step_correction)
        [p] = rule.predict(features, [join])
        if not meets_targets(features, p, features.tpot_target_s):
            break
        best = rows + 1
    return best


def floor_model(args: dict[str, Any]) -> dict[str, Any]:
    """What `floor_row` needs of the app's config (the `make serve` args) and model, kept in the run's JSON."""
    from serve_app.config import AppArgs, ingress_config
    from serve_app.loaded_model import load_model

    config = ingress_config(AppArgs.model_validate(args))
    kv_bytes_per_token = load_model(config.models[0], config.actor).numbers.kv_bytes_per_token  # as actors compute
    model, policy = config.models[0], config.policy  # as the app parsed them, defaults included
    return {"rule": dataclasses.asdict(config.rule_scorer),
            "ttft_target_s": model.ttft_target_s, "tpot_target_s": model.tpot_target_s,
            "max_batch": policy.max_batch, "num_actors": policy.max_hot_short_actors + policy.num_warm_short_actors,
            "num_engines": max(1, min(config.slots.num_cpu_slots, policy.max_hot_short_actors)),
            "kv_bytes_per_token": kv_bytes_per_token}


def engine_s_per_request(rule: RuleScorer, features: RequestFeatures, rows: int, step_correction: float) -> float:
    """Engine seconds one request of the profile takes in a full batch of `rows` (the rule, times the correction):
    its prompt beyond the weights' pass, and its share of each of its decode steps."""
    decode = rule.step_s(rows, rows * features.num_tokens, features.kv_bytes_per_token) / rows
    return step_correction * ((features.input_tokens - 1) / rule.prefill_tokens_per_s + features.max_tokens * decode)


def floor_row(model: dict[str, Any], rate: float, row: dict[str, Any]) -> dict[str, Any] | None:
    """Places, offered load, Erlang-B floor and capacity floor at one rate (module doc); None where the run kept
    too little."""
    if not row.get("hold_mean_s") or not row.get("prompt_tokens_mean"):
        return None
    # The router's step correction as it priced this rate's admissions (traces); unknown in runs before it was kept.
    correction = (row.get("traces") or {}).get("step_correction_p50")
    features = RequestFeatures("m", round(row["prompt_tokens_mean"]), round(row["output_tokens_mean"]), 0,
                               model["kv_bytes_per_token"], 0, ttft_target_s=model["ttft_target_s"],
                               tpot_target_s=model["tpot_target_s"])
    rule = RuleScorer(**model["rule"])
    per_actor = places_per_actor(rule, features, model["max_batch"], correction or 1.0)
    places = per_actor * model["num_actors"]
    offered = rate * row["hold_mean_s"]
    engines = num_engines(model)
    capacity = None if correction is None else engines / engine_s_per_request(rule, features, per_actor, correction)
    return {"places": places, "per_actor": per_actor, "step_correction": correction, "offered_erlangs": offered,
            "floor": erlang_b(places, offered), "capacity_per_s": capacity,
            "capacity_floor": None if capacity is None else max(0.0, 1.0 - capacity / rate),
            "refused": row["failed"] / row["sent"] if row["sent"] else 0.0}


def num_engines(model: dict[str, Any]) -> int:
    """The engines the floor model counts: one for a run kept from before it counted them (one slot, one engine)."""
    return model.get("num_engines", 1)


def report_lines(data: dict[str, Any], num_cores: int) -> list[str]:
    """The floor table for zeroqueue's rates; `num_cores`: the machine the run measured on, for the engines' share."""
    zq, model = data["servers"].get("zeroqueue"), data.get("floor_model")
    if not zq or not model:
        return []
    lines = ["## zeroqueue's refusals against the Erlang-B floor of the places its targets allow", "",
             "benchmarks/peer_floor.py: places c = rows per actor a newcomer of this profile is predicted to join "
             f"within TTFT {model['ttft_target_s']:g} s and TPOT {model['tpot_target_s']:g} s (the rule at the "
             f"router's step correction, P50 over the rate's admissions), at most max_batch {model['max_batch']}, times "
             f"{model['num_actors']} actors (hot and warm); A = rate x the mean time a served request held its row "
             "(GuideLLM's request latency). Issue 23's goal: refused <= B(c, A) + 2 points. Beside it the capacity "
             "floor, 1 - X / rate: X = the requests a second its "
             f"{num_engines(model)} engine(s) complete side by side at that correction, every request in a "
             "full batch (the rule's engine seconds a request), what no admission policy can beat on these cores.",
             "",
             "| rate (req/s) | step correction P50 | places c | hold (s) | A (Erlangs) | Erlang-B floor | capacity X "
             "(req/s) | capacity floor | refused | beyond the Erlang-B floor | beyond the capacity floor | "
             "engines' share of the cores | goal |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for rate in data["rates"]:
        row = zq.get(f"{rate:g}")
        f = floor_row(model, rate, row) if row else None
        if f is None:
            continue
        engines = shares_of_cores(row["cpu"], num_cores).get("engines") if row.get("cpu") else None
        share = f"{engines:.0%}" if engines else "—"
        beyond = f["refused"] - f["floor"]
        if f["step_correction"] is None:  # a run from before the traces kept it
            correction = capacity = capacity_floor = beyond_capacity = "—"
        else:
            correction, capacity = f"{f['step_correction']:.2f}", f"{f['capacity_per_s']:.2f}"
            capacity_floor = f"{f['capacity_floor']:.1%}"
            beyond_capacity = f"{(f['refused'] - f['capacity_floor']) * 100:+.1f} pts"
        lines.append(f"| {rate:g} | {correction} | {f['places']} | {row['hold_mean_s']:.2f} | "
                     f"{f['offered_erlangs']:.1f} | {f['floor']:.1%} | {capacity} | {capacity_floor} | "
                     f"{f['refused']:.1%} | {beyond * 100:+.1f} pts | {beyond_capacity} | {share} | "
                     f"{'met' if beyond <= 0.02 else '**missed**'} |")
    return lines
