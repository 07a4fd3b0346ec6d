"""What one cold-start run records: its start conditions, each actor's run, the in-process reference, the calibration.

`benchmarks.bench_cold_start` measures these and saves them as JSON; the report
(`benchmarks.cold_start_report`) and its goals read them back. Both import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from actors.messages import Timings

DERIVED, FIRST_ONE, BASELINE = "streamed, derived N", "streamed, N=1", "load-then-compute"
MODES = (DERIVED, FIRST_ONE, BASELINE)
PAGE_CACHE, EVICTED = "page cache", "evicted"


@dataclass(frozen=True)
class Run:
    model: str
    prompt: str  # "short" | "balanced" | "compute-bound"
    prompt_tokens: int
    mode: str
    storage: str
    first_layers: int  # N the actor used
    spawn: float  # epoch seconds of the spawn call (the request was sent right after)
    loading_at: float  # the actor's LOADING transition: the stream has started
    client_first_chunk: float  # the first token reached the driver
    cold: Timings
    hot_call: float
    hot_client_first_chunk: float
    hot: Timings

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Run:
        """A run as saved in the JSON (`dataclasses.asdict`), its Timings rebuilt."""
        return cls(**{**d, "cold": Timings(**d["cold"]), "hot": Timings(**d["hot"])})


@dataclass(frozen=True)
class InProcess:
    """Hot TTFT's reference: the driver's own `Engine`, same prompt and threads, after a warm-up."""

    model: str
    prompt: str
    ttft: float  # generate() called -> first token
    prefill: float  # compute start -> first token


@dataclass(frozen=True)
class Calibration:
    """What sizes the prompts and feeds the derived N: the load in-process, prefill on a hot actor."""

    model: str
    dtype: str
    num_layers: int
    num_params: int
    weight_bytes: int
    file_bytes: int
    load_s: float  # in-process: stream_zqs called -> every group resident, load_threads threads
    init_s: float  # of which: header, tokenizer, allocation, threads started
    load_bytes_per_s: float  # LayerStream.throughput(): weight bytes / streaming seconds
    prompts: dict[str, int]  # label -> tokens
    prefill_s: dict[str, float]  # label -> prefill seconds on the hot calibration actor
    prefill_flops_per_s: float
    expected_n: dict[str, int]  # label -> choose_first_layers with the rates above
