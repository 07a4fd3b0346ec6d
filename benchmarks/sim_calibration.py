"""What the cluster simulator feeds its engines: the calibration, the request mix and the arrivals.

Service model of one request (a row), alone on its actor or replica:

    hot TTFT   = piecewise-linear interpolation of the measured hot TTFT at the actor
                 (request arrival -> first token) over prompt tokens, extrapolated along
                 the last measured segment
    cold TTFT  = spawn -> actor start + max(all layers resident, layer 0 resident + hot TTFT)
                 + a tail (the last layers' compute after the last load), counted from
                 the spawn decision: layer-streamed loading, compute starting on layer 0
    decode     = (output tokens - 1) * seconds per token (the first token comes from prefill)
    end to end = TTFT + decode; every request generates exactly its max_tokens

In a batch of b rows one decode step takes `slowdown(b) = 1 + batch_row_cost * (b - 1)`
times a one-row step (every weight is read once per step for the whole batch; each row
adds its compute and KV reads); how the engines apply it is in sim_model.py.

Every constant of the default preset is a figure this project measured; the comment on each
names the result file, table, row and column it comes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from serve_app.memory import ModelNumbers
from serve_app.policy import PolicyConfig
from weights_tool.architecture import ModelConfig

MiB = 1 << 20
GiB = 1 << 30
ArrivalKind = Literal["poisson", "bursty"]


@dataclass(frozen=True)
class Calibration:
    name: str
    description: str
    # (prompt tokens, hot TTFT seconds at the actor), ascending; at least two points.
    hot_ttft_points: tuple[tuple[int, float], ...]
    decode_s_per_token: float
    spawn_to_start_s: float  # Ray creates the worker process, which imports torch, until __init__ runs
    layer0_resident_s: float  # from actor start: init and layer 0 resident
    all_resident_s: float  # from actor start: every layer resident
    cold_first_token_s: float  # from actor start, measured with `cold_reference_tokens` of prompt
    cold_reference_tokens: int
    # Other measured (prompt tokens, cold first token from actor start): a check of the model, not inputs.
    cold_checks: tuple[tuple[int, float], ...]
    model_config: tuple[tuple[str, Any], ...]  # the HF config.json fields of the served shape
    slot_bytes: int
    actor_overhead_bytes: int
    # SLO: a request is good when its TTFT exceeds its own unloaded hot TTFT by at most this.
    slo_extra_s: float
    # A decode step of b rows takes (1 + batch_row_cost * (b - 1)) one-row steps.
    batch_row_cost: float
    sources: tuple[tuple[str, str, str], ...]  # (figure, value, where it comes from), for the report

    def __post_init__(self) -> None:
        xs = [x for x, _ in self.hot_ttft_points]
        if len(xs) < 2 or xs != sorted(set(xs)):
            raise ValueError(f"{self.name}: hot_ttft_points needs >= 2 points in ascending token order")
        if not 0 <= self.layer0_resident_s <= self.all_resident_s:
            raise ValueError(f"{self.name}: need 0 <= layer0_resident_s <= all_resident_s")
        if self.cold_tail_s < 0:
            raise ValueError(f"{self.name}: cold_first_token_s is below the modelled load and prefill")
        if not self.batch_row_cost >= 0:
            raise ValueError(f"{self.name}: batch_row_cost must be >= 0, got {self.batch_row_cost}")

    def slowdown(self, num_rows: int) -> float:
        """A decode step of `num_rows` rows, in one-row steps."""
        return 1.0 + self.batch_row_cost * (num_rows - 1)

    def hot_ttft_s(self, input_tokens: Any) -> np.ndarray:
        xs = np.array([x for x, _ in self.hot_ttft_points], dtype=float)
        ys = np.array([y for _, y in self.hot_ttft_points], dtype=float)
        n = np.asarray(input_tokens, dtype=float)
        inside = np.interp(n, xs, ys)
        # np.interp clamps at the ends; extend the end segments' slopes instead (prefill grows with tokens).
        low = ys[0] + (n - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0])
        high = ys[-1] + (n - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return np.maximum(np.where(n < xs[0], low, np.where(n > xs[-1], high, inside)), 0.0)

    @property
    def cold_tail_s(self) -> float:
        """After the overlapped load and prefill: the last layers' compute and the first token's sampling."""
        ref = float(self.hot_ttft_s(self.cold_reference_tokens))
        return self.cold_first_token_s - max(self.all_resident_s, self.layer0_resident_s + ref)

    def cold_from_start_s(self, input_tokens: Any) -> np.ndarray:
        hot = self.hot_ttft_s(input_tokens)
        return np.maximum(self.all_resident_s, self.layer0_resident_s + hot) + self.cold_tail_s

    def cold_ttft_s(self, input_tokens: Any) -> np.ndarray:
        return self.spawn_to_start_s + self.cold_from_start_s(input_tokens)

    def decode_s(self, output_tokens: Any) -> np.ndarray:
        return (np.asarray(output_tokens, dtype=float) - 1.0) * self.decode_s_per_token

    def model_numbers(self) -> ModelNumbers:
        return ModelNumbers.from_config(ModelConfig.from_hf(dict(self.model_config)))


_CS = "benchmarks/results/cold_start.md"
_SMALL_ROW = "'Cold TTFT, broken down', row small bfloat16 | short | page cache | streamed, derived N"

# From cold_start.md (its 15:45 UTC run); each figure is written once here and the sources below
# quote it. 'Hot TTFT', column 'actor: arrival -> first token', rows short, balanced, compute-bound:
_HOT_TTFT = ((16, 0.046), (1120, 0.449), (2240, 1.046))
# _SMALL_ROW, columns 'spawn -> start', 'layer 0 resident', 'all resident', 'first token':
_SPAWN_TO_START, _LAYER0, _ALL_RESIDENT, _COLD_FIRST = 1.617, 0.118, 0.626, 0.638
# The same table, rows balanced and compute-bound, page cache, streamed, derived N, 'first token':
_COLD_CHECKS = ((1120, 0.719), (2240, 1.215))
# A decode step's extra time per extra row of the batch, as a share of a one-row step: measured by
# benchmarks/results/batch.md ('a step grows by ... per extra row at context 128'; the mix's prompts
# are short, so the KV reads of long contexts are left out). The one place this figure lives.
_BATCH_ROW_COST = 0.056

CPU_MEASURED = Calibration(
    name="cpu-measured",
    description="this project's measurements: the `small` shape (100M parameters, bf16) on one CPU slot of "
                "a 2-core VM, loaded layer-streamed from a page-cached .zqs file",
    hot_ttft_points=_HOT_TTFT,
    # runtime.md, row small | bfloat16 | ours, column 'decode ms/token (p10-p90)': 41.13 ms.
    decode_s_per_token=0.04113,
    spawn_to_start_s=_SPAWN_TO_START,
    layer0_resident_s=_LAYER0,
    all_resident_s=_ALL_RESIDENT,
    cold_first_token_s=_COLD_FIRST,
    cold_reference_tokens=_HOT_TTFT[0][0],
    cold_checks=_COLD_CHECKS,
    # weights_tool/synth.py, PRESETS['small'].
    model_config=(("architectures", ["LlamaForCausalLM"]), ("hidden_size", 768), ("num_hidden_layers", 12),
                  ("num_attention_heads", 12), ("num_key_value_heads", 4), ("intermediate_size", 2048),
                  ("vocab_size", 32000), ("max_position_embeddings", 4096), ("tie_word_embeddings", True),
                  ("torch_dtype", "bfloat16")),
    # configs/serve.yaml: cpu_slot_bytes 2 GiB, policy.actor_overhead_bytes 256 MiB.
    slot_bytes=2 * GiB,
    actor_overhead_bytes=256 * MiB,
    # Chosen, not measured: a request that waited no longer than a few cold starts is good.
    slo_extra_s=5.0,
    batch_row_cost=_BATCH_ROW_COST,
    sources=(
        (f"hot TTFT at {' / '.join(str(n) for n, _ in _HOT_TTFT)} prompt tokens",
         f"{' / '.join(f'{t:.3f}' for _, t in _HOT_TTFT)} s", f"{_CS}, 'Hot TTFT', column 'actor: arrival -> first token'"),
        ("decode", "41.13 ms/token", "benchmarks/results/runtime.md, row small bfloat16 ours, 'decode ms/token'"),
        ("spawn -> actor start", f"{_SPAWN_TO_START:.3f} s", f"{_CS}, {_SMALL_ROW}, 'spawn -> start'"),
        ("layer 0 resident (from actor start)", f"{_LAYER0:.3f} s", f"{_CS}, {_SMALL_ROW}, 'layer 0 resident'"),
        ("all layers resident (from actor start)", f"{_ALL_RESIDENT:.3f} s", f"{_CS}, {_SMALL_ROW}, 'all resident'"),
        (f"cold first token, {_HOT_TTFT[0][0]}-token prompt (from actor start)", f"{_COLD_FIRST:.3f} s",
         f"{_CS}, {_SMALL_ROW}, 'first token'"),
        ("model", "small: 12 layers, hidden 768, bf16, 200 MB", "weights_tool/synth.py PRESETS['small']"),
        ("slot memory / actor overhead", "2 GiB / 256 MiB", "configs/serve.yaml (cpu_slot_bytes, policy)"),
        ("decode step, per extra row of a batch", f"+{_BATCH_ROW_COST:.0%} of a one-row step",
         "benchmarks/results/batch.md, fitted at context 128"),
        ("SLO: TTFT within its unloaded hot TTFT +", "5 s", "chosen"),
    ),
)

# A what-if, not a measurement: an 8B model on one H200 per slot. Where each figure comes from is
# in `sources`; none of them was measured by this project on a GPU.
GPU_ESTIMATE = Calibration(
    name="gpu-estimate",
    description="estimates (not measured): Llama-3-8B bf16 on one H200 per slot, weights copied from host memory",
    # 2 * 8.0e9 FLOP per prompt token at 100 TFLOP/s sustained (cold_start.md, 'On an accelerator':
    # an 8k-token prefill ~1.3 s), plus 15 ms of launch and sampling overhead (estimate).
    hot_ttft_points=((1, 0.015), (8192, 0.015 + 1.31)),
    # 16 GB of weights read per token at ~70% of the H200's 4.8 TB/s HBM (NVIDIA's figure).
    decode_s_per_token=0.0048,
    # The CPU measurement of spawn -> start (Ray worker start and imports) plus ~0.5 s for a CUDA context.
    spawn_to_start_s=round(_SPAWN_TO_START + 0.5, 1),
    # cold_start.md, 'On an accelerator': 16 GB from host memory at ~20 GB/s ~ 0.8 s; layer 0 after one
    # layer (0.44 GB) of 16 GB, the prompt's embedding rows read on their own.
    layer0_resident_s=0.03,
    all_resident_s=0.8,
    cold_first_token_s=0.81,
    cold_reference_tokens=1,
    cold_checks=(),
    # weights_tool/synth.py, PRESETS['llama-3-8b'].
    model_config=(("architectures", ["LlamaForCausalLM"]), ("hidden_size", 4096), ("num_hidden_layers", 32),
                  ("num_attention_heads", 32), ("num_key_value_heads", 8), ("intermediate_size", 14336),
                  ("vocab_size", 128256), ("max_position_embeddings", 8192), ("tie_word_embeddings", False),
                  ("torch_dtype", "bfloat16")),
    slot_bytes=141 * 10**9,  # H200
    actor_overhead_bytes=512 * MiB,  # configs/rayservice.yaml, policy.actor_overhead_bytes
    slo_extra_s=5.0,
    # Per extra row: 16 GFLOP at 500 TFLOP/s (0.03 ms) and ~130 MB of KV for a 1000-token context
    # (0.04 ms), against a 4.8 ms step: ~1.5%, rounded up.
    batch_row_cost=0.02,
    sources=(
        ("prefill", "15 ms + 0.16 ms/token", "estimate: 16 GFLOP/token at 100 TFLOP/s (cold_start.md, 'On an accelerator')"),
        ("decode", "4.8 ms/token", "estimate: 16 GB per token at ~70% of 4.8 TB/s HBM (H200 specification)"),
        ("spawn -> actor start", f"{round(_SPAWN_TO_START + 0.5, 1)} s",
         f"the CPU measurement ({_SPAWN_TO_START:.3f} s, cold_start.md) + ~0.5 s CUDA context (estimate)"),
        ("all layers resident", "0.8 s", "estimate: 16 GB from host memory at ~20 GB/s (cold_start.md, 'On an accelerator')"),
        ("decode step, per extra row of a batch", "+2% of a one-row step",
         "estimate: a row's compute and KV reads against the weight reads"),
        ("SLO: TTFT within its unloaded hot TTFT +", "5 s", "chosen"),
    ),
)

PRESETS = {c.name: c for c in (CPU_MEASURED, GPU_ESTIMATE)}


@dataclass(frozen=True)
class RequestClass:
    name: str
    share: float
    input_tokens: tuple[int, int]  # uniform over the integers, both ends included
    output_tokens: tuple[int, int]


# 10% long, 50% medium, 40% short. With PolicyConfig's default lanes (short: input <= 2048 and
# output <= 512) short and medium requests run on the short lane and long ones on the long lane.
# 3072 + 1024 tokens fit the `small` shape's 4096-token context.
MIXED_LENGTH = (
    RequestClass("short", 0.4, (64, 256), (32, 128)),
    RequestClass("medium", 0.5, (256, 1024), (128, 512)),
    RequestClass("long", 0.1, (2304, 3072), (640, 1024)),
)


@dataclass(frozen=True)
class Burst:
    """Base rate with a `multiplier`x spike for `spike_services` mean service times in every
    `period_services`; the base rate is set so that the mean over a period is the offered load."""

    multiplier: float = 10.0
    spike_services: float = 0.5
    period_services: float = 20.0


@dataclass(eq=False)
class Workload:
    arrival_s: np.ndarray
    class_index: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    warmup_s: float  # arrivals before this are simulated but not measured
    horizon_s: float  # arrivals stop here; the runs go on until every admitted request ends


@dataclass(eq=False)
class ServiceTimes:
    hot_ttft_s: np.ndarray
    cold_ttft_s: np.ndarray  # from the spawn decision
    decode_s: np.ndarray  # alone on its actor; in a batch each step takes slowdown(rows) times longer
    step_s: float = 0.0  # one decode step of one row
    batch_row_cost: float = 0.0  # see Calibration.batch_row_cost

    @classmethod
    def of(cls, cal: Calibration, workload: Workload) -> ServiceTimes:
        return cls(cal.hot_ttft_s(workload.input_tokens), cal.cold_ttft_s(workload.input_tokens),
                   cal.decode_s(workload.output_tokens), cal.decode_s_per_token, cal.batch_row_cost)

    def slowdown(self, num_rows: int) -> float:
        return 1.0 + self.batch_row_cost * (num_rows - 1)

    @property
    def hot_e2e_s(self) -> np.ndarray:
        return self.hot_ttft_s + self.decode_s


def _lane_work(cal: Calibration, c: RequestClass, policy: PolicyConfig) -> tuple[float, float, float]:
    """For one class, exactly: P(short lane), E[work; short lane], E[work], where work is the
    slot-time a request takes in a full batch: (hot TTFT + its time in the batch) / max_batch. In
    a full batch a row waits one step for the batch's next step boundary, then decodes, every step
    slowed by slowdown(max_batch) (sim_model.py)."""
    ins = np.arange(c.input_tokens[0], c.input_tokens[1] + 1)
    outs = np.arange(c.output_tokens[0], c.output_tokens[1] + 1)
    in_short = (ins <= policy.short_max_input_tokens).astype(float)
    out_short = (outs <= policy.short_max_output_tokens).astype(float)
    wait_s = cal.decode_s_per_token if policy.max_batch > 1 else 0.0
    ttft, decode = cal.hot_ttft_s(ins), cal.slowdown(policy.max_batch) * (cal.decode_s(outs) + wait_s)
    p_in, p_out = in_short.mean(), out_short.mean()
    # Inputs and outputs are independent: E[(ttft(i) + decode(o)) 1{i short} 1{o short}] factorises.
    short = (ttft * in_short).mean() * p_out + p_in * (decode * out_short).mean()
    return float(p_in * p_out), float(short) / policy.max_batch, float(ttft.mean() + decode.mean()) / policy.max_batch


def mean_hot_service_s(cal: Calibration, mix: tuple[RequestClass, ...]) -> float:
    """E[hot TTFT + decode] over the mix, each request alone on its actor, exactly (inputs and
    outputs are independent and uniform)."""
    total = 0.0
    for c in mix:
        ins = np.arange(c.input_tokens[0], c.input_tokens[1] + 1)
        outs = np.arange(c.output_tokens[0], c.output_tokens[1] + 1)
        total += c.share * (cal.hot_ttft_s(ins).mean() + cal.decode_s(outs).mean())
    return float(total)


def capacity_per_s(cal: Calibration, mix: tuple[RequestClass, ...], num_slots: int, max_batch: int = 1) -> float:
    """Capacity: what `num_slots` always-hot replicas, each running `max_batch` rows at a time
    (every step slowed by `slowdown(max_batch)`), serve at most."""
    policy = PolicyConfig(max_batch=max_batch)
    return num_slots / sum(c.share * _lane_work(cal, c, policy)[2] for c in mix)


def short_lane_share(cal: Calibration, mix: tuple[RequestClass, ...], policy: PolicyConfig) -> float:
    """The short lane's share of the slot-time the mix needs, every request hot in a full batch."""
    works = [_lane_work(cal, c, policy) for c in mix]
    short = sum(c.share * w[1] for c, w in zip(mix, works, strict=True))
    return short / sum(c.share * w[2] for c, w in zip(mix, works, strict=True))


def short_lane_probability(cal: Calibration, c: RequestClass, policy: PolicyConfig) -> float:
    return _lane_work(cal, c, policy)[0]


def make_workload(mix: tuple[RequestClass, ...], rate_per_s: float, horizon_s: float, warmup_s: float,
                  rng: np.random.Generator, burst: Burst | None = None, mean_service_s: float = 1.0) -> Workload:
    """Arrivals over [0, horizon_s) at mean `rate_per_s`: Poisson, or Poisson with periodic spikes.

    Bursts by time rescaling: unit-rate Poisson points mapped through the inverse of the
    cumulative rate, which is piecewise linear over a period (base, spike, base).
    """
    if burst is None:
        base, spike_s, period_s, mult = rate_per_s, 0.0, horizon_s, 1.0
    else:
        period_s, spike_s, mult = (burst.period_services * mean_service_s, burst.spike_services * mean_service_s,
                                   burst.multiplier)
        base = rate_per_s * period_s / (period_s + (mult - 1.0) * spike_s)
    per_period = base * (period_s + (mult - 1.0) * spike_s)
    total = per_period * horizon_s / period_s
    count = int(total + 8 * math.sqrt(total) + 16)
    u = np.cumsum(rng.exponential(1.0, count))
    u = u[u < total]
    k = np.floor(u / per_period)
    r = u - k * per_period
    # Within a period: base until the middle, the spike, then base again.
    before, during = base * period_s / 2, mult * base * spike_s
    t = np.where(r < before, r / base,
                 np.where(r < before + during, period_s / 2 + (r - before) / (mult * base),
                          period_s / 2 + spike_s + (r - before - during) / base))
    arrivals = k * period_s + t
    n = len(arrivals)
    shares = np.array([c.share for c in mix])
    cls = rng.choice(len(mix), size=n, p=shares / shares.sum())
    ins, outs = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    for i, c in enumerate(mix):
        sel = cls == i
        ins[sel] = rng.integers(c.input_tokens[0], c.input_tokens[1] + 1, sel.sum())
        outs[sel] = rng.integers(c.output_tokens[0], c.output_tokens[1] + 1, sel.sum())
    return Workload(arrivals, cls.astype(np.int8), ins, outs, warmup_s, horizon_s)
