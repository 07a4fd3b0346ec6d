"""What a request actor and its callers exchange: the request, the stream's items, its status.

Plain frozen dataclasses (Ray pickles them across processes); no Ray, no torch. A stream
is one `Started`, then `TextChunk`s, then one `Completion` (actors/request_actor.py); a
hot actor runs several such streams at once, one per row of its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from actors.sampling_params import SamplingParams


class ActorBusyError(RuntimeError):
    """A request reached an actor that cannot take it now: its batch is full, it is loading, or it exits."""


class Phase(str, Enum):
    STARTING = "STARTING"
    LOADING = "LOADING"
    WARM = "WARM"  # a warm actor's first layers are resident; it waits for its request
    PREFILL = "PREFILL"
    DECODE = "DECODE"
    IDLE = "IDLE"
    EXITED = "EXITED"


@dataclass(frozen=True)
class ActorRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    keep_hot: bool = False
    # Every token its own chunk, sent the moment it is sampled (X-Stream-Mode: low-latency); else
    # tokens sampled within the row's chunk interval of the previous chunk ride together (actors/stream_chunks.py).
    is_low_latency: bool = False
    # The request's TPOT target: while it decodes, its batch's steps carry no more prompt work
    # than keeps them within it (actors/scheduler.py). None: only the configured chunk cap.
    tpot_target_s: float | None = None
    # When its first token is due (epoch s): its arrival at the ingress and its TTFT target. While its prompt
    # runs, every step carries enough of it to bring the first token half way from its joining to then
    # (scheduler.tokens_due, paced_due). The ingress's clock: across nodes their offset moves it, as it does the
    # TTFT the traces measure. None: no target.
    first_token_due: float | None = None


@dataclass(frozen=True)
class Timings:
    """Epoch seconds. first_layer_resident / all_layers_resident are None on a hot actor's
    second request only in the sense that they happened earlier: they keep their original values."""

    actor_start: float
    request_arrival: float  # the actor received the request
    first_layer_resident: float | None
    all_layers_resident: float | None
    compute_start: float
    first_layer_compute_start: float
    first_token: float | None
    last_token: float | None
    embeddings_resident: float | None = None  # the whole table; the prompt's rows may come earlier


@dataclass(frozen=True)
class Started:
    """The first item of every stream: the actor began computing (prefill) at `time`."""

    request_id: str
    time: float
    is_cold: bool
    step_correction: float = 1.0  # the engine's, as its StartEvent says: the router prices this actor's steps by it
    step_baseline: float = 1.0  # its slow average: what the router expects of the actor once it stops hearing


@dataclass(frozen=True)
class TextChunk:
    """One or more tokens' text; tokens sampled while the previous chunk was in flight ride together."""

    token_ids: tuple[int, ...]
    text: str
    num_output_tokens: int  # so far, this chunk included
    time: float  # when its last token was sampled


@dataclass(frozen=True)
class Completion:
    """The last item of every stream."""

    request_id: str
    stop_reason: str
    stop_sequence: str | None
    input_tokens: int
    output_tokens: int
    is_cold: bool
    first_layers: int
    timings: Timings
    peak_bytes: int | None = None  # see actors/peak_memory.py; None where it cannot be measured
    # The engine's step clock (actors/engine.py): seconds of the steps this row took part in (a cold
    # row's first step includes its waits on the weights), the mean rows those steps ran, and the mean threads
    # they computed on (fewer than actor.compute_threads while the node was busy: actors/thread_governor.py).
    engine_s: float = 0.0
    mean_step_rows: float = 0.0
    mean_step_threads: float = 0.0
    # The steps checked against their prediction (actors/step_cost.py): predicted and measured seconds.
    predicted_step_s: float = 0.0
    checked_step_s: float = 0.0

    def compute_density(self, arrival: float) -> float | None:
        """Engine time on this request ÷ its wall time from `arrival` (epoch s) to its last token.

        Seed 001's per-request monitoring dimension in place of a queue length: 1 means the
        engine computed it the whole time; what is missing is time it waited (a start, a load,
        a step it joined late). None when it produced no token.
        """
        last = self.timings.last_token
        if last is None or last <= arrival:
            return None
        return min(1.0, self.engine_s / (last - arrival))


@dataclass(frozen=True)
class ActorStatus:
    name: str
    phase: Phase
    num_layers_resident: int
    num_layers: int
    transitions: tuple[tuple[str, float], ...]
    num_requests_served: int
    accounted_bytes: int  # weights, plus the KV caches of the rows running
    load_bytes_per_s: float
    num_rows: int = 0  # requests running or joining
    resident_fraction: float = 0.0  # share of the weight bytes loaded
    pid: int = 0  # the actor's process (benchmarks read its resident set)
    # The threads its steps compute on now, and how often that changed (actors/thread_governor.py); 0: torch's own.
    compute_threads: int = 0
    num_thread_changes: int = 0
