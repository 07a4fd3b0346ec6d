"""What the load benchmark learns before Ray starts: the config, the model, the machine, the scorer, each class's hot service time."""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from benchmarks import common
from benchmarks.load_scenarios import CLASSES

log = logging.getLogger(__name__)

ZEROQUEUE_BUILDER = "serve_app.app:build_app"


def app_args(config_path: str) -> dict[str, Any]:
    """The builder args of the zeroqueue app in a `serve run` config; every system is built from them."""
    config = yaml.safe_load(Path(config_path).read_text())
    (app,) = [a for a in config["applications"] if a["import_path"] == ZEROQUEUE_BUILDER]
    return app["args"]


def model_facts(args: dict[str, Any]) -> tuple[str, str, dict[str, Any], Any]:
    """(model id, .zqs path, the facts the report states, the tokenizer)."""
    from actors.shard_header import open_zqs
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


def scorer_used(args: dict[str, Any]) -> str:
    """Which scorer zeroqueue's router will decide with, and why: the ingress runs this same loader on
    the same file, and logs the same warning when it falls back to the rule."""
    from serve_app.config import AppArgs, ingress_config
    from serve_app.scorer import RuleScorer
    from serve_app.xgb_scorer import load_scorer

    config = ingress_config(AppArgs.model_validate(args))
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    xgb_log = logging.getLogger("serve_app.xgb_scorer")
    handler = Keep(logging.WARNING)
    xgb_log.addHandler(handler)
    try:
        scorer = load_scorer(config.scorer_path)
    finally:
        xgb_log.removeHandler(handler)
    if isinstance(scorer, RuleScorer):
        why = f" ({'; '.join(warnings)})" if warnings else " (no scorer_path)"
        return f"the rule scorer, {config.rule_scorer}{why}"
    return f"the XGBoost scorer {config.scorer_path}"


def calibrate(zqs_path: str, prompts: dict[str, str], args: dict[str, Any], repeats: int) -> dict[str, dict[str, float]]:
    """Each class's service time alone on a hot model (batch 1): prompt in, last token out, computed as the app's
    actors compute it (their threads, compute dtype and packed weights: `args` are the app's). It sets each class's
    end-to-end SLO; capacity is measured live, not from this. (The weights were left plain until commit aa776a8:
    results/load.md of 2026-12-06 against 2026-12-08 has short 0.142 against 0.074 s, medium 0.526 against 0.206,
    long 3.32 against 1.34, so the SLOs were 2-2.5x looser than 3x an actor's hot service time.)"""
    import torch

    from actors.chat import GenerationRequest
    from actors.engine import Engine
    from actors.layer_loader import load_zqs
    from actors.sampling import SamplingParams
    from actors.tokenizer import Message
    from serve_app.config import AppArgs

    actor = AppArgs.model_validate(args).actor
    torch.set_num_threads(actor.compute_threads)
    model, tokenizer = load_zqs(zqs_path, num_threads=1, compute_dtype=actor.compute_dtype,
                                is_weight_packed=actor.packs_weights_on("cpu"))
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
    """The machine's facts (`benchmarks.common`), memory rounded to 0.1 GiB, and the load average at the start."""
    facts = common.machine("torch", "ray", "locust")  # locust's from its metadata: importing it patches this process
    return {**facts, "mem_gib": round(facts["mem_gib"], 1), "loadavg_start": common.load_average()}


def run_data(report_only: str | None, measure_run, bench: str) -> dict[str, Any]:
    """A saved run's raw results (`--report-only`), or a new run's, kept under .cache/bench/<bench>/."""
    if report_only:
        return json.loads(Path(report_only).read_text())
    data = measure_run()
    raw = Path(".cache/bench") / bench / f"run-{time.strftime('%Y%m%d-%H%M%S')}.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(data))
    logging.getLogger(__name__).info("raw results: %s", raw)
    return data


class ServedEngine:
    """An app config's first model, loaded in this process as its actors load it, and fresh engines built as they
    build theirs: for benchmarks of the engine alone (bench_idle_steps, bench_paced_prefill). `threads`: torch's
    count here (None: the actors' `compute_threads`). Every engine shares one set of step checks, so each plans with
    the correction the runs before it measured, as a hot actor's engine carries its own from request to request (a
    fresh one would plan by the constants)."""

    def __init__(self, config_path: str, threads: int | None = None) -> None:
        import torch

        from actors.layer_loader import load_zqs
        from serve_app.config import AppArgs, ingress_config

        args = app_args(config_path)
        parsed = AppArgs.model_validate(args)
        config = ingress_config(parsed)
        _, path, self.facts, _ = model_facts(args)
        self.actor = config.actor
        self.threads = threads or self.actor.compute_threads
        torch.set_num_threads(self.threads)
        self.model, self.tokenizer = load_zqs(path, num_threads=self.threads, compute_dtype=self.actor.compute_dtype,
                                              is_weight_packed=self.actor.is_weight_packed)
        self.targets = parsed.models[0]  # its ttft_target_s, tpot_target_s
        self.step_cost = config.rule_scorer.step_cost()
        self.dtype = str(self.model.dtype).removeprefix("torch.")
        self._step_checks: dict = {}

    def engine(self):
        """A fresh engine, every row running to its max_tokens (no end-of-sequence token)."""
        from actors.engine import Engine

        engine = Engine(self.model, self.tokenizer, max_batch=self.actor.max_batch,
                        prefill_chunk_tokens=self.actor.prefill_chunk_tokens, step_cost=self.step_cost,
                        step_check_recent_steps=self.actor.step_check_recent_steps, is_kv_int8=self.actor.is_kv_int8)
        engine._step_checks = self._step_checks
        engine.eos_token_ids = frozenset()
        return engine
