"""The chaos soak's tally, goals and report (benchmarks/soak.py runs it). Pure: no Ray, no HTTP, no clock.

How each request ended is soak_endings.py's; this module counts the endings, reads the end
state (leaked reservations, orphan actors) and the witness replica's memory, judges the goals
and writes benchmarks/results/soak.md.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import was_busy
from benchmarks.soak_endings import COMPLETE, ENDINGS, ERROR, NONE, OVERFLOW, classify

MAX_RSS_GROWTH = 0.10  # the ingress replica's resident memory, end of load over start


# ---- the end state, the replicas' memory, the goals -----------------------------------------


def end_state(registry: list[dict[str, Any]] | None, alive_before: list[str], alive_after: list[str],
              registry_error: str | None = None) -> dict[str, Any]:
    """Leaked reservations and orphan actors, from the registry's actors (`name`, `rows`) and the alive
    request actors listed just before and just after its snapshot.

    Leaked: a row still reserved (no request of the soak is running any more). Orphans: an actor alive in
    both listings that the registry does not know, and one the registry lists that is in neither.
    `registry` None: it could not be read (`registry_error`), so nothing reserves any alive actor.
    """
    alive = set(alive_before) & set(alive_after)
    if registry is None:
        return {"registry": registry_error or "unreadable", "leaked_rows": None, "leaked_actors": [],
                "orphans_alive": sorted(alive), "orphans_registered": [], "orphans": len(alive)}
    known = {a["name"] for a in registry}
    leaked = [a for a in registry if a.get("rows", 0) > 0]
    orphans_alive = sorted(alive - known)
    ghosts = sorted(known - set(alive_before) - set(alive_after))
    return {"registry": "read", "leaked_rows": sum(a["rows"] for a in leaked),
            "leaked_actors": sorted(f"{a['name']} ({a.get('state')}, {a['rows']} rows)" for a in leaked),
            "orphans_alive": orphans_alive, "orphans_registered": ghosts,
            "orphans": len(orphans_alive) + len(ghosts)}


def rss_growth(rss: dict[str, Any]) -> tuple[float | None, str]:
    """(growth, how it was measured) of the ingress: the witness replica (never killed) from the start
    of load to its end; without one, the most any replica alive at both ends grew."""
    w = rss.get("witness")
    if w and w.get("start") and w.get("end"):
        return w["end"] / w["start"] - 1, f"replica {w['name']} (spared by the chaos), pid {w['pid']}"
    start, end = rss.get("start", {}), rss.get("end", {})
    both = [k for k in start if k in end and start[k]]
    if not both:
        return None, "no ingress replica was alive at both the start and the end of the load"
    worst = max(both, key=lambda k: end[k] / start[k])
    return end[worst] / start[worst] - 1, f"replica {worst}, the most grown of {len(both)} alive at both ends"


@dataclass(frozen=True)
class Goal:
    name: str
    target: str
    figure: str
    met: bool | None  # None: not measured


REGISTRY_REFUSAL = "the admission registry is unavailable"
MAX_REGISTRY_REFUSAL_S = 0.25  # the goal: every admission answered within it while the registry is lost


def refusal_latencies(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Client-seen seconds (send to end) of each 503 refusal, by its message with ids blanked."""
    out: dict[str, list[float]] = {}
    for rec in records:
        if rec.get("status") == 503 and classify(rec).kind == ERROR:
            out.setdefault(_generic(_error_message(rec)), []).append(rec["end"] - rec["sent"])
    return out


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def judge(counts: dict[str, Any], end: dict[str, Any], growth: float | None,
          refusals: dict[str, list[float]] | None = None) -> list[Goal]:
    n500, n_none, sent = counts["http_500"], counts["endings"].get(NONE, 0), counts["sent"]
    leaked, orphans = end["leaked_rows"], end["orphans"]
    if leaked is None:
        fig3, met3 = f"registry not read ({end['registry']}); {orphans} alive request actors unaccounted", False
    else:
        fig3, met3 = f"{leaked} leaked rows, {orphans} orphan actors", leaked == 0 and orphans == 0
    return [
        Goal("0 HTTP 500s", "0", f"{n500} of {sent} ({counts['http_500_documented']} with the documented body)",
             n500 == 0),
        Goal("0 requests without an ending", "0", f"{n_none} of {sent}", n_none == 0),
        Goal("0 leaked reservations or orphan actors 5 s after the load stops", "0", fig3, met3),
        Goal("ingress RSS growth ≤ 10%", "≤ 10%", "not measured" if growth is None else f"{growth:+.1%}",
             None if growth is None else growth <= MAX_RSS_GROWTH),
        _registry_goal([x for m, xs in (refusals or {}).items() if m.startswith(REGISTRY_REFUSAL) for x in xs]),
    ]


def _registry_goal(xs: list[float]) -> Goal:
    name = f"registry lost: every admission answered within {MAX_REGISTRY_REFUSAL_S:g} s (503, retry-after)"
    if not xs:
        return Goal(name, f"≤ {MAX_REGISTRY_REFUSAL_S:g} s", "no such refusal", None)
    figure = (f"{len(xs)} refusals, client-seen p50 {_quantile(xs, 0.5):.3f} s, p99 {_quantile(xs, 0.99):.3f} s, "
              f"max {max(xs):.3f} s")
    return Goal(name, f"≤ {MAX_REGISTRY_REFUSAL_S:g} s", figure, max(xs) <= MAX_REGISTRY_REFUSAL_S)


def tally(records: list[dict[str, Any]], kills: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """Counts by ending; the reasons for `none`, each with an example and the kills made while those requests
    were in flight; errors by type and message; HTTP 500s."""
    endings: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    examples: dict[str, str] = {}
    during: dict[str, Counter[str]] = {}
    errors: Counter[str] = Counter()
    n500 = n500_doc = 0
    for rec in records:
        e = classify(rec)
        endings[e.kind] += 1
        if e.kind == NONE:
            reason = _generic(e.reason)
            reasons[reason] += 1
            examples.setdefault(reason, f"#{rec.get('i')} at {rec.get('sent', 0):.1f} s: {_detail(rec)}")
            during.setdefault(reason, Counter()).update(
                k["kind"] for k in kills if k["result"] == "killed" and rec["sent"] <= k["t"] <= rec["end"])
        elif e.kind == ERROR:
            errors[f"{e.reason}: {_generic(_error_message(rec))}"] += 1
        if rec.get("status") == 500:
            n500 += 1
            n500_doc += e.kind == ERROR
    sent = sum(endings[k] for k in ENDINGS)
    return {"sent": sent, "overflow": endings[OVERFLOW], "endings": {k: endings[k] for k in ENDINGS},
            "none_reasons": dict(reasons.most_common()), "none_examples": examples,
            "none_during": {r: dict(c) for r, c in during.items()},
            "errors": dict(errors.most_common()), "http_500": n500, "http_500_documented": n500_doc}


def _generic(text: str) -> str:
    """`text` with its ids and long numbers blanked, so that like failures count together."""
    text = re.sub(r"\b(req|msg)_[A-Za-z0-9]+", r"\1_…", text)
    return re.sub(r"\d{4,}", "N", re.sub(r"[0-9a-f]{12,}", "…", text))[:160]


def _error_message(rec: dict[str, Any]) -> str:
    for name, data in rec.get("events") or []:
        if name == "error" and isinstance(data, dict):
            return str(data.get("error", {}).get("message", ""))
    body = rec.get("body")
    return str(body.get("error", {}).get("message", "")) if isinstance(body, dict) else ""


def _detail(rec: dict[str, Any]) -> str:
    """What the client saw of a request without an ending, briefly."""
    body = rec.get("body")
    parts = [f"status {rec.get('status')}", "streamed" if rec.get("stream") else "JSON"]
    if rec.get("events"):
        parts.append(f"{len(rec['events'])} events, the last {rec['events'][-1][0]!r}")
    if isinstance(body, dict) and "_raw" in body:
        parts.append(f"body {body['_raw'][:80]!r}")
    if rec.get("transport_error"):
        parts.append(rec["transport_error"][:100])
    return "; ".join(parts)


def timeline(records: list[dict[str, Any]], kills: list[dict[str, Any]], duration_s: float,
             window_s: float) -> list[dict[str, Any]]:
    """Per window of the load (by a request's send time): endings, 500s and kills."""
    n = max(1, math.ceil(duration_s / window_s))
    rows = [{"from": i * window_s, **{k: 0 for k in ENDINGS}, "500": 0, "kills": 0} for i in range(n)]
    for rec in records:
        if rec.get("overflow"):
            continue
        row = rows[min(n - 1, max(0, int(rec["sent"] // window_s)))]
        row[classify(rec).kind] += 1
        row["500"] += rec.get("status") == 500
    for k in kills:
        if k["result"] == "killed":
            rows[min(n - 1, max(0, int(k["t"] // window_s)))]["kills"] += 1
    return rows


def longest_gap_s(records: list[dict[str, Any]], duration_s: float) -> float:
    """The longest stretch of the load in which no request completed."""
    ends = sorted(r["end"] for r in records if not r.get("overflow") and classify(r).kind == COMPLETE)
    points = [0.0, *[e for e in ends if e <= duration_s], duration_s]
    return max(b - a for a, b in zip(points, points[1:], strict=False))


# ---- the markdown ---------------------------------------------------------------------------


def _mark(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "not measured"}[met]


def _mib(b: float | None) -> str:
    return "–" if not b else f"{b / 2**20:.0f} MiB"


def write_report(data: dict[str, Any], out: Path) -> str:
    """Write the markdown report; returns the goals' verdicts as text (what the command prints)."""
    records, kills, plan = data["records"], data["kills"], data["plan"]
    counts = tally(records, kills)
    end = end_state(data["registry_actors"], data["alive_before"], data["alive_after"], data.get("registry_error"))
    growth, how = rss_growth(data["rss"])
    refusals = refusal_latencies(records)
    goals = judge(counts, end, growth, refusals)
    m, model, load_s = data["machine"], data["model"], plan["minutes"] * 60
    busy = was_busy(m["loadavg_start"][0])
    lines = [
        "# Chaos soak", "",
        f"Run {time.strftime('%Y-%m-%d %H:%M', time.localtime(data['started']))}, {data['elapsed_s'] / 60:.1f} min "
        f"wall, with:", "", "```sh", data["command"], "```", "",
        "| goal (the reliability issue) | measured | verdict |", "|---|---|---|",
        *[f"| {g.name} | {g.figure} | {_mark(g.met)} |" for g in goals], "",
        "## Machine", "",
        f"{m['cores']} cores ({m['cpu']}), {m['mem_gib']} GiB; load average (1, 5, 15 min) "
        f"{_la(m['loadavg_start'])} before, {_la(m.get('loadavg_end'))} after"
        + (" — **other work was running when it started**" if busy else "") + ". "
        f"Python {m['python']}, torch {m['torch']}, Ray {m['ray']}, httpx {m.get('httpx', '?')}.", "",
        "## Model and app", "",
        f"`{model['id']}`: the synthetic `{model['preset']}` shape ({model['params_m']:.0f}M parameters, "
        f"{model['layers']} layers, hidden {model['hidden']}, {model['heads']}/{model['kv_heads']} heads, "
        f"{model['dtype']}, {model['file_mb']:.0f} MB file), random weights. The app from `{plan['config']}` with "
        f"{plan['num_replicas']} ingress replicas, namespace `{data['namespace']}`, the app's own deadlines "
        f"(start, token) {plan['app_deadline_s']:g} s; real local Ray, Serve and HTTP on 127.0.0.1:{plan['port']}.",
        "",
        "## Load", "",
        f"{plan['minutes']:g} min of open-loop Poisson arrivals at {plan['rate']:g} req/s (seed {plan['seed']}): "
        f"{len(records)} arrivals, {counts['sent']} sent, {counts['overflow']} not sent (over the "
        f"{plan['max_in_flight']} in flight the client allows). {plan['stream_share']:.0%} streamed (SSE), "
        f"{plan['cancel_share']:.0%} of those closed by the client after 1–3 text deltas; prompts of "
        f"{_mix(plan['input_tokens'])} tokens, max_tokens {_mix(plan['max_tokens'])}. Client timeout "
        f"{plan['client_timeout_s']:g} s per request; one connection per request.", "",
        "## Kills", "",
        f"At exponential intervals averaging {plan['kill_every_s']:g} s (seed {plan['seed']}), by kind: "
        "`actor` a random request actor (no restart), `registry_restart` the registry (Ray restarts it), "
        "`registry_gone` the registry for good (the ingress must make a new one), `ingress` an ingress replica "
        "(Serve replaces it"
        + (f"; the witness replica `{data['rss']['witness']['name']}` is spared" if data["rss"].get("witness")
           else "") + ").", "",
        "| kind | killed | no target | times (s into the load) |", "|---|---|---|---|",
    ]
    for kind, _ in plan["kill_mix"]:
        ks = [k for k in kills if k["kind"] == kind]
        done = [k for k in ks if k["result"] == "killed"]
        lines.append(f"| {kind} | {len(done)} | {len(ks) - len(done)} | "
                     f"{', '.join(format(k['t'], '.1f') for k in done) or '–'} |")
    e = counts["endings"]
    lines += ["", "## Endings", "",
              "| ending | requests |", "|---|---|",
              *[f"| {k} | {e[k]} |" for k in ENDINGS],
              f"| HTTP 500 (any body) | {counts['http_500']} |", "",
              f"No completion for {longest_gap_s(records, load_s):.1f} s at the longest.", ""]
    if counts["none_reasons"]:
        lines += ["Requests without an ending, by reason (and the kills made while they were in flight):", "",
                  "| reason | n | kills in flight | first |", "|---|---|---|---|",
                  *[f"| {_cell(r)} | {n} | {_kinds(counts['none_during'][r])} | {_cell(counts['none_examples'][r])} |"
                    for r, n in counts["none_reasons"].items()], ""]
    if counts["errors"]:
        lines += ["Documented errors, by status, type and message:", "", "| error | n |", "|---|---|",
                  *[f"| {_cell(r)} | {n} |" for r, n in counts["errors"].items()], ""]
    if refusals:
        lines += ["Refusals (503), client-seen seconds from send to answer:", "",
                  "| message | n | p50 | p99 | max |", "|---|---|---|---|---|",
                  *[f"| {_cell(m)} | {len(xs)} | {_quantile(xs, 0.5):.3f} | {_quantile(xs, 0.99):.3f} | "
                    f"{max(xs):.3f} |" for m, xs in sorted(refusals.items())], ""]
    window = max(10.0, load_s / 20)
    lines += [f"Per {window:g} s of the load (by send time):", "",
              "| from (s) | complete | error | cancel | none | 500 | kills |", "|---|---|---|---|---|---|---|",
              *[f"| {r['from']:.0f} | {r['complete']} | {r['error']} | {r['cancel']} | {r['none']} | {r['500']} | "
                f"{r['kills']} |" for r in timeline(records, kills, load_s, window)], ""]
    registry_kills = [k["t"] for k in kills if k["kind"].startswith("registry") and k["result"] == "killed"]
    lines += ["## 5 s after the load stopped", "",
              f"The load stopped {_s(data.get('load_stopped_s'))} into the load (its last request ended then), the "
              f"registry was read at {_s(data.get('end_read_s'))}; its last kill was at "
              f"{_s(max(registry_kills, default=None))}. "
              f"Registry: {end['registry']}. Leaked rows: {_na(end['leaked_rows'])}"
              + (f" ({'; '.join(end['leaked_actors'])})" if end["leaked_actors"] else "") + ". "
              f"Alive request actors the registry does not know: {len(end['orphans_alive'])}"
              + (f" ({', '.join(end['orphans_alive'])})" if end["orphans_alive"] else "") + "; registered actors "
              f"not alive: {len(end['orphans_registered'])}"
              + (f" ({', '.join(end['orphans_registered'])})" if end["orphans_registered"] else "") + ".", ""]
    rss = data["rss"]
    lines += ["## Ingress memory", "",
              f"Growth {'not measured' if growth is None else f'{growth:+.1%}'}: {how}."
              + (f" RSS {_mib(rss['witness']['start'])} at the start of load, {_mib(rss['witness']['end'])} at its "
                 f"end, {_mib(rss['witness'].get('peak'))} at most." if rss.get("witness") else "")
              + (" Every replica at the end: " + ", ".join(f"{n} {_mib(v)}" for n, v in rss["end"].items())
                 + "." if rss.get("end") else ""), ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return "\n".join(f"{_mark(g.met):>14}  {g.name}: {g.figure}" for g in goals)


def _s(t: float | None) -> str:
    return "–" if t is None else f"{t:.1f} s"


def _kinds(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(c.items())) or "none"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _la(x: Any) -> str:
    return "–" if not x else ", ".join(f"{v:.2f}" for v in x)


def _na(x: Any) -> str:
    return "not known" if x is None else str(x)


def _mix(pairs: list) -> str:
    return "/".join(str(v) for v, _ in pairs) + " (weights " + "/".join(f"{w:g}" for _, w in pairs) + ")"


def load_raw(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
