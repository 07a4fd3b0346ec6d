"""Elastic capacity under a step load, on Ray's own autoscaler: how fast refused demand becomes a node that
serves, how close refusals come to the enlarged capacity's floor, and how fast the node goes back.

The cluster is Ray's fake multi-node provider (the real autoscaler launching and ending local
raylets: tests/elastic/autoscaling_cluster.py), run by tests/elastic/elastic_scenario.py. Worker
nodes declare one `zq_slot` each; the planner keeps `--min-slots` and may ask for `--max-slots`.
The model is the synthetic `tiny` one, each actor runs one row (`max_batch 1`), so one node's
capacity is one place held for a request's service time S. Fake nodes share this machine's 2 cores,
so a row's time is device time, not host decode: the actors are tests/elastic/paced_actor.py's,
which run the real engine and hold each row 50 ms a token (S ~ 1.6 s at 32 tokens), as a GPU would
without taking the host's CPU. The load is Poisson arrivals:

    idle (--idle-before-s) -> --rate req/s for --load-s -> idle until the node is gone

The report, from the run's own figures:
  - over time (bins of --bin-s): offered, served and refused per second; slots wanted and present;
  - the time from the step's first refusal to the first request served cold on a node that joined
    for it, against the node's start (join) — goal: within the node's start + 5 s of the demand;
  - refusals once the enlarged capacity is up, against Erlang-B's floor B(c, lambda x S) for the
    c slots present and the measured mean service time S;
  - the time from the load's end to `--min-slots` slots (goal: the autoscaler's idle timeout + 30 s).

    .venv/bin/python -m benchmarks.bench_elastic                 # ~6 min: 3 min of load
    .venv/bin/python -m benchmarks.bench_elastic --report-only benchmarks/results/elastic.json
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import load_average, load_text, machine
from benchmarks.erlang import refusal_floor
from benchmarks.run_files import measure_and_report

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "tests" / "elastic" / "elastic_scenario.py"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tests.helpers import run_scenario

    scenario_args = ["--port", str(args.port), "--rate", str(args.rate), "--load-s", str(args.load_s),
                     "--idle-before-s", str(args.idle_before_s), "--max-tokens", str(args.max_tokens),
                     "--min-slots", str(args.min_slots), "--max-slots", str(args.max_slots), "--max-batch", "1",
                     "--idle-timeout-min", str(args.idle_timeout_min), "--node-start-s", str(args.node_start_s),
                     "--idle-watch-s", str(args.idle_watch_s), "--poisson", "--seed", str(args.seed), "--paced",
                     "--max-idle-s", str(args.max_idle_s)]
    load_before = load_average()
    result, tail = run_scenario(SCENARIO, scenario_args, args.load_s + args.idle_watch_s + 600)
    if result is None:
        raise RuntimeError(f"the scenario printed no result:\n{tail}")
    return {"command": "python -m benchmarks.bench_elastic " + shlex.join(sys.argv[1:]),
            "scenario_args": scenario_args, "machine": machine("ray", "torch"), "load_before": load_before,
            "load_after": load_average(), "bin_s": args.bin_s, "result": result}


def _figures(data: dict[str, Any]) -> dict[str, Any]:
    r = data["result"]
    requests, timeline = r["requests"], [t for t in r["timeline"] if "error" not in t]
    start, end = r["phases"]["load_start_s"], r["phases"]["load_end_s"]
    min_slots = int(r["args"]["min_slots"])
    served = [q for q in requests if q["status"] == 200]
    refused = [q for q in requests if q["status"] == 503]
    first_refusal = min((q["sent_s"] for q in refused), default=None)
    grown_at = next((t["t"] for t in timeline if t["t"] >= start and t["present"] > min_slots), None)
    first_new = next((q for q in sorted(served, key=lambda q: q["sent_s"] + q["took_s"])
                      if grown_at is not None and q["tier"] == "cold" and q["sent_s"] >= grown_at), None)
    top = max((t["present"] for t in timeline), default=0)
    full_at = next((t["t"] for t in timeline if t["present"] == top and t["t"] >= start), None)
    after_full = [q for q in requests if full_at is not None and full_at <= q["sent_s"] <= end]
    # A place is held from the request's arrival to its end, a cold start included: the Erlang load's S.
    mean_service_s = sum(q["took_s"] for q in served) / len(served) if served else None
    # The arrivals' own rate once every slot was up (Poisson at the nominal rate, counted): the floor's lambda.
    rate = len(after_full) / (end - full_at) if after_full and end > full_at else r["args"]["rate"]
    back_at = next((t["t"] for t in timeline if t["t"] > end and t["present"] <= min_slots
                    and t["slot_nodes"] <= min_slots), None)
    return {
        "num_requests": len(requests), "num_served": len(served), "num_refused": len(refused),
        "num_failed": sum(q["status"] not in (200, 503) or (q["status"] == 503 and q.get("error_type")
                                                             != "overloaded_error") for q in requests),
        "first_refusal_s": first_refusal, "slot_added_s": grown_at,
        "first_admitted_new_s": first_new["sent_s"] if first_new else None,
        "first_served_new_s": first_new["sent_s"] + first_new["took_s"] if first_new else None,
        "num_cold": sum(q["tier"] == "cold" for q in served),
        "max_slots_present": top, "full_at_s": full_at,
        "refused_share_after_full": (sum(q["status"] == 503 for q in after_full) / len(after_full)
                                     if after_full else None),
        "num_after_full": len(after_full),
        "mean_service_s": mean_service_s,
        "arrival_rate": rate,
        "offered_erlangs": rate * mean_service_s if mean_service_s else None,
        "floor_after_full": refusal_floor(top, rate, mean_service_s) if mean_service_s else None,
        "floor_one_node": refusal_floor(min_slots or 1, rate, mean_service_s) if mean_service_s else None,
        "back_to_min_s": back_at - end if back_at is not None else None,
        "load_start_s": start, "load_end_s": end,
    }


def _bins(data: dict[str, Any]) -> list[dict[str, Any]]:
    r, width = data["result"], data["bin_s"]
    timeline = [t for t in r["timeline"] if "error" not in t]
    last = max(t["t"] for t in timeline)
    rows = []
    for k in range(int(last // width) + 1):
        lo, hi = k * width, (k + 1) * width
        inside = [q for q in r["requests"] if lo <= q["sent_s"] < hi]
        states = [t for t in timeline if lo <= t["t"] < hi] or [max((t for t in timeline if t["t"] < lo),
                                                                    key=lambda t: t["t"])]
        rows.append({"t": lo, "offered": len(inside) / width,
                     "served": sum(q["status"] == 200 for q in inside) / width,
                     "refused": sum(q["status"] == 503 for q in inside) / width,
                     "wanted": max(t["wanted"] for t in states), "present": max(t["present"] for t in states),
                     "nodes": max(t["slot_nodes"] for t in states)})
    return rows


def _plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, f = _bins(data), _figures(data)
    t = [row["t"] for row in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for key in ("offered", "served", "refused"):
        top.step(t, [row[key] for row in rows], where="post", label=f"{key} req/s")
    top.set_ylabel("requests / s")
    top.legend(loc="upper right")
    timeline = [x for x in data["result"]["timeline"] if "error" not in x]
    for key, label in (("wanted", "slots wanted"), ("present", "slots present"), ("slot_nodes", "worker nodes")):
        bottom.step([x["t"] for x in timeline], [x[key] for x in timeline], where="post", label=label)
    bottom.set_ylabel("slots / nodes")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper right")
    for ax in (top, bottom):
        ax.axvspan(f["load_start_s"], f["load_end_s"], color="0.9", zorder=0)
    fig.suptitle("Step load on Ray's fake autoscaling cluster (grey: the load)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def report(data: dict[str, Any]) -> str:
    f, a = _figures(data), data["result"]["args"]
    _plot(data, Path(data.get("plot", "benchmarks/results/elastic.png")))

    def s(x: float | None, fmt: str = ".1f") -> str:
        return "n/a" if x is None else format(x, fmt)

    idle_timeout_s = a["idle_timeout_min"] * 60
    join_s = (f["slot_added_s"] - f["first_refusal_s"]) if f["slot_added_s"] and f["first_refusal_s"] else None
    admit_s = (f["first_admitted_new_s"] - f["first_refusal_s"]) if f["first_admitted_new_s"] else None
    serve_s = (f["first_served_new_s"] - f["first_refusal_s"]) if f["first_served_new_s"] else None
    m = data["machine"]
    lines = [
        "# Elastic capacity: a step load on Ray's autoscaler",
        "",
        f"`{data['command']}` — {m.get('cpu', '?')}, {m.get('cores', '?')} cores; load average before "
        f"{load_text(data['load_before'])}, after {load_text(data['load_after'])}; nothing else of ours ran.",
        "",
        f"Ray's fake multi-node provider (real autoscaler, worker nodes are local raylets on this same machine), "
        f"one `zq_slot` per worker node, min_slots {a['min_slots']}, max_slots {a['max_slots']}; the `tiny` "
        f"synthetic model, one row per actor, max_tokens {a['max_tokens']}; Poisson arrivals at {a['rate']} req/s "
        f"for {a['load_s']:.0f} s after {a['idle_before_s']:.0f} s idle; the planner's node_start_s "
        f"{a['node_start_s']}, demand window {a.get('demand_window_s', 5.0):g} s, scale-down delay "
        f"{a.get('scale_down_delay_s', 5.0):g} s; "
        f"max_idle_s {a['max_idle_s']:g} s; rows paced at 50 ms a "
        f"token (device time, paced_actor.py); the autoscaler's idle "
        f"timeout {idle_timeout_s:.0f} s.",
        "",
        "![step load](elastic.png)",
        "",
        "| figure | measured | goal |",
        "|---|---|---|",
        f"| requests: served / refused (503) / failed otherwise | {f['num_served']} / {f['num_refused']} / "
        f"{f['num_failed']} | no failure but a documented 503 |",
        f"| mean service time S (arrival to last token of the served; {f['num_cold']} of them cold starts) | "
        f"{s(f['mean_service_s'], '.3f')} s | |",
        f"| offered load A = arrivals x S (arrivals once every slot was up: {s(f['arrival_rate'], '.2f')} "
        f"req/s) | {s(f['offered_erlangs'], '.2f')} Erlangs (one node: 1 place) | 2x one node |",
        f"| first refusal of the step → a slot added (node joined, slot in the registry) | {s(join_s)} s | |",
        f"| first refusal → first admission on the new slot | {s(admit_s)} s | node start + 5 s "
        f"= {s(join_s + 5 if join_s is not None else None)} s |",
        f"| first refusal → that request's last token (the actor's cold start on it) | {s(serve_s)} s | |",
        f"| refused once {f['max_slots_present']} slots were up ({f['num_after_full']} requests) | "
        f"{s(100 * f['refused_share_after_full'] if f['refused_share_after_full'] is not None else None)}% | "
        f"Erlang-B floor {s(100 * f['floor_after_full'] if f['floor_after_full'] is not None else None)}% "
        f"(one node: {s(100 * f['floor_one_node'] if f['floor_one_node'] is not None else None)}%) |",
        f"| load end → back to min_slots ({a['min_slots']}) | {s(f['back_to_min_s'])} s | idle timeout + 30 s "
        f"= {idle_timeout_s + 30:.0f} s |",
        "",
        "S is what a client measured, arrival to last token: a little longer than the registry holds the "
        "place (from the admission, after parsing and tokenizing, to the row's end), so the floor computed "
        "from it is a little high; and a share of "
        f"{f['num_after_full']} Poisson arrivals has a standard error of about "
        f"{s(100 * ((f['floor_after_full'] or 0) * (1 - (f['floor_after_full'] or 0)) / max(1, f['num_after_full'])) ** 0.5)}"
        " points at the floor. The demand window and scale-down delay are 5 s each so that the run is "
        "short: the plan moves with the Poisson load's lulls (the dips of slots wanted), and a deployment "
        "sets them to minutes.",
        "",
        f"Over time ({data['bin_s']:.0f} s bins; slots and nodes: the most seen in the bin):",
        "",
        "| t (s) | offered /s | served /s | refused /s | slots wanted | slots present | worker nodes |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['t']:.0f} | {r['offered']:.2f} | {r['served']:.2f} | {r['refused']:.2f} | {r['wanted']} | "
              f"{r['present']} | {r['nodes']} |" for r in _bins(data)]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 2x one node's capacity: one place held S = 32 x 50 ms = 1.6 s serves 0.625 req/s.
    parser.add_argument("--rate", type=float, default=1.25)
    parser.add_argument("--load-s", type=float, default=180.0)
    parser.add_argument("--idle-before-s", type=float, default=15.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-slots", type=int, default=1)
    parser.add_argument("--max-slots", type=int, default=4)
    parser.add_argument("--idle-timeout-min", type=float, default=0.25)
    parser.add_argument("--node-start-s", type=float, default=5.0)
    parser.add_argument("--idle-watch-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-idle-s", type=float, default=10.0)
    parser.add_argument("--port", type=int, default=8773)
    parser.add_argument("--bin-s", type=float, default=10.0)
    parser.add_argument("--out", default="benchmarks/results/elastic.md")
    parser.add_argument("--report-only", metavar="RUN_JSON")
    return measure_and_report(parser.parse_args(), measure, report)


if __name__ == "__main__":
    sys.exit(main())
