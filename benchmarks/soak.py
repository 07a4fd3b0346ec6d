"""The chaos soak: a bounded, seeded mixed load against the real app while its parts are killed at random.

    .venv/bin/python -m benchmarks.soak                       # 10 min of load; writes benchmarks/results/soak.md
    .venv/bin/python -m benchmarks.soak --minutes 1 --out /tmp/soak.md   # a short trial
    .venv/bin/python -m benchmarks.soak --report-only .cache/bench/soak/run-*.json

1. Before Ray: the app's args (benchmarks/load.yaml: the synthetic `small` model on 2 CPU
   slots), here with 2 ingress replicas, the soak's own namespace, and the app's start and
   token deadlines below the client's timeout; the prompts; the arrival and kill schedules,
   both drawn from `--seed`.
2. A local Ray cluster, Serve on 127.0.0.1, the app deployed and warmed. One ingress replica
   is the witness: the chaos spares it, and its resident memory is read at the start and the
   end of the load (`--kill-any-ingress` spares none).
3. For `--minutes`: open-loop Poisson arrivals at `--rate` (half streamed, varied prompt
   lengths and max_tokens, a share of streams closed by the client part way), at most
   `--max-in-flight` at once, each with `--client-timeout-s`; meanwhile a chaos thread, at
   exponential intervals averaging `--kill-every-s`, kills a random request actor (no
   restart), the registry (Ray restarts it, or it is gone for good and the ingress must make
   a new one) or an ingress replica (Serve replaces it).
4. The arrivals stop, the chaos stops, the requests in flight end; 5 s later the registry's
   snapshot and the alive request actors give the leaked rows and the orphans.
5. The raw records go to .cache/bench/soak/run-*.json; benchmarks/soak_report.py judges every
   request's ending and writes the report.

Serve, the app, its actors and Ray are shut down however the run ends. Only actors of this
run's own cluster are ever killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shlex
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from actors.actor_names import REGISTRY_NAME
from benchmarks.common import load_average, version_of
from benchmarks.soak_chaos import (
    APP,
    NAMESPACE,
    Chaos,
    RssSampler,
    ingress_replicas,
    replica_pids,
    request_actors,
    rss,
)
from benchmarks.soak_report import write_report

log = logging.getLogger("soak")

KINDS = ("actor", "registry_restart", "registry_gone", "ingress")
SETTLE_S = 5.0  # after the load stops, before the registry is read


@dataclass(frozen=True)
class Plan:
    minutes: float = 10.0
    rate: float = 1.5
    kill_every_s: float = 5.0
    seed: int = 7
    max_in_flight: int = 32
    client_timeout_s: float = 30.0
    app_deadline_s: float = 20.0  # the app's start and token deadlines: below the client's timeout
    stream_share: float = 0.5
    cancel_share: float = 0.1  # of the streamed requests
    input_tokens: tuple[tuple[int, float], ...] = ((24, 0.35), (96, 0.35), (256, 0.2), (600, 0.1))
    max_tokens: tuple[tuple[int, float], ...] = ((1, 0.1), (4, 0.3), (16, 0.3), (32, 0.2), (64, 0.1))
    kill_mix: tuple[tuple[str, float], ...] = (("actor", 2), ("registry_restart", 1), ("registry_gone", 1),
                                                ("ingress", 2))
    num_replicas: int = 2
    spare_witness: bool = True
    config: str = "benchmarks/load.yaml"
    port: int = 8791


@dataclass(frozen=True)
class Arrival:
    i: int
    t: float  # seconds into the load
    stream: bool
    input_tokens: int
    max_tokens: int
    cancel_after: int | None  # close the stream after this many text deltas
    seed: int


def _pick(rng: random.Random, pairs) -> Any:
    return rng.choices([v for v, _ in pairs], [w for _, w in pairs])[0]


def arrival_plan(plan: Plan) -> list[Arrival]:
    """The load's Poisson arrivals, drawn from the seed alone."""
    rng, out, t = random.Random(f"{plan.seed}/load"), [], 0.0
    while True:
        t += rng.expovariate(plan.rate)
        if t >= plan.minutes * 60:
            return out
        stream = rng.random() < plan.stream_share
        input_tokens, max_tokens = _pick(rng, plan.input_tokens), _pick(rng, plan.max_tokens)
        cancel_after = rng.randint(1, 3) if stream and rng.random() < plan.cancel_share else None
        if cancel_after is not None:
            max_tokens = max(max_tokens, 16)  # long enough to be cancelled part way
        out.append(Arrival(len(out), t, stream, input_tokens, max_tokens, cancel_after, rng.getrandbits(31)))


def chaos_plan(plan: Plan) -> list[tuple[float, str]]:
    """(seconds into the load, kind) of each kill: exponential gaps averaging `kill_every_s`."""
    rng, out, t = random.Random(f"{plan.seed}/chaos"), [], 0.0
    while True:
        t += rng.expovariate(1 / plan.kill_every_s)
        if t >= plan.minutes * 60:
            return out
        out.append((t, _pick(rng, plan.kill_mix)))


# ---- the cluster: what is alive, and killing it -----------------------------------------------


# ---- the load ------------------------------------------------------------------------------


def parse_event(block: bytes) -> list:
    """[event name, data] of one SSE event block; data is its JSON, or the raw text where it is not JSON."""
    name, data = "<no event line>", None
    for line in block.decode("utf-8", errors="replace").split("\n"):
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            raw = line[5:].strip()
            try:
                data = json.loads(raw)
            except ValueError:
                data = raw[:300]
    return [name, data]


def parse_body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return {"_raw": raw[:300].decode("utf-8", errors="replace")}


async def _exchange(client, body: dict, a: Arrival, rec: dict[str, Any]) -> None:
    async with client.stream("POST", "/v1/messages", json=body) as r:
        rec["status"], rec["request_id"] = r.status_code, r.headers.get("request-id")
        rec["content_type"], rec["retry_after"] = r.headers.get("content-type"), r.headers.get("retry-after")
        if not (a.stream and r.status_code == 200 and "text/event-stream" in (rec["content_type"] or "")):
            rec["body"] = parse_body(await r.aread())
            return
        buffer, deltas = b"", 0
        async for chunk in r.aiter_bytes():
            buffer += chunk
            *blocks, buffer = buffer.split(b"\n\n")
            for block in blocks:
                event = parse_event(block)
                rec["events"].append(event)
                deltas += event[0] == "content_block_delta"
                ended = event[0] in ("message_stop", "error")
                if a.cancel_after is not None and deltas >= a.cancel_after and not ended:
                    rec["cancelled"] = True  # leaving the block closes the connection part way
                    return
        if buffer.strip():
            rec["events"].append(["<partial event>", buffer[:300].decode("utf-8", errors="replace")])


async def _one(client, a: Arrival, model_id: str, prompts: dict[int, str], t0: float,
               timeout_s: float) -> dict[str, Any]:
    body = {"model": model_id, "max_tokens": a.max_tokens, "stream": a.stream, "seed": a.seed,
            "messages": [{"role": "user", "content": prompts[a.input_tokens]}]}
    rec: dict[str, Any] = {**asdict(a), "sent": time.monotonic() - t0, "end": None, "status": None,
                           "request_id": None, "content_type": None, "retry_after": None, "body": None,
                           "events": [], "cancelled": False, "timed_out": False, "transport_error": None}
    try:
        await asyncio.wait_for(_exchange(client, body, a, rec), timeout_s)
    except asyncio.TimeoutError:
        rec["timed_out"] = True
    except Exception as e:  # reset, refused, cut: recorded as it is, never retried
        rec["transport_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    rec["end"] = time.monotonic() - t0
    return rec


async def run_load(base: str, arrivals: list[Arrival], model_id: str, prompts: dict[int, str], plan: Plan,
                   t0: float, on_arrivals_done) -> list[dict[str, Any]]:
    """Every arrival at its time (open loop), at most `max_in_flight` at once; returns once all have ended."""
    import httpx

    # One connection per request: a kept-alive one the proxy closed meanwhile would fail for the client's sake.
    limits = httpx.Limits(max_connections=plan.max_in_flight + 8, max_keepalive_connections=0)
    records: list[dict[str, Any]] = []
    tasks: set[asyncio.Task] = set()
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=plan.client_timeout_s + 5) as client:
        for a in arrivals:
            await asyncio.sleep(max(0.0, t0 + a.t - time.monotonic()))
            if len(tasks) >= plan.max_in_flight:
                records.append({**asdict(a), "overflow": True, "sent": a.t, "end": a.t})
                continue
            task = asyncio.create_task(_one(client, a, model_id, prompts, t0, plan.client_timeout_s))
            tasks.add(task)
            task.add_done_callback(lambda t: (tasks.discard(t), records.append(t.result())))
        on_arrivals_done()
        while tasks:
            await asyncio.wait(set(tasks))
    return sorted(records, key=lambda r: r["i"])


# ---- one run -------------------------------------------------------------------------------


def app_args_for(plan: Plan) -> dict[str, Any]:
    from benchmarks.load_setup import app_args

    return app_args(plan.config) | {"namespace": NAMESPACE, "num_replicas": plan.num_replicas,
                                    "start_timeout_s": plan.app_deadline_s, "token_timeout_s": plan.app_deadline_s}


def measure(plan: Plan, command: str) -> dict[str, Any]:
    from benchmarks.load_scenarios import prompt_of
    from benchmarks.load_setup import machine, model_facts

    started = time.time()
    args = app_args_for(plan)
    model_id, _, model, tokenizer = model_facts(args)
    prompts = {n: prompt_of(tokenizer, n) for n, _ in plan.input_tokens}
    arrivals, schedule = arrival_plan(plan), chaos_plan(plan)

    data: dict[str, Any] = {"command": command, "started": started, "machine": machine() | {"httpx": version_of("httpx")},
                            "model": model, "plan": asdict(plan), "namespace": NAMESPACE, "app_args": args}
    log.info("%d arrivals and %d kills planned over %.1f min", len(arrivals), len(schedule), plan.minutes)
    _run_cluster(plan, args, model_id, prompts, arrivals, schedule, data)
    data["machine"]["loadavg_end"] = load_average()
    data["elapsed_s"] = time.time() - started
    return data


def _run_cluster(plan: Plan, args: dict[str, Any], model_id: str, prompts: dict[int, str],
                 arrivals: list[Arrival], schedule: list[tuple[float, str]], data: dict[str, Any]) -> None:
    import ray
    from ray import serve

    from benchmarks.load_apps import Probe, kill_namespace_actors, wait_ready, warm_up
    from serve_app.app import build_app

    base = f"http://127.0.0.1:{plan.port}"
    slots = int(args.get("slots", {}).get("num_cpu_slots", 2))
    ray.init(address="local", num_cpus=slots + 2, namespace=NAMESPACE, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    _exit_on_sigterm()  # again: ray.init installs its own handler, which aborts before any `finally` runs
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": plan.port})
        serve.run(build_app(args), name=APP, route_prefix="/")
        wait_ready(base)
        smallest = min(n for n, _ in plan.input_tokens)
        warm_up(base, Probe(model_id, {"short": prompts[smallest]}, {"short": 4}), slots)
        names = ingress_replicas()
        pids = replica_pids(base, names)
        witness = sorted(n for n in pids if n in names)[0] if plan.spare_witness and set(pids) & set(names) else None
        rss_data: dict[str, Any] = {"start": {n: rss(p) for n, p in pids.items()}, "end": {}, "witness": None}
        if witness:
            rss_data["witness"] = {"name": witness, "pid": pids[witness], "start": rss_data["start"][witness]}
        log.info("ingress replicas %s; witness %s", pids, witness)
        t0 = time.monotonic()
        chaos = Chaos(schedule, plan.seed, t0, witness)
        sampler = RssSampler(pids.get(witness) if witness else None)
        chaos.start()
        sampler.start()
        try:
            data["records"] = asyncio.run(run_load(base, arrivals, model_id, prompts, plan, t0, chaos.stop_event.set))
        finally:
            chaos.stop_event.set()
            sampler.stop_event.set()
            chaos.join()
        stopped = time.monotonic()
        data["load_stopped_s"] = stopped - t0
        end_pids = replica_pids(base, ingress_replicas())
        rss_data["end"] = {n: rss(p) for n, p in end_pids.items()}
        if witness:
            w = rss_data["witness"]
            w["end"] = rss(w["pid"])
            w["peak"] = max(sampler.peak, w["start"] or 0, w["end"] or 0)
        data["rss"], data["kills"] = rss_data, chaos.kills
        time.sleep(max(0.0, stopped + SETTLE_S - time.monotonic()))
        data["end_read_s"] = time.monotonic() - t0
        _read_end_state(data)
        log.info("load stopped %.1f s in; end state read %.1f s later", data["load_stopped_s"],
                 time.monotonic() - stopped)
    finally:
        try:
            serve.shutdown()
        finally:
            kill_namespace_actors(NAMESPACE)
            ray.shutdown()


def _read_end_state(data: dict[str, Any]) -> None:
    """The alive request actors, the registry's actors (name, state, rows), the alive ones again."""
    import ray

    data["alive_before"] = request_actors()
    data["registry_actors"], data["registry_error"] = None, None
    try:
        snap = ray.get(ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE).snapshot.remote(), timeout=10)
        data["registry_actors"] = [{"name": a.name, "state": a.state, "rows": len(a.rows)} for a in snap.actors]
        data["registry_slots"] = [{"slot": s.slot_id, "reserved_bytes": s.reserved_bytes,
                                   "total_bytes": s.total_bytes, "num_actors": s.num_actors} for s in snap.slots]
    except ValueError:
        data["registry_error"] = "no registry actor"
    except Exception as e:
        data["registry_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    data["alive_after"] = request_actors()


def _exit_on_sigterm() -> None:
    """A plain `kill` must still shut Serve, the app's actors and Ray down: SystemExit runs the `finally`s."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _pairs(text: str, cast) -> tuple[tuple[Any, float], ...]:
    """"24:0.35,96:0.35" -> ((24, 0.35), (96, 0.35))."""
    out = []
    for item in text.split(","):
        value, _, weight = item.partition(":")
        out.append((cast(value.strip()), float(weight or 1)))
    return tuple(out)


def make_plan(a: argparse.Namespace) -> Plan:
    mix = _pairs(a.kill_mix, str)
    unknown = [k for k, _ in mix if k not in KINDS]
    if unknown:
        raise SystemExit(f"unknown kill kinds {unknown}; kinds: {', '.join(KINDS)}")
    return Plan(minutes=a.minutes, rate=a.rate, kill_every_s=a.kill_every_s, seed=a.seed,
                max_in_flight=a.max_in_flight, client_timeout_s=a.client_timeout_s, app_deadline_s=a.app_deadline_s,
                stream_share=a.stream_share, cancel_share=a.cancel_share, input_tokens=_pairs(a.input_tokens, int),
                max_tokens=_pairs(a.max_tokens, int), kill_mix=mix, spare_witness=not a.kill_any_ingress,
                config=a.config, port=a.port)


def main(argv: list[str] | None = None) -> int:
    d = Plan()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=d.minutes, help="minutes of load")
    p.add_argument("--rate", type=float, default=d.rate, help="Poisson arrivals per second")
    p.add_argument("--kill-every-s", type=float, default=d.kill_every_s, help="mean seconds between kills")
    p.add_argument("--kill-mix", default=",".join(f"{k}:{w:g}" for k, w in d.kill_mix),
                   help=f"kind:weight,... of {', '.join(KINDS)}")
    p.add_argument("--seed", type=int, default=d.seed, help="draws the arrivals, the kills and their targets")
    p.add_argument("--max-in-flight", type=int, default=d.max_in_flight)
    p.add_argument("--client-timeout-s", type=float, default=d.client_timeout_s)
    p.add_argument("--app-deadline-s", type=float, default=d.app_deadline_s,
                   help="the app's start_timeout_s and token_timeout_s")
    p.add_argument("--stream-share", type=float, default=d.stream_share)
    p.add_argument("--cancel-share", type=float, default=d.cancel_share, help="of the streamed requests")
    p.add_argument("--input-tokens", default=",".join(f"{v}:{w:g}" for v, w in d.input_tokens))
    p.add_argument("--max-tokens", default=",".join(f"{v}:{w:g}" for v, w in d.max_tokens))
    p.add_argument("--kill-any-ingress", action="store_true",
                   help="spare no ingress replica (the RSS growth is then judged on survivors only)")
    p.add_argument("--config", default=d.config, help="the zeroqueue serve config the app is built from")
    p.add_argument("--port", type=int, default=d.port, help="Serve's HTTP port, on 127.0.0.1")
    p.add_argument("--out", default="benchmarks/results/soak.md", help="the report")
    p.add_argument("--report-only", metavar="RUN_JSON", help="rewrite the report from a saved run")
    args = p.parse_args(argv)
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.soak", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    _exit_on_sigterm()
    from benchmarks.load_setup import run_data

    data = run_data(args.report_only, lambda: measure(make_plan(args), command), "soak")
    print(write_report(data, Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
