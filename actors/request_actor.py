"""One Ray actor per request: stream the weights in, compute while they arrive, answer, exit.

Lifecycle (queryable through `status()`, every transition time-stamped):

    STARTING -> LOADING (k of L layers) -> PREFILL -> DECODE -> IDLE -> EXITED
                                                            \\-> EXITED

The actor starts streaming its `.zqs` file the moment it is constructed, so loading
overlaps the request's trip to the actor. Prefill starts once the first N layers are
resident (N from config, or derived by `cold_start.choose_first_layers` from the load
rate measured so far and the prompt length) and layer i's compute waits only for
layer i. Layer 0 needs only the prompt's embedding rows, read on their own where the
file stores the table raw (actors/layer_loader.py); the whole table, and its checksum,
is waited for before the first token. After decode the actor exits through `ray.actor.exit_actor()` — unless the
request asked it to stay hot: then it drops its KV cache and waits, IDLE, for the next
request, which runs on the weights already resident.

Generation runs on a worker thread; the async `generate` method relays its events as a
Ray streaming generator. When the caller cancels the stream, the cancellation reaches
the relay, which sets a flag that the decode loop polls between steps.

Memory. The actor tells its node's telemetry agent what it holds (weights; weights + KV
cache while a request decodes) and withdraws that on exit; each `Completion` carries the
request's measured peak (`actors/peak_memory.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from actors.cold_start import choose_first_layers, estimate_prefill_layer_seconds
from actors.engine import Engine, FinishEvent, TokenEvent
from actors.heap import IdleTrimmer, retain_freed_memory
from actors.messages import (
    ActorRequest,
    ActorStatus,
    Completion,
    Phase,
    Started,
    TextChunk,
    Timings,
)
from actors.model import EMBEDDINGS_GROUP
from actors.peak_memory import PeakMemory
from actors.telemetry_agent import AgentReporter

log = logging.getLogger(__name__)


class ActorBusyError(RuntimeError):
    """A request reached an actor that is already serving one (actors run one at a time)."""


@dataclass(frozen=True)
class ActorConfig:
    """How request actors are placed and how they load; one per deployment, from YAML."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0  # 1 (or a fraction) on GPU clusters
    resources: tuple[tuple[str, float], ...] = ()  # e.g. (("zq_slot", 1.0),) for CPU slots
    namespace: str = "zeroqueue"
    load_threads: int = 1
    # Threads for torch's compute; on a CPU node loading and compute share the cores.
    compute_threads: int = 1
    first_layers: int | None = None  # None: derived per request (see cold_start)
    # Every group resident before prefill starts: load-then-compute, the cold-start
    # benchmark's baseline (first_layers = L still streams the table and the final group).
    is_load_then_compute: bool = False
    # Prefill compute rate used to derive first_layers; measured by bench_cold_start.
    prefill_flops_per_s: float = 2.0e10
    # Load rate assumed before the stream has finished its first layer.
    initial_load_bytes_per_s: float = 1.0e9
    load_timeout_s: float = 300.0
    # On CPU slots the actors' compute shares cores with the proxy, ingress and registry;
    # a lower priority keeps admission and refusals fast however busy the slots are.
    cpu_nice: int = 10
    # At most one chunk per interval is sent; 0 sends every token on its own.
    stream_interval_s: float = 0.005
    # Keep activation memory freed inside a request for the next layer, on huge pages
    # (actors/heap.py); a hot actor gives it back once idle this long, so back-to-back
    # requests do not page-fault their working set in again.
    is_freed_memory_retained: bool = True
    idle_trim_after_s: float = 2.0

    def actor_options(self, name: str) -> dict:
        return {
            "name": name,
            "namespace": self.namespace,
            "lifetime": "detached",
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "resources": dict(self.resources),
            "max_restarts": 0,
            "max_task_retries": 0,
            # generate + status/release may run side by side; generate itself is one at a time.
            "max_concurrency": 4,
        }


@dataclass
class _State:
    phase: Phase = Phase.STARTING
    transitions: list[tuple[str, float]] = field(default_factory=list)
    num_served: int = 0
    is_busy: bool = False

    def enter(self, phase: Phase) -> None:
        self.phase = phase
        self.transitions.append((phase.value, time.time()))


class RequestActor:
    def __init__(self, zqs_path: str, config: ActorConfig, device: str | None = None):
        import torch

        from actors.layer_loader import stream_zqs

        self.name = _own_name()
        self.config = config
        self._state = _State()
        self._state.enter(Phase.STARTING)
        self._actor_start = self._state.transitions[0][1]
        torch.set_num_threads(config.compute_threads)
        if config.is_freed_memory_retained:
            retain_freed_memory()
        self._idle_trimmer = IdleTrimmer(config.idle_trim_after_s)
        if device is None:
            device = "cuda" if config.num_gpus > 0 and torch.cuda.is_available() else "cpu"
        if device == "cpu" and config.cpu_nice:
            os.nice(config.cpu_nice)
        self._streamed = stream_zqs(zqs_path, device=device, num_threads=config.load_threads)
        self._model = self._streamed.model
        self._engine = Engine(self._model, self._streamed.tokenizer)
        self._num_layers = self._streamed.config.num_layers
        self._weight_bytes = sum(p.numel() * p.element_size() for p in self._model.parameters())
        is_cuda = str(device).startswith("cuda")
        self._peak = PeakMemory(is_cuda)
        self._reporter = AgentReporter(self.name, config.namespace, is_cuda)
        self._reporter.report(self._weight_bytes)
        self._stream_open = True
        self._state.enter(Phase.LOADING)
        log.info("%s: streaming %s onto %s", self.name, Path(zqs_path).name, device)

    # ---- queries ---------------------------------------------------------------------

    def status(self) -> ActorStatus:
        stream = self._streamed.stream
        resident = sum(stream.is_ready(i) for i in range(self._num_layers))
        return ActorStatus(
            name=self.name,
            phase=self._state.phase,
            num_layers_resident=resident,
            num_layers=self._num_layers,
            transitions=tuple(self._state.transitions),
            num_requests_served=self._state.num_served,
            accounted_bytes=self._accounted_bytes(),
            load_bytes_per_s=stream.throughput(),
        )

    # ---- serving ---------------------------------------------------------------------

    async def generate(self, request: ActorRequest):
        """Stream one `Started`, then `TextChunk`s, then one `Completion`. One request at a time."""
        if self._state.is_busy or self._state.phase == Phase.EXITED:
            raise ActorBusyError(f"{self.name} is {self._state.phase.value}; it serves one request at a time")
        self._state.is_busy = True
        self._idle_trimmer.request_started()
        arrival = time.time()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def emit(item) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        worker = threading.Thread(
            target=self._run, args=(request, arrival, cancel, emit), name=f"generate-{request.request_id}", daemon=True
        )
        worker.start()
        completion = None
        interval = self.config.stream_interval_s
        try:
            while True:
                items = [await events.get()]
                if interval:
                    # Chunks sent faster than this only cost the relay (a Ray object each),
                    # so tokens sampled meanwhile travel together.
                    await asyncio.sleep(interval)
                while not events.empty():
                    items.append(events.get_nowait())
                for item in _coalesce(items):
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if isinstance(item, Completion):
                        completion = item
                if completion is not None:
                    break
        finally:
            cancel.set()
            # The worker stops within one decode step once cancelled.
            await asyncio.to_thread(worker.join)
            self._after_request(completion is not None and request.keep_hot)

    async def release(self) -> None:
        """Retire an idle hot actor: the ingress no longer wants it kept."""
        if self._state.is_busy:
            raise ActorBusyError(f"{self.name} is serving a request; it exits when that ends")
        self._exit()

    async def shutdown(self) -> None:
        """Called by the actor on itself: exit once the current call has returned."""
        import ray

        ray.actor.exit_actor()

    # ---- internals -------------------------------------------------------------------

    def _run(self, request: ActorRequest, arrival: float, cancel: threading.Event, emit) -> None:
        is_cold = self._state.num_served == 0  # this request paid for loading the weights
        first_layers = 0 if self._all_resident() else self._first_layers(len(request.prompt_ids))
        is_load_all_first = bool(first_layers) and self.config.is_load_then_compute
        if is_load_all_first:
            first_layers = self._num_layers
        marks: dict[str, float] = {}
        timeout = self.config.load_timeout_s
        stream = self._streamed.stream

        is_rows_ready = False
        num_layers = self._num_layers

        def wait_layer(i: int) -> None:
            if i == EMBEDDINGS_GROUP and is_rows_ready:
                return  # the prompt's rows are in; the rest of the table follows the layers
            if i == 0 and first_layers > 1:
                stream.wait(first_layers - 1, timeout)  # the first N layers resident before prefill
            stream.wait(i, timeout)
            if i == num_layers:
                # The whole table, checked, before the first token: the first decode step
                # looks up a new token, a tied lm_head is the table, and the prompt's rows
                # were read unchecked.
                stream.wait(EMBEDDINGS_GROUP, timeout)
            if i == 0:
                marks["first_layer_compute_start"] = time.time()

        try:
            self._peak.reset()
            if is_load_all_first:
                self._streamed.wait_all(timeout)
            is_rows_ready = self._streamed.load_rows(request.prompt_ids)
            if not is_rows_ready:
                stream.wait(EMBEDDINGS_GROUP, timeout)  # a compressed table: all of it first
            self._state.enter(Phase.PREFILL)
            emit(Started(request.request_id, self._state.transitions[-1][1], is_cold))
            for event in self._engine.generate(
                list(request.prompt_ids), request.sampling, cancel=cancel.is_set, wait_layer=wait_layer
            ):
                if isinstance(event, TokenEvent):
                    if event.num_output_tokens == 1:
                        self._state.enter(Phase.DECODE)
                        self._reporter.report(self._accounted_bytes())  # the KV cache is in place now
                    emit(TextChunk((event.token_id,), event.text, event.num_output_tokens, event.time))
                elif isinstance(event, FinishEvent):
                    emit(self._completion(request, arrival, event, is_cold, first_layers, marks))
        except BaseException as e:  # surfaced to the caller through the stream
            log.exception("%s: request %s failed", self.name, request.request_id)
            emit(e)

    def _completion(self, request, arrival: float, event: FinishEvent, is_cold: bool, first_layers: int, marks) -> Completion:
        ready = self._streamed.stream.ready_times()  # seconds since the stream started
        stream_start = self._stream_started_at()
        return Completion(
            request_id=request.request_id,
            stop_reason=event.stop_reason,
            stop_sequence=event.stop_sequence,
            input_tokens=event.input_tokens,
            output_tokens=event.output_tokens,
            is_cold=is_cold,
            first_layers=first_layers,
            timings=Timings(
                actor_start=self._actor_start,
                request_arrival=arrival,
                first_layer_resident=stream_start + ready[0] if 0 in ready else None,
                embeddings_resident=stream_start + ready[EMBEDDINGS_GROUP] if EMBEDDINGS_GROUP in ready else None,
                all_layers_resident=stream_start + max(ready.values()) if self._all_resident() else None,
                compute_start=event.compute_start,
                first_layer_compute_start=marks.get("first_layer_compute_start", event.compute_start),
                first_token=event.first_token_time,
                last_token=event.last_token_time,
            ),
            peak_bytes=self._peak.read(),
        )

    def _first_layers(self, prompt_tokens: int) -> int:
        c = self._streamed.config
        if self.config.first_layers is not None:
            return max(1, min(c.num_layers, self.config.first_layers))
        layer_bytes = sum(
            p.numel() * p.element_size() for p in self._model.group_parameters(0).values()
        )
        rate = self._streamed.stream.throughput() or self.config.initial_load_bytes_per_s
        params_per_layer = sum(p.numel() for p in self._model.group_parameters(0).values())
        t_compute = estimate_prefill_layer_seconds(
            params_per_layer, c.num_heads, c.head_dim, prompt_tokens, self.config.prefill_flops_per_s
        )
        return choose_first_layers(c.num_layers, layer_bytes / rate, t_compute)

    def _accounted_bytes(self) -> int:
        return self._weight_bytes + sum(c.nbytes() for c in self._model.kv_caches)

    def _all_resident(self) -> bool:
        stream = self._streamed.stream
        return all(stream.is_ready(i) for i in range(-1, self._num_layers + 1))

    def _stream_started_at(self) -> float:
        # LayerStream's ready times count from its own start, which follows header
        # parsing and model allocation; `started_at` is that instant in epoch seconds.
        return self._streamed.stream.started_at

    def _after_request(self, stay_hot: bool) -> None:
        self._state.num_served += 1
        self._state.is_busy = False
        if stay_hot:
            if self._stream_open and self._all_resident():
                self._streamed.close()  # the loader threads are done; free them
                self._stream_open = False
            self._idle_trimmer.request_ended()  # the request's activations go back if no request follows
            self._state.enter(Phase.IDLE)
            self._reporter.report(self._accounted_bytes())  # the KV cache was dropped
        else:
            self._exit()

    def _exit(self) -> None:
        import ray

        self._state.enter(Phase.EXITED)
        self._reporter.forget()
        self._streamed.close()
        ray.get_runtime_context().current_actor.shutdown.remote()


def _coalesce(items: list) -> list:
    """Merge runs of consecutive TextChunks into one; every other item keeps its place."""
    out: list = []
    for item in items:
        prev = out[-1] if out else None
        if isinstance(item, TextChunk) and isinstance(prev, TextChunk):
            out[-1] = TextChunk(prev.token_ids + item.token_ids, prev.text + item.text,
                                item.num_output_tokens, item.time)
        else:
            out.append(item)
    return out


def new_actor_name(model: str) -> str:
    return f"zq-{model}-{uuid.uuid4().hex[:12]}"


def spawn(zqs_path: str, config: ActorConfig, name: str):
    """Create the detached actor; its loading starts at once."""
    import ray

    return ray.remote(RequestActor).options(**config.actor_options(name)).remote(zqs_path, config)


def _own_name() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_actor_name() or "request-actor"
    except Exception:  # constructed outside Ray (tests of the class itself)
        return "request-actor"
