"""Live load, side by side: zeroqueue against the queued Ray Serve baseline, same model, same slots, one run.

    .venv/bin/python -m benchmarks.bench_load            # ~17 min; writes benchmarks/results/load.md + PNGs
    .venv/bin/python -m benchmarks.bench_load --quick    # ~3 min harness check; writes .cache/bench/load/quick/
    .venv/bin/python -m benchmarks.bench_load --report-only .cache/bench/load/run-*.json

1. Calibrate (before Ray starts, nothing else running): each request class's hot service
   time on the in-process `Engine` with the actors' threads (1), which sets capacity =
   slots / mean service time for each scenario's mix, and every offered load from it.
2. Probe whether a lossy link (netns + veth + tc netem) can be built here.
3. One local Ray cluster and Serve on loopback. For each app in turn (zeroqueue with the
   demo config, then the baseline built from the same args): deploy, warm up, then for each
   scenario settle and replay the scenario's open-loop schedule with the locust client in a
   subprocess (see load_client); remove the app and every actor it left.
4. Save the raw records (.cache/bench/load/run-*.json) and write the report and plots.

Serve, the apps, their actors and Ray are shut down however the run ends.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from benchmarks import load_apps
from benchmarks.load_netem import Impairment, lossy_link, probe
from benchmarks.load_report import write_report
from benchmarks.load_scenarios import CLASSES, Scenario, capacity_rps, prompt_of, scenarios, schedule
from benchmarks.load_stats import Slo

log = logging.getLogger("bench_load")

ROOT = Path(__file__).parents[1]
# Every 503 must come back within this, at 10× overload (the same bound the serve tests hold
# the ingress to on this 2-core machine, with both slots computing beside it).
REJECT_BOUND_S = 0.5


@dataclass(frozen=True)
class Plan:
    quick: bool
    scenarios: tuple[Scenario, ...]
    timeout_s: float  # the client abandons a request after this (an interactive user has given up)
    calibration_repeats: int
    max_in_flight: int
    seed: int
    port: int
    config_path: str
    slo: Slo
    impairment: Impairment
    reject_bound_s: float = REJECT_BOUND_S


def make_plan(args: argparse.Namespace) -> Plan:
    chosen = scenarios(args.quick)
    if args.scenarios:
        names = args.scenarios.split(",")
        chosen = tuple(s for s in chosen if s.name in names)
    return Plan(quick=args.quick, scenarios=chosen, timeout_s=8.0 if args.quick else 30.0,
                calibration_repeats=1 if args.quick else 3, max_in_flight=1000, seed=args.seed, port=args.port,
                config_path=args.config, slo=Slo(), impairment=Impairment())


# ---- before Ray -----------------------------------------------------------------------


def app_args(config_path: str) -> dict[str, Any]:
    """The builder args of the zeroqueue app in a `serve run` config; both apps are built from them."""
    config = yaml.safe_load(Path(config_path).read_text())
    (app,) = [a for a in config["applications"] if a["import_path"] == "serve_app.app:build_app"]
    return app["args"]


def model_facts(args: dict[str, Any]) -> tuple[str, str, dict[str, Any], Any]:
    """(model id, .zqs path, the facts the report states, the tokenizer)."""
    from actors.layer_loader import open_zqs
    from serve_app.config import AppArgs, ingress_config, resolve_model_path

    parsed = AppArgs.model_validate(args)
    spec = ingress_config(parsed).models[0]
    path = resolve_model_path(spec)
    reader, config, tokenizer = open_zqs(path)
    reader.close()
    facts = {"id": spec.id, "preset": parsed.models[0].demo_preset, "params_m": config.num_params() / 1e6,
             "layers": config.num_layers, "hidden": config.hidden_size, "heads": config.num_heads,
             "kv_heads": config.num_kv_heads, "vocab": config.vocab_size, "dtype": config.dtype,
             "file_mb": path.stat().st_size / 1e6}
    return spec.id, str(path), facts, tokenizer


def calibrate(zqs_path: str, prompts: dict[str, str], threads: int, repeats: int) -> dict[str, dict[str, float]]:
    """Each class's service time on a hot model: prompt in, last token out, the actors' thread count."""
    import torch

    from actors.engine import Engine, GenerationRequest, Message
    from actors.layer_loader import load_zqs
    from actors.sampling import SamplingParams

    torch.set_num_threads(threads)
    model, tokenizer = load_zqs(zqs_path, num_threads=1)
    engine = Engine(model, tokenizer)
    out = {}
    for name, cls in CLASSES.items():
        params = SamplingParams(max_tokens=cls.output_tokens, seed=1)
        prompt = engine.prepare(GenerationRequest((Message("user", prompts[name]),), params))
        _time_generation(engine, prompt, replace(params, max_tokens=2))  # warm-up: first-call allocations
        times = [_time_generation(engine, prompt, params) for _ in range(repeats)]
        out[name] = {"service_s": statistics.median(times), "input_tokens": len(prompt),
                     "output_tokens": cls.output_tokens}
        log.info("calibration %s: %d prompt tokens, %d out, %.3f s", name, len(prompt), cls.output_tokens,
                 out[name]["service_s"])
    return out


def _time_generation(engine, prompt: list[int], params) -> float:
    t0 = time.perf_counter()
    for _ in engine.generate(prompt, params):
        pass
    return time.perf_counter() - t0


def lanes(args: dict[str, Any], calibration: dict[str, dict[str, float]]) -> dict[str, str]:
    """The zeroqueue lane each class takes under the config's policy."""
    from serve_app.policy import PolicyConfig

    policy = PolicyConfig(**args.get("policy", {}))
    return {c: policy.lane(int(v["input_tokens"]), int(v["output_tokens"])) for c, v in calibration.items()}


def machine() -> dict[str, Any]:
    from importlib.metadata import version

    import ray
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    # The locust version from its metadata: importing locust would monkey-patch this process.
    return {"cores": os.cpu_count(), "cpu": cpu, "mem_gib": round(mem, 1), "python": platform.python_version(),
            "torch": torch.__version__, "ray": ray.__version__, "locust": version("locust"),
            "loadavg_start": os.getloadavg()}


# ---- the run --------------------------------------------------------------------------


def run_client(app: str, scenario: Scenario, base: str, sched_path: Path, records_path: Path, plan: Plan,
               prefix: tuple[str, ...] = ()) -> list[dict]:
    cmd = [*prefix, sys.executable, "-m", "benchmarks.load_client", "--host", base, "--app", app,
           "--scenario", scenario.name, "--schedule", str(sched_path), "--records", str(records_path),
           "--timeout-s", str(plan.timeout_s), "--max-in-flight", str(plan.max_in_flight)]
    limit = scenario.duration_s + plan.timeout_s + 60
    try:
        rc = subprocess.run(cmd, cwd=ROOT, timeout=limit).returncode
        if rc != 0:
            log.warning("%s/%s: the client exited %d", app, scenario.name, rc)
    except subprocess.TimeoutExpired:
        log.warning("%s/%s: the client overran %.0f s and was killed", app, scenario.name, limit)
    if not records_path.exists():
        return []
    return [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]


def measure(plan: Plan, command: str) -> dict[str, Any]:
    started = time.time()
    args = app_args(plan.config_path)
    model_id, zqs_path, model, tokenizer = model_facts(args)
    prompts = {c: prompt_of(tokenizer, cls.input_tokens) for c, cls in CLASSES.items()}
    actor = args.get("actor", {})
    # CPU slots: this benchmark is sized for a CPU machine (both apps get the same number).
    slots = int(args.get("slots", {}).get("num_cpu_slots", 2))
    data: dict[str, Any] = {"command": command, "quick": plan.quick, "started": started, "machine": machine(),
                            "model": model, "plan": asdict(plan), "slots": slots, "app_args": args}
    calibration = calibrate(zqs_path, prompts, int(actor.get("compute_threads", 1)), plan.calibration_repeats)
    service = {c: v["service_s"] for c, v in calibration.items()}
    data |= {"calibration": calibration, "lanes": lanes(args, calibration)}
    if data["lanes"].get("long") != "long":
        log.warning("long requests take zeroqueue's %s lane under this config: they are not isolated",
                    data["lanes"].get("long"))
    data["netem_error"] = probe(plan.impairment) if any(s.lossy for s in plan.scenarios) else None
    if data["netem_error"]:
        log.warning("lossy scenario skipped: %s", data["netem_error"])

    with tempfile.TemporaryDirectory(prefix="zq-bench-load-") as work:
        data["runs"] = _run_apps(plan, args, Path(work), model_id, prompts, service, slots, data["netem_error"],
                                 started)
    data["machine"]["loadavg_end"] = os.getloadavg()
    data["elapsed_s"] = time.time() - started
    return data


def _run_apps(plan: Plan, args: dict[str, Any], work: Path, model_id: str, prompts: dict[str, str],
              service: dict[str, float], slots: int, netem_error: str | None, started: float) -> dict[str, Any]:
    """Each app in turn, each scenario in turn: the records, per scenario."""
    max_tokens = {c: cls.output_tokens for c, cls in CLASSES.items()}
    runs: dict[str, dict[str, Any]] = {}
    schedules: dict[str, Path] = {}
    for s in plan.scenarios:
        cap = capacity_rps(s.mix, service, slots)
        arrivals = schedule(s, cap, plan.seed)
        path = schedules[s.name] = work / f"{s.name}.json"
        path.write_text(json.dumps({"model": model_id, "prompts": prompts, "max_tokens": max_tokens,
                                    "duration_s": s.duration_s, "ttft_target_s": s.ttft_target_s,
                                    "arrivals": [{"i": a.index, "t": a.t, "cls": a.cls, "seed": a.seed}
                                                 for a in arrivals]}))
        runs[s.name] = {"scenario": asdict(s), "capacity_rps": cap, "arrivals": len(arrivals), "records": [],
                        "settle_s": {}}
        log.info("%s: capacity %.2f req/s, %d arrivals over %.0f s", s.name, cap, len(arrivals), s.duration_s)

    import ray
    from ray import serve

    probe_req = load_apps.Probe(model_id, prompts, max_tokens)
    base = f"http://127.0.0.1:{plan.port}"
    # Logical CPUs: the 2 slots (zeroqueue actors or baseline replicas, num_cpus=1 each) and
    # room for Serve's own actors; the physical cores are what they are.
    ray.init(num_cpus=slots + 2, namespace=load_apps.NAMESPACE, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    _exit_on_sigterm()  # again: ray.init installs its own handler, which aborts before any `finally` runs
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": plan.port})
        for app in load_apps.APPS:
            load_apps.deploy(app, args)
            try:
                load_apps.wait_ready(base)
                load_apps.warm_up(base, probe_req, slots)
                for s in plan.scenarios:
                    if s.lossy and netem_error:
                        continue
                    runs[s.name]["settle_s"][app] = load_apps.settle(
                        app, base, probe_req, fast_s=max(1.0, 4 * service["short"]), slots=slots)
                    records_path = work / f"{app}-{s.name}.jsonl"
                    log.info("%s/%s: %d requests over %.0f s", app, s.name, runs[s.name]["arrivals"], s.duration_s)
                    if s.lossy:
                        with lossy_link(plan.impairment, plan.port) as link:
                            records = run_client(app, s, link.base_url, schedules[s.name], records_path, plan,
                                                 link.exec_prefix)
                    else:
                        records = run_client(app, s, base, schedules[s.name], records_path, plan)
                    runs[s.name]["records"] += records
                    log.info("%s/%s: %d records (%.1f min so far)", app, s.name, len(records),
                             (time.time() - started) / 60)
            finally:
                load_apps.undeploy(app)
    finally:
        try:
            serve.shutdown()
        finally:
            load_apps.kill_namespace_actors()
            ray.shutdown()
    return runs


def _exit_on_sigterm() -> None:
    """A plain `kill` must still shut Serve, the apps' actors and Ray down: SystemExit runs the `finally`s."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="three short scenarios (~3 min), to check the harness")
    parser.add_argument("--scenarios", help="a comma-separated subset (development)")
    parser.add_argument("--config", default="configs/serve.yaml", help="the zeroqueue serve config both apps share")
    parser.add_argument("--port", type=int, default=8790, help="Serve's HTTP port, on 127.0.0.1")
    parser.add_argument("--seed", type=int, default=7, help="draws the arrival schedules")
    parser.add_argument("--out", help="the report (default benchmarks/results/load.md; "
                                      ".cache/bench/load/quick/load.md with --quick)")
    parser.add_argument("--report-only", metavar="RUN_JSON", help="rewrite the report from a saved run")
    args = parser.parse_args(argv)
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_load", *(sys.argv[1:] if argv is None else argv)])
    out = Path(args.out or (".cache/bench/load/quick/load.md" if args.quick else "benchmarks/results/load.md"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    _exit_on_sigterm()

    if args.report_only:
        data = json.loads(Path(args.report_only).read_text())
    else:
        data = measure(make_plan(args), command)
        raw = Path(".cache/bench/load") / f"run-{time.strftime('%Y%m%d-%H%M%S')}.json"
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps(data))
        log.info("raw results: %s", raw)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = write_report(data, out)
    print(summary)  # the benchmark's result: the goals, judged
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
