"""The app builder's arguments (pydantic, from `configs/serve.yaml`) and the frozen config they become.

`serve run configs/serve.yaml` hands the YAML's `args:` to `build_app`, which validates
them here once; every component then receives its own frozen dataclass at `bind()` time.
The component sections of the YAML — `policy`, `actor`, `registry`, `telemetry`,
`rule_scorer` — are those dataclasses themselves: pydantic checks each field's type and
refuses unknown names, and each dataclass's own `__post_init__` checks its ranges, so a
misspelt or out-of-range setting fails `build_app`, never a replica later.

Latency targets. A model may set default `ttft_target_s` / `total_target_s` (seconds from
the request's arrival) and `tpot_target_s` (seconds per output token); a request may
override them with the `x-zq-ttft-target-s` / `x-zq-total-target-s` / `x-zq-tpot-target-s`
headers (`latency_targets.py`). A request no placement is predicted
to serve within its targets is refused at once (503 overloaded_error, retry-after).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.actor_config import ActorConfig
from actors.telemetry import TelemetryConfig
from serve_app.capacity import CapacityConfig
from serve_app.latency_targets import MAX_TARGET_S
from serve_app.lease import LeaseConfig
from serve_app.policy import PolicyConfig
from serve_app.registry import RegistryConfig
from serve_app.scorer import RuleScorer
from serve_app.traces import TraceConfig
from serve_app.ttft_check import TtftCheckConfig
from weights_tool.demo import resolve_zqs

GiB = 1 << 30


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelArgs(_Strict):
    """One served model: a `.zqs` file, or a synthetic demo model made (once) from a preset."""

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._\-]+$")
    zqs_path: str | None = None
    demo_preset: str | None = None
    demo_dir: str = ".cache/demo"
    display_name: str | None = None
    max_context: int | None = Field(default=None, ge=2)  # caps the model's own window
    # Default latency targets for this model's requests (None: none); headers override them.
    ttft_target_s: float | None = Field(default=None, gt=0, le=MAX_TARGET_S)
    total_target_s: float | None = Field(default=None, gt=0, le=MAX_TARGET_S)
    tpot_target_s: float | None = Field(default=None, gt=0, le=MAX_TARGET_S)

    @model_validator(mode="after")
    def _one_source(self) -> ModelArgs:
        if (self.zqs_path is None) == (self.demo_preset is None):
            raise ValueError(f"model {self.id!r}: give exactly one of zqs_path or demo_preset")
        return self


class SlotArgs(_Strict):
    """Where request actors may run. `auto`: one slot per GPU where the cluster has GPUs, else CPU slots."""

    kind: Literal["auto", "gpu", "cpu", "resource"] = "auto"
    num_cpu_slots: int = Field(default=2, ge=1)
    # CPU and `resource` slots each offer this much memory.
    cpu_slot_bytes: int = Field(default=4 * GiB, ge=1)
    # `resource`: every unit of this Ray resource on any node is one slot (a worker node type that declares
    # `zq_slot: 2` brings two), so slots follow the nodes the autoscaler adds and removes.
    resource: str = "zq_slot"
    # Memory a GPU slot offers when telemetry cannot read it (it normally can, through NVML).
    gpu_slot_bytes: int | None = Field(default=None, ge=1)


class TraceArgs(_Strict):
    """Request traces for training the scorer (serve_app/traces.py); off by default."""

    enabled: bool = False
    path: str = ".cache/traces/zeroqueue.jsonl"  # relative to the working directory, like demo_dir
    max_bytes: int = Field(default=64 << 20, ge=1024)  # then the file moves to <path>.1


class AppArgs(_Strict):
    models: list[ModelArgs] = Field(min_length=1)
    slots: SlotArgs = SlotArgs()
    policy: PolicyConfig = PolicyConfig()
    # `namespace` and `max_batch` come from the top-level namespace and policy.max_batch.
    actor: ActorConfig = ActorConfig()
    # The reconcile loop and its graces; its names and namespaces come from `namespace`.
    registry: RegistryConfig = RegistryConfig()
    # Rows of hot actors each replica holds and fills without a registry call (serve_app/lease.py).
    leases: LeaseConfig = LeaseConfig()
    # Slots asked of Ray's autoscaler as refused demand calls for them (serve_app/capacity.py); off by default.
    capacity: CapacityConfig = CapacityConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    # The *name* of an environment variable holding the API key; the key never sits in YAML.
    api_key_env: str | None = None
    max_body_bytes: int = Field(default=32 << 20, ge=1024)
    namespace: str = "zeroqueue"
    # Every wait has a deadline: for the actor to start computing, and between tokens.
    start_timeout_s: float = Field(default=300.0, gt=0)
    token_timeout_s: float = Field(default=60.0, gt=0)
    # The decision: a registry that does not answer within this is answered 503 with retry-after,
    # never a 500 or a hang. A dead or restarting registry is known at once (Ray says so); this only
    # tells a stalled registry from a busy one, whose decision (milliseconds of CPU) can still come
    # late while actor processes start on a 2-core machine (the 0.25 s it replaces was missed there).
    registry_timeout_s: float = Field(default=1.0, gt=0)
    # A heartbeat after an admission came late: a registry that does not answer it within this is
    # taken as unavailable (admissions refused at once) until a heartbeat is answered.
    registry_probe_timeout_s: float = Field(default=2.0, gt=0)
    # How often each replica heartbeats the registry: a restarted or lost registry is noticed
    # (and re-created, and handed the running rows) within this.
    registry_heartbeat_s: float = Field(default=1.0, gt=0)
    # After the registry refused a model for want of capacity, this replica refuses that model's
    # requests at once (before tokenizing, no registry call) for this long, unless one of its leased
    # rows frees first: a burst is refused at the cost of parsing it. 0: every request is decided.
    early_refusal_s: float = Field(default=0.1, ge=0)
    # Reading the request body, and creating or looking up an actor (GCS calls): past these, 504 / 503.
    body_timeout_s: float = Field(default=30.0, gt=0)
    placement_timeout_s: float = Field(default=10.0, gt=0)
    # How long a replica being replaced or stopped lets its streams finish before Serve kills it:
    # as long as a cold start may take, so a redeploy cuts no healthy stream of ordinary length.
    graceful_shutdown_timeout_s: float = Field(default=300.0, gt=0)
    ping_interval_s: float = Field(default=5.0, gt=0)
    slot_refresh_s: float = Field(default=10.0, gt=0)
    # How often slot fragmentation and utilisation are copied from the telemetry agents.
    telemetry_refresh_s: float = Field(default=1.0, gt=0)
    # How often the warm pools are checked besides the moments a row ends or a warm actor is bound.
    warm_refresh_s: float = Field(default=1.0, gt=0)
    # How long a new ingress replica waits, before Serve routes to it, for each model that keeps a warm pool to
    # have an actor ready (warm or hot): a fresh deployment then serves its first requests instead of refusing
    # them while its first warm actors start (`serve run` says the app is ready only then). Past it, the replica
    # answers anyway and those models' requests are refused as starting. 0: it answers at once.
    startup_wait_s: float = Field(default=0.0, ge=0)
    num_replicas: int = Field(default=1, ge=1)
    # Serve's autoscaling_config for the ingress deployment (min_replicas, max_replicas,
    # target_ongoing_requests, ...): the control plane grows with traffic; replaces num_replicas.
    # Checked by Serve's own AutoscalingConfig when the app is built.
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = Field(default=512, ge=1)
    # The XGBoost scorer (serve_app/xgb_scorer.py); None, or a missing or invalid file: the rule.
    scorer_path: str | None = None
    # The rule's constants (serve_app/scorer.py), measured for this deployment.
    rule_scorer: RuleScorer = RuleScorer()
    # Predictions corrected by what runs now: each actor's measured step time (its engine's, heard when a
    # request starts there) and each placement kind's measured over predicted TTFT (serve_app/ttft_check.py).
    # Off: every prediction is the scorer's own, from its constants alone.
    is_prediction_corrected: bool = True
    # How the correction learns, and the margin a TTFT target is checked with (serve_app/ttft_check.py).
    ttft_check: TtftCheckConfig = TtftCheckConfig()
    traces: TraceArgs = TraceArgs()

    @field_validator("actor", mode="before")
    @classmethod
    def _actor_fields(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        for name, source in (("max_batch", "policy.max_batch"), ("namespace", "the top-level namespace"),
                             ("step_cost", "rule_scorer")):
            if name in value:
                raise ValueError(f"actor.{name} is set from {source}; set it there, once")
        if isinstance(value.get("resources"), dict):  # YAML gives a mapping; the frozen config keeps pairs
            value = value | {"resources": tuple(sorted(value["resources"].items()))}
        return value

    @field_validator("rule_scorer", mode="before")
    @classmethod
    def _rule_scorer_fields(cls, value: Any) -> Any:
        if isinstance(value, dict) and "step_threads" in value:
            raise ValueError("rule_scorer.step_threads is set from actor.compute_threads; set it there, once")
        return value

    @field_validator("registry", mode="before")
    @classmethod
    def _registry_fields(cls, value: Any) -> Any:
        named = {"name", "namespace", "actor_namespace"} & set(value or ())
        if isinstance(value, dict) and named:
            raise ValueError(f"registry.{sorted(named)[0]} is derived from the top-level namespace; not set here")
        return value

    @model_validator(mode="after")
    def _unique_ids(self) -> AppArgs:
        ids = [m.id for m in self.models]
        if len(set(ids)) != len(ids):
            raise ValueError(f"model ids must be unique, got {ids}")
        return self

    @model_validator(mode="after")
    def _a_first_actor_can_start(self) -> AppArgs:
        """Under the rule, no fresh actor meets a TTFT target within its process start: a model with such a
        target and no warm actors would have every request refused, and never an actor started."""
        if self.scorer_path is not None:
            return self
        fastest_start_s = self.rule_scorer.overhead_s + self.rule_scorer.actor_start_s
        for m in self.models:
            has_warm = any(self.policy.num_warm(m.id, lane) for lane in ("short", "long"))
            if m.ttft_target_s is not None and m.ttft_target_s <= fastest_start_s and not has_warm:
                raise ValueError(
                    f"model {m.id!r}: ttft_target_s {m.ttft_target_s:g} is within a fresh actor's start "
                    f"(rule_scorer.actor_start_s {self.rule_scorer.actor_start_s:g} s), so no actor would ever be "
                    f"started for it: keep warm actors for it (policy.num_warm_short_actors or warm_overrides) "
                    f"or raise the target")
        return self

    @field_validator("capacity", mode="before")
    @classmethod
    def _capacity_fields(cls, value: Any) -> Any:
        if isinstance(value, dict) and "slot_bundle" in value:
            raise ValueError("capacity.slot_bundle is derived from slots.kind; not set here")
        return value

    @model_validator(mode="after")
    def _capacity_needs_worker_slots(self) -> AppArgs:
        """Slots that follow the nodes: one per GPU, or per unit of a Ray resource. `cpu` slots are the ingress
        node's alone, and `auto` picks them on a cluster that starts with no GPU node."""
        if self.capacity.is_enabled and self.slots.kind not in ("gpu", "resource"):
            raise ValueError(f"capacity.is_enabled needs slots.kind gpu or resource (slots that nodes bring), "
                             f"got {self.slots.kind!r}")
        if self.capacity.is_enabled and self.slots.kind == "gpu" and not self.actor.num_gpus > 0:
            raise ValueError("capacity with GPU slots needs actor.num_gpus > 0: each slot's bundle is its share")
        return self

    @model_validator(mode="after")
    def _replicas_one_way(self) -> AppArgs:
        if self.autoscaling_config is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("set num_replicas or autoscaling_config, not both")
        return self


@dataclass(frozen=True)
class ModelSpec:
    id: str
    zqs_path: str | None
    demo_preset: str | None
    demo_dir: str
    display_name: str
    max_context: int | None
    ttft_target_s: float | None = None
    total_target_s: float | None = None
    tpot_target_s: float | None = None


@dataclass(frozen=True)
class IngressConfig:
    """What the ingress and its admission need: the components' frozen configs, and AppArgs'
    deadlines and intervals under the same names. Built by `ingress_config` only, which copies
    every field AppArgs has under the same name; the defaults are AppArgs' own."""

    models: tuple[ModelSpec, ...]
    slots: SlotArgs
    policy: PolicyConfig
    actor: ActorConfig
    registry: RegistryConfig
    leases: LeaseConfig
    capacity: CapacityConfig
    telemetry: TelemetryConfig
    rule_scorer: RuleScorer
    is_prediction_corrected: bool
    ttft_check: TtftCheckConfig
    api_key: str | None
    traces: TraceConfig | None  # None: off
    scorer_path: str | None
    max_body_bytes: int
    start_timeout_s: float
    token_timeout_s: float
    registry_timeout_s: float
    registry_probe_timeout_s: float
    registry_heartbeat_s: float
    early_refusal_s: float
    body_timeout_s: float
    placement_timeout_s: float
    ping_interval_s: float
    slot_refresh_s: float
    telemetry_refresh_s: float
    warm_refresh_s: float
    startup_wait_s: float


# The fields built below rather than copied as they are.
_BUILT = frozenset({"models", "actor", "registry", "capacity", "api_key", "traces", "rule_scorer"})


def ingress_config(args: AppArgs) -> IngressConfig:
    """Turn validated args into the frozen config; resolves the API key from its variable."""
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise ValueError(f"api_key_env names {args.api_key_env!r}, which is unset or empty")
    return IngressConfig(
        models=tuple(
            ModelSpec(m.id, m.zqs_path, m.demo_preset, m.demo_dir, m.display_name or m.id, m.max_context,
                      m.ttft_target_s, m.total_target_s, m.tpot_target_s)
            for m in args.models
        ),
        # The actor refuses rows beyond what the registry ever places: one figure for both.
        # Its steps are planned with the constants admission predicts with.
        actor=dataclasses.replace(args.actor, namespace=args.namespace, max_batch=args.policy.max_batch,
                                  step_cost=args.rule_scorer.step_cost()),
        # The registry lives in the deployment's namespace and watches its request actors there.
        registry=dataclasses.replace(args.registry, namespace=args.namespace, actor_namespace=args.namespace),
        # The constants were fitted on the threads an actor's steps compute on (benchmarks/bench_engine.py).
        rule_scorer=dataclasses.replace(args.rule_scorer, step_threads=args.actor.compute_threads),
        capacity=dataclasses.replace(args.capacity, slot_bundle=slot_bundle(args.slots, args.actor)),
        api_key=api_key,
        traces=TraceConfig(args.traces.path, args.traces.max_bytes) if args.traces.enabled else None,
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(IngressConfig) if f.name not in _BUILT},
    )


def slot_bundle(slots: SlotArgs, actor: ActorConfig) -> tuple[tuple[str, float], ...]:
    """One slot's bundle for the autoscaler: an actor's share of a GPU (a fractional actor's slot is that
    fraction of one), or a unit of the slot resource (none for CPU slots)."""
    if slots.kind == "gpu":
        return (("GPU", float(actor.num_gpus)),)
    if slots.kind == "resource":
        return ((slots.resource, 1.0),)
    return ()


def resolve_model_path(spec: ModelSpec) -> Path:
    """The model's `.zqs` file; a demo model is synthesised and packed on first use (weights_tool/demo.py)."""
    return resolve_zqs(spec.id, zqs_path=spec.zqs_path, demo_preset=spec.demo_preset, demo_dir=spec.demo_dir)
