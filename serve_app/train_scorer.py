"""Train the XGBoost scorer on request traces and report its held-out accuracy.

    python -m serve_app.train_scorer TRACES... -o configs/scorer.ubj [--report benchmarks/results/scorer_eval.md]

Rows are the admitted requests (dispatched, joined, bound to a warm actor or spawned) that completed (`ok`) with
a measured TTFT, total and TPOT; features are built by `xgb_scorer.feature_matrix` from
the trace's features and chosen candidate (the very code the ingress runs per request),
targets are log TTFT, log total and log TPOT seconds. A seeded split holds out
`--test-fraction` of the rows; the number of boosting rounds is chosen by early stopping
on a validation slice of the training rows, and the model is then fit on all training
rows. The model is saved (UBJSON + card), loaded back through `XGBScorer`, and evaluated
through its `predict`, exactly as requests will see it.

Requests without a TPOT. A completed request with fewer than 2 output tokens has no
measured TPOT (no step after its first token was timed). Its row is left out for all
three targets, and the report says how many. It is not filled in: XGBoost takes no
missing labels, the rule's TPOT is a placeholder constant, and any filled-in value would
teach the trees a step time nobody measured — while TPOT is the figure a join is refused
on, to keep the rows already running within their targets. Little is lost: such requests
are a small share (max_tokens 1, or an end-of-sequence at once), and their TTFT depends on
the same columns as everyone else's, which the other rows cover.

Traces of another schema version ("zq-trace/1": recorded before hot actors ran batches)
are skipped by `read_traces` with a warning; when too few rows are left, the error says
how many such lines there were.

Held-out report, for the XGBoost scorer and the rule beside it:
- MAE (seconds) and R² of TTFT, of total time and of TPOT;
- hindsight share: see `hindsight`;
- target agreement: for a target T, the share of held-out requests where "predicted
  within T" equals "measured within T" — how often a latency target would have admitted
  or refused the request correctly. T is each quartile of the held-out measurements.
"""

from __future__ import annotations

import argparse
import logging
import math
import platform
import random
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from serve_app.scorer import RULE_SCORER, Candidate, Scorer
from serve_app.snapshot import RequestFeatures
from serve_app.traces import read_traces
from serve_app.xgb_scorer import (
    FEATURE_NAMES,
    TARGETS,
    ScorerCard,
    XGBScorer,
    card_path,
    feature_matrix,
    save_model,
)

log = logging.getLogger(__name__)

PARAMS = {"objective": "reg:squarederror", "tree_method": "hist", "max_depth": 4, "eta": 0.1,
          "min_child_weight": 2, "subsample": 0.9, "nthread": 1}
MAX_ROUNDS = 150  # fewer trees, faster requests; early stopping usually stops well before
MEASURED = tuple(t.removeprefix("log_") for t in TARGETS)  # ttft_s, total_s, tpot_s: a Sample's fields
ADMITTED = ("dispatch", "join", "bind", "spawn")
KINDS = ("hot", "join", "warm", "cold")  # decide's candidate order: on a tie the earlier kind wins


@dataclass(frozen=True)
class Sample:
    features: RequestFeatures
    candidate: Candidate
    ttft_s: float
    total_s: float
    tpot_s: float


def samples(records, without_tpot: Counter | None = None) -> list[Sample]:
    """The trainable rows of trace records: completed admitted requests with all three timings.

    Completed requests left out for want of a TPOT (see the module docstring) are counted
    in `without_tpot`, by the kind of candidate they ran on.
    """
    out = []
    for r in records:
        decision, outcome = r.get("decision") or {}, r.get("outcome") or {}
        if decision.get("kind") not in ADMITTED or not outcome.get("ok"):
            continue
        ttft, total, candidate = outcome.get("ttft_s"), outcome.get("total_s"), decision.get("candidate")
        if candidate is None or ttft is None or total is None or not 0 < ttft <= total:
            continue
        tpot = outcome.get("tpot_s")
        if tpot is None or not tpot > 0:
            if without_tpot is not None:
                without_tpot[str(candidate.get("kind"))] += 1
            continue
        try:
            features = RequestFeatures(model=r["model"], **r["features"])
            out.append(Sample(features, Candidate(**candidate), float(ttft), float(total), float(tpot)))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def split(rows: Sequence[Sample], test_fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    num_test = max(1, round(len(rows) * test_fraction))
    return [rows[i] for i in order[num_test:]], [rows[i] for i in order[:num_test]]


def design(rows: Sequence[Sample]) -> tuple[np.ndarray, np.ndarray]:
    x = np.concatenate([feature_matrix(s.features, [s.candidate]) for s in rows])
    y = np.log(np.array([[getattr(s, m) for m in MEASURED] for s in rows], dtype=np.float64))
    return x, y


def train(rows: Sequence[Sample], seed: int):
    """A multi-output booster; rounds chosen by early stopping on 20% of `rows`."""
    import xgboost as xgb

    fit, val = split(rows, 0.2, seed + 1)
    params = PARAMS | {"seed": seed}
    x_fit, y_fit = design(fit)
    x_val, y_val = design(val)
    names = list(FEATURE_NAMES)
    probe = xgb.train(params, xgb.DMatrix(x_fit, y_fit, feature_names=names), MAX_ROUNDS,
                      evals=[(xgb.DMatrix(x_val, y_val, feature_names=names), "val")],
                      early_stopping_rounds=15, verbose_eval=False)
    num_rounds = probe.best_iteration + 1
    x, y = design(rows)
    return xgb.train(params, xgb.DMatrix(x, y, feature_names=names), num_rounds), num_rounds


# ---------------------------------------------------------------- evaluation


def predict_chosen(scorer: Scorer, rows: Sequence[Sample]) -> np.ndarray:
    """(ttft, total, tpot) predicted for each row's own candidate."""
    return np.array([[getattr(p, m) for m in MEASURED]
                     for s in rows for p in scorer.predict(s.features, [s.candidate])]).reshape(len(rows), len(MEASURED))


def accuracy(pred: np.ndarray, rows: Sequence[Sample]) -> dict[str, dict[str, float]]:
    out = {}
    for j, target in enumerate(MEASURED):
        y = np.array([getattr(s, target) for s in rows])
        residual = float(np.sum((y - pred[:, j]) ** 2))
        spread = float(np.sum((y - y.mean()) ** 2))
        out[target] = {"mae": float(np.mean(np.abs(y - pred[:, j]))),
                       "r2": 1.0 - residual / spread if spread > 0 else float("nan")}
    return out


def shape_of(s: Sample) -> tuple[int, int]:
    """Power-of-four buckets of input tokens and of max_tokens (1-3, 4-15, 16-63, ...)."""
    return int(math.log(s.features.input_tokens, 4) + 1e-9), int(math.log(s.features.max_tokens, 4) + 1e-9)


def as_kind(candidate: Candidate, kind: str, groups: dict[str, list[Sample]]) -> Candidate:
    """The recorded candidate as `kind`: an idle, a warm or a fresh actor has no batch; a join
    enters the median batch that requests of this shape joined, a warm actor holds the median
    share of its weights that the warm actors they were bound to held (`groups`, by kind)."""
    if kind == candidate.kind:
        return candidate
    if kind == "join":
        joined = groups["join"]
        return replace(candidate, kind=kind, resident_fraction=1.0,
                       batch_rows=round(statistics.median(s.candidate.batch_rows for s in joined)),
                       batch_tokens=round(statistics.median(s.candidate.batch_tokens for s in joined)))
    resident = {"hot": 1.0, "cold": 0.0}.get(kind)
    if resident is None:
        resident = statistics.median(s.candidate.resident_fraction for s in groups["warm"])
    return replace(candidate, kind=kind, batch_rows=0, batch_tokens=0, resident_fraction=resident)


def hindsight(scorer: Scorer, held_out: Sequence[Sample], measured: Sequence[Sample]) -> tuple[float, int, int]:
    """The share of held-out requests whose fastest-ranked kind is the kind measured fastest for their shape.

    Kinds are hot (an idle hot actor), join (a row of a busy hot actor's batch), warm (a
    bound warm actor) and cold.
    For each held-out request, the scorer predicts (TTFT, total) for the request's own
    features on one candidate per kind measured for its shape (its recorded candidate with
    the kind set, see `as_kind`) and ranks them as `decide` does: lower TTFT, then lower
    total, then hot, join, warm, cold. Hindsight's choice is the kind with the lowest
    median measured TTFT (then total) over every traced request of the same shape
    (`shape_of`) — every request, since the trace of one request measures only the kind it
    ran on. Requests whose shape was measured on one kind only are left out. Returns
    (share, requests compared, requests left out).
    """
    by_kind: dict[tuple[tuple[int, int], str], list[Sample]] = {}
    for s in measured:
        by_kind.setdefault((shape_of(s), s.candidate.kind), []).append(s)

    def median_key(group: list[Sample]) -> tuple[float, float]:
        return statistics.median(s.ttft_s for s in group), statistics.median(s.total_s for s in group)

    matches = compared = 0
    for s in held_out:
        groups = {k: by_kind[(shape_of(s), k)] for k in KINDS if (shape_of(s), k) in by_kind}
        if len(groups) < 2:
            continue
        kinds = list(groups)  # in KINDS order, so min() keeps decide's tie order
        truth = min(kinds, key=lambda k: median_key(groups[k]))
        predicted = scorer.predict(s.features, [as_kind(s.candidate, k, groups) for k in kinds])
        choice = kinds[min(range(len(kinds)), key=lambda i: (predicted[i].ttft_s, predicted[i].total_s))]
        compared += 1
        matches += choice == truth
    return (matches / compared if compared else float("nan")), compared, len(held_out) - compared


def target_agreement(pred: np.ndarray, rows: Sequence[Sample]) -> list[tuple[str, float, float]]:
    """(target, T, share) for T at each quartile of the held-out measurements (see the module doc)."""
    out = []
    for j, target in enumerate(MEASURED):
        y = np.array([getattr(s, target) for s in rows])
        for q in (25, 50, 75):
            t = float(np.percentile(y, q))
            out.append((f"{target} p{q}", t, float(np.mean((pred[:, j] <= t) == (y <= t)))))
    return out


def evaluate(scorer: Scorer, held_out: Sequence[Sample], measured: Sequence[Sample]) -> dict:
    pred = predict_chosen(scorer, held_out)
    share, compared, left_out = hindsight(scorer, held_out, measured)
    return {"accuracy": accuracy(pred, held_out), "hindsight_share": share, "hindsight_compared": compared,
            "hindsight_left_out": left_out, "target_agreement": target_agreement(pred, held_out)}


# ---------------------------------------------------------------- report


def report_markdown(command: str, traces: Sequence[str], rows: Sequence[Sample], num_records: int,
                    train_rows: int, num_rounds: int, xgb_eval: dict, rule_eval: dict, seed: int,
                    importance: dict[str, float], note: str = "", without_tpot: Counter | None = None,
                    skipped: Counter | None = None) -> str:
    kinds = Counter(s.candidate.kind for s in rows)
    untimed = sum((without_tpot or Counter()).values())
    other_versions = {k: v for k, v in (skipped or Counter()).items() if k.startswith("zq-trace/")}
    lines = [
        "# Scorer: held-out evaluation", "",
        f"Command: `{command}`", "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.machine()}, "
        f"Python {platform.python_version()}; training is single-threaded and takes seconds."
        + (f" {note}" if note else ""), "",
        "Traces are what the running system records (`serve_app/traces.py`); the committed ones come from "
        "`benchmarks/gen_traces.py` (command in `benchmarks/traces/README.md`).", "",
        f"Traces: {', '.join(f'`{t}`' for t in traces)}: {num_records} records, {len(rows)} completed admitted "
        f"requests ({', '.join(f'{kinds[k]} {k}' for k in KINDS)})"
        + (f"; {untimed} more completed with fewer than 2 output tokens and are left out (no TPOT measured)"
           if untimed else "")
        + (f"; {', '.join(f'{n} {k} lines' for k, n in sorted(other_versions.items()))} skipped (another "
           "version of the app)" if other_versions else "")
        + f". Seeded split (seed {seed}): {train_rows} training rows, {len(rows) - train_rows} held out. Model: "
        f"one multi-output booster (targets log TTFT, log total and log TPOT), {num_rounds} rounds (early "
        f"stopping on 20% of the training rows), depth {PARAMS['max_depth']}, eta {PARAMS['eta']}.", "",
        "## Accuracy on the held-out requests", "",
        "TTFT and total are seconds from the request's arrival at the ingress; TPOT is seconds per output token "
        "after the first, (last token − first token) / (output tokens − 1), which for a row of a batch is the "
        "batch's step time as that row saw it. The rule is `RuleScorer`'s placeholder constants.", "",
        "| target | XGBoost MAE s | XGBoost R² | rule MAE s | rule R² |", "|---|--:|--:|--:|--:|",
    ]
    for target in MEASURED:
        x, r = xgb_eval["accuracy"][target], rule_eval["accuracy"][target]
        digits = 4 if target == "tpot_s" else 3
        lines.append(f"| {target} | {x['mae']:.{digits}f} | {x['r2']:.3f} | {r['mae']:.{digits}f} | {r['r2']:.3f} |")
    lines += [
        "", "## Hindsight share", "",
        "For each held-out request the scorer predicts (TTFT, total) on one candidate per kind — an idle hot "
        "actor, a row joining a busy hot actor's batch, a bound warm actor, a fresh actor — among the kinds "
        "measured for the request's shape: the request's own features and recorded slot statistics with the kind "
        "set (no batch for hot, warm and cold; for a join, the median batch that requests of this shape joined; "
        "for a warm actor, the median share of weights the bound warm actors held). It ranks them as "
        "`decide` does. Hindsight's choice is the kind with the lowest median *measured* TTFT (then total) over "
        "every traced request of the same shape (power-of-four buckets of input tokens and of max_tokens: 1–3, "
        "4–15, 16–63, …); a trace measures only the kind its request ran on, so the other kinds' times come "
        "from requests of the same shape. Requests whose shape was measured on one kind only are left out.", "",
        "| scorer | share matching hindsight | requests compared | left out |", "|---|--:|--:|--:|",
        f"| XGBoost | {xgb_eval['hindsight_share']:.3f} | {xgb_eval['hindsight_compared']} | "
        f"{xgb_eval['hindsight_left_out']} |",
        f"| rule | {rule_eval['hindsight_share']:.3f} | {rule_eval['hindsight_compared']} | "
        f"{rule_eval['hindsight_left_out']} |",
        "", "## Target agreement", "",
        "For a target T, the share of held-out requests for which \"predicted within T\" equals \"measured "
        "within T\": how often a latency target would have admitted or refused the request correctly (for "
        "TPOT, a join refused to keep a running row within its target).", "",
        "| target at | T s | XGBoost | rule |", "|---|--:|--:|--:|",
    ]
    for (name, t, share), (_, _, rule_share) in zip(xgb_eval["target_agreement"], rule_eval["target_agreement"],
                                                    strict=True):
        lines.append(f"| {name} | {t:.4f} | {share:.3f} | {rule_share:.3f} |")
    lines += ["", "## Feature importance (total gain)", "", "| feature | gain |", "|---|--:|"]
    lines += [f"| {name} | {gain:.1f} |" for name, gain in sorted(importance.items(), key=lambda kv: -kv[1])]
    unused = [n for n in FEATURE_NAMES if n not in importance]
    if unused:
        lines += ["", f"Never split on: {', '.join(unused)} (constant in these traces, or no help)."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.train_scorer", description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="trace files (JSON lines, serve_app/traces.py)")
    parser.add_argument("-o", "--output", required=True, help="model file, *.ubj (its card goes beside it)")
    parser.add_argument("--report", help="write the held-out report (markdown) here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-fraction", type=float, default=0.25)
    parser.add_argument("--min-rows", type=int, default=40)
    parser.add_argument("--note", default="", help="a sentence for the report (e.g. how the traces were made)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    skipped, without_tpot = Counter(), Counter()
    records = list(read_traces(args.traces, skipped))
    rows = samples(records, without_tpot)
    if len(rows) < args.min_rows:
        other = ", ".join(f"{n} {k} lines" for k, n in sorted(skipped.items()) if k.startswith("zq-trace/"))
        log.error("%d trainable rows in %d records; at least %d are needed%s", len(rows), len(records),
                  args.min_rows, f" ({other} skipped: record traces with this version of the app)" if other else "")
        return 1
    train_rows, held_out = split(rows, args.test_fraction, args.seed)
    booster, num_rounds = train(train_rows, args.seed)
    training = {"traces": [Path(t).name for t in args.traces], "num_rows": len(train_rows), "seed": args.seed,
                "num_rounds": num_rounds, "params": PARAMS, "left_out_without_tpot": sum(without_tpot.values())}
    save_model(booster, args.output, ScorerCard(sha256="", training=training))
    scorer = XGBScorer.from_file(args.output)
    xgb_eval, rule_eval = evaluate(scorer, held_out, rows), evaluate(RULE_SCORER, held_out, rows)
    card = replace(scorer.card, held_out={"num_rows": len(held_out), "hindsight_share": xgb_eval["hindsight_share"]}
                   | {m: xgb_eval["accuracy"][m] for m in MEASURED})
    card_path(args.output).write_text(card.to_json())  # same model bytes, same hash: only the figures added
    importance = booster.get_score(importance_type="total_gain")
    command = "python -m serve_app.train_scorer " + shlex.join(sys.argv[1:] if argv is None else argv)
    text = report_markdown(command, args.traces, rows, len(records), len(train_rows), num_rounds, xgb_eval,
                           rule_eval, args.seed, importance, args.note, without_tpot, skipped)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
