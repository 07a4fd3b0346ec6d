"""The cold-start report's rows: a median with its range, one row per mode, one hot-TTFT row per prompt.

`benchmarks.cold_start_report` computes them from a run; `benchmarks.cold_start_goals`
judges them. Both import them from here.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Stat:
    median: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.median:.3f} ({self.low:.3f}–{self.high:.3f})"


def summarize(values: Iterable[float]) -> Stat:
    values = list(values)
    if not values:
        raise ValueError("no values to summarize")
    return Stat(statistics.median(values), min(values), max(values))


@dataclass(frozen=True)
class Row:
    model: str
    prompt: str
    prompt_tokens: int
    storage: str
    mode: str
    regime: str
    first_layers: tuple[int, ...]
    stats: dict[str, Stat]
    load_ref: float  # median load of the group's load-then-compute runs
    prefill_ref: float  # median hot prefill of the group
    efficiency: float
    vs_baseline: float


@dataclass(frozen=True)
class HotRow:
    model: str
    prompt: str
    prompt_tokens: int
    actor: Stat  # the hot actor: request arrival -> first token
    actor_before_compute: Stat  # request arrival -> compute start
    actor_prefill: Stat  # compute start -> first token
    client: Stat  # the driver: generate.remote() -> first token received
    in_process: Stat
    in_process_prefill: Stat

    @property
    def ratio(self) -> float:
        return self.actor.median / self.in_process.median
