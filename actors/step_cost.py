"""What one step of a batch is predicted to cost, and how far the steps measured agree. Pure: no torch.

A step is one forward over every row (actors/scheduler.py): it reads every weight once for
the whole batch, computes a little more per row, computes each further prompt token of the
prefill chunks in it, and reads every row's KV cache. The rule, one formula for the
engine's planner and the router's rule scorer (serve_app/scorer.py):

    step_s = decode_s_per_token * (1 + batch_row_cost * (rows - 1))
           + prompt tokens beyond each row's first / prefill_tokens_per_s
           + KV positions read * kv_bytes_per_token / kv_read_bytes_per_s
           + prompt attention pairs / attention_pairs_per_s

A row counts once whether it decodes a token or prefills a chunk (either way the step reads
every weight for it and samples from its last position); a prompt of n tokens alone takes
`prefill_s(n)` = decode_s_per_token + (n - 1) / prefill_tokens_per_s: the weights' pass, then
the marginal cost of each further token.

A prompt token also attends to every position of its row before it: a chunk of n prompt
tokens after c cached ones computes n * c + n * (n - 1) / 2 (query, key) pairs in every
layer and head (`prompt_pairs`). At GuideLLM's ~130 tokens that is a few ms, inside the
fitted per-token rate; at 1,024 tokens it is a third of the prompt's time (SmolLM2 on 2
threads: 1.08 s where the per-token rate alone says 0.74, benchmarks/results/
engine_avx512bf16.md), and a router that prices a long prompt by the short one's rate
admits it past its TTFT target.
`attention_pairs_per_s` prices them (benchmarks/bench_engine.py fits it beside
`prefill_tokens_per_s`, from a 128- and a 1,024-token prompt); its default, infinite,
leaves them unpriced, as the rule was before it.

The constants are measured per model and machine (benchmarks/bench_engine.py fits them for
the served model) and set in the app config (`rule_scorer`). A machine unlike the one they
were measured on makes every step faster or slower alike, so `StepCheck` keeps a running
ratio of measured to predicted step time that the planner multiplies in, and the error of
what it predicted, which the engine logs and the ingress exports per request. It also keeps a
slow average of that ratio, the actor's `baseline`: how far off the constants are on this
machine as it usually runs, not in the last few steps. A router that has not heard from an
actor for a while expects its baseline, not the constants' own speed (serve_app/lease_book.py):
on a CPU unlike the constants' (fp32 on one without native bf16: 4-5x the bf16 fit's steps) the
constants alone would price every burst after a pause at a fraction of what it takes.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """The rule's constants (module docstring). Defaults are placeholders of the right order for a small model."""

    decode_s_per_token: float = 0.03  # one row's step at a short context
    batch_row_cost: float = 0.05  # a step's extra time per extra row, as a share of a one-row step
    prefill_tokens_per_s: float = 4000.0  # marginal: each prompt token beyond a row's first
    kv_read_bytes_per_s: float = 2.0e10
    attention_pairs_per_s: float = math.inf  # a prompt token's (query, key) pairs, all layers and heads; inf: free

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "kv_read_bytes_per_s", "attention_pairs_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StepCost.{name} must be > 0, got {getattr(self, name)}")
        for name in ("decode_s_per_token", "batch_row_cost"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"StepCost.{name} must be >= 0, got {getattr(self, name)}")

    def step_s(self, num_rows: int, num_extra_prompt_tokens: int, num_kv_tokens: int,
               kv_bytes_per_token: int, num_attention_pairs: int = 0) -> float:
        """Seconds of one step of `num_rows` rows (>= 1), `num_extra_prompt_tokens` prompt tokens beyond each
        row's one, `num_kv_tokens` KV positions read by every row's attention, summed, and the prompt chunks'
        `num_attention_pairs` (`prompt_pairs`, summed over the rows)."""
        rows = self.decode_s_per_token * (1.0 + self.batch_row_cost * (max(1, num_rows) - 1))
        return (rows + num_extra_prompt_tokens / self.prefill_tokens_per_s
                + num_kv_tokens * kv_bytes_per_token / self.kv_read_bytes_per_s
                + num_attention_pairs / self.attention_pairs_per_s)

    def prefill_s(self, num_prompt_tokens: int) -> float:
        """One row's prompt in a step of its own (its KV reads aside): the weights' pass, then each further token
        and its attention to the tokens before it."""
        return (self.decode_s_per_token + max(0, num_prompt_tokens - 1) / self.prefill_tokens_per_s
                + self.prompt_attention_s(num_prompt_tokens))

    def prompt_attention_s(self, num_prompt_tokens: int, num_cached: int = 0) -> float:
        """The attention of `num_prompt_tokens` prompt tokens after `num_cached` positions of their row."""
        return prompt_pairs(num_cached, num_prompt_tokens) / self.attention_pairs_per_s

    def prefill_token_s(self, kv_bytes_per_token: int) -> float:
        """What one more prompt token adds to a step: its compute, and its own position's KV read."""
        return 1.0 / self.prefill_tokens_per_s + kv_bytes_per_token / self.kv_read_bytes_per_s


def prompt_pairs(num_cached: int, num_tokens: int) -> int:
    """(query, key) pairs of a chunk of `num_tokens` prompt tokens after `num_cached` positions: each attends to
    the cached ones and to the chunk's tokens before it (its own key counts in the KV read term)."""
    return num_tokens * num_cached + num_tokens * (num_tokens - 1) // 2


RECENT_STEPS = 3  # StepCheck's default `recent_steps`: a slower host priced so within two steps


class StepCheck:
    """Measured step times against predicted ones: the correction the planner applies, and the error it makes.

    `correction` is an exponentially weighted mean of measured ÷ rule-predicted (`weight` per
    step), within [min_correction, max_correction] so that one step stalled by the machine
    cannot make the planner believe every step takes seconds; or, where more, the median of the
    last `recent_steps` ratios: a host that turns several times slower (a load generator starting
    beside the server) is priced so within two steps, not after the tens of steps the mean takes
    to follow, while one stalled step among them moves nothing. 0: the mean alone. The bound is 8: SmolLM2 in fp32 on
    an AVX2 host steps 4-5x the rule fitted on AVX512-BF16; with a bound of 4 the corrections sat
    at it and steps ran 1.09-1.28x the prediction (benchmarks/results/peer_avx2.md, step ratio
    P50). `baseline` is the same ratio's mean over many more steps (`baseline_weight`), from the first step measured (1 before any):
    the level the router falls back to (module docstring). `recent_errors` keeps
    |measured ÷ corrected prediction - 1| of the last `window` steps: the planner's own error.
    """

    def __init__(self, weight: float = 0.1, window: int = 256, min_correction: float = 0.25,
                 max_correction: float = 8.0, baseline_weight: float = 0.01, recent_steps: int = RECENT_STEPS) -> None:
        if (not 0 < weight <= 1 or not 0 < baseline_weight <= 1 or window < 1 or recent_steps < 0
                or not 0 < min_correction <= 1 <= max_correction):
            raise ValueError(f"StepCheck needs 0 < weight, baseline_weight <= 1, window >= 1, recent_steps >= 0 and "
                             f"min <= 1 <= max correction, got {weight}, {baseline_weight}, {window}, {recent_steps}, "
                             f"{min_correction}, {max_correction}")
        self.weight, self.min_correction, self.max_correction = weight, min_correction, max_correction
        self.baseline_weight = baseline_weight
        self.mean = 1.0  # the exponentially weighted mean of the ratios
        # What the planner multiplies the rule by: the mean, or the recent steps' median where more (class doc). Set
        # once a step, by `observe`: the planner reads it for every step size it tries.
        self.correction = 1.0
        self.recent: deque[float] = deque(maxlen=recent_steps)  # the last ratios, bounded as the mean's are
        self.baseline = 1.0
        self.num_steps = 0
        self.recent_errors: deque[float] = deque(maxlen=window)

    @classmethod
    def seeded_from(cls, other: StepCheck) -> StepCheck:
        """A check starting at `other`'s correction and baseline, with none of its steps counted."""
        check = cls(other.weight, other.recent_errors.maxlen or 1, other.min_correction, other.max_correction,
                    other.baseline_weight, other.recent.maxlen or 0)
        check.mean = check.correction = other.correction
        check.baseline = other.baseline
        return check

    def observe(self, rule_s: float, measured_s: float) -> None:
        """One measured step whose rule prediction (before correction) was `rule_s`."""
        if rule_s <= 0 or measured_s <= 0:
            return
        self.recent_errors.append(abs(measured_s / (rule_s * self.correction) - 1.0))
        ratio = min(self.max_correction, max(self.min_correction, measured_s / rule_s))
        self.mean = (1 - self.weight) * self.mean + self.weight * ratio
        recent = self.recent
        recent.append(ratio)
        is_recent_full = recent.maxlen and len(recent) == recent.maxlen
        self.correction = max(self.mean, statistics.median(recent)) if is_recent_full else self.mean
        # A plain mean of the steps so far until there are 1 / baseline_weight of them: from the first step the
        # baseline is the measured level (the constants may be far off), and no single first step dominates it.
        w = max(self.baseline_weight, 1.0 / (self.num_steps + 1))
        self.baseline = (1 - w) * self.baseline + w * ratio
        self.num_steps += 1

    def median_error(self) -> float | None:
        return statistics.median(self.recent_errors) if self.recent_errors else None
