"""A Ray actor that serves requests from a `.zqs` file: streams the weights in, computes while they arrive.

Lifecycle (queryable through `status()`, every transition time-stamped):

    STARTING -> LOADING (k of L layers) [-> WARM] -> PREFILL -> DECODE <-> IDLE -> EXITED
                                                                     \\-> EXITED

Cold. The actor starts streaming its `.zqs` file the moment it is constructed, so loading
overlaps the request's trip to the actor. Its first request is the only one it takes
while loading: prefill starts once the first N layers are resident (N from config, or
derived by `cold_start.choose_first_layers` from the load rate measured so far and the
prompt length) and layer i's compute waits only for layer i. Layer 0 needs only the
prompt's embedding rows, read on their own where the file stores the table raw
(actors/layer_loader.py); the whole table, and its checksum, is waited for before the
first token, so once a first token exists every weight is resident.

Warm. Created with `warm_layers=N`, the actor is started ahead of any request: it imports
everything, allocates the model, builds the tokenizer and loads the embeddings and layers
0..N-1, then holds the stream (`ready()` returns then; phase WARM). Its first request is
served exactly as a cold one, except that the process is up and the first N layers are
in: the stream resumes the moment the request arrives, and prefill starts at once when
N covers what the prompt needs (`cold_start.choose_first_layers`). With N every layer, nothing is
held: its weights are packed for the actors' kernels before `ready()` returns, so its first request
neither computes with the plain weights nor shares the GIL with the packing thread.

Hot. Once loaded, the actor runs a batch of up to `max_batch` requests (actors/engine.py,
stepped on one thread by actors/batch_runner.py): each `generate` call is one row with its
own KV cache, sampler, stream and request id; it joins at the next step boundary and
leaves the moment it ends, its cache freed before its `Completion` is sent, so a caller
that hears the end may send the next request at once. Cancelling one stream (the caller
cancels the Ray generator) ends only that row, within one step.

After its last row the actor exits through `ray.actor.exit_actor()` — unless the latest
request asked it to stay hot: then it waits, IDLE, for the next request. A cold actor
whose only request was cancelled before the weights were in, or any actor whose step
failed, exits.

Memory. The actor tells its node's telemetry agent what it holds (weights, plus the KV
caches of the rows running) and withdraws that on exit; each `Completion` carries the
peak measured since the batch last started from empty (`actors/peak_memory.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from actors.actor_config import ActorConfig
from actors.cold_start import choose_first_layers, estimate_prefill_layer_seconds
from actors.events import BatchFullError, FinishEvent, StartEvent, TokenEvent
from actors.heap import IdleTrimmer, retain_freed_memory
from actors.messages import (
    ActorBusyError,
    ActorRequest,
    ActorStatus,
    Completion,
    Phase,
    Started,
    TextChunk,
    Timings,
)
from actors.peak_memory import PeakMemory
from actors.priority import lower_threads
from actors.stream_chunks import chunk_interval_s, coalesce
from actors.telemetry_agent import NO_REPORTER, AgentReporter
from weights_tool.groups import EMBEDDINGS_GROUP

if TYPE_CHECKING:
    from actors.batch_runner import RowStream
    from actors.model import WaitLayer

# torch and the engine are imported in the actor's constructor, not here: whoever only creates request actors
# (the ingress hands the class to Ray) does not pay for them.

log = logging.getLogger(__name__)


@dataclass
class _State:
    phase: Phase = Phase.STARTING
    transitions: deque[tuple[str, float]] = field(default_factory=lambda: deque(maxlen=_MAX_TRANSITIONS))
    num_served: int = 0

    def enter(self, phase: Phase) -> None:
        if phase != self.phase or not self.transitions:
            self.phase = phase
            self.transitions.append((phase.value, time.time()))


_MAX_TRANSITIONS = 256  # a hot actor alternates DECODE and IDLE for as long as it lives


@dataclass
class _Cold:
    """The first request's part in loading: the gate its prefill passes through, and when layer 0 began."""

    first_layers: int
    wait_layer: WaitLayer
    marks: dict[str, float]


class RequestActor:
    def __init__(self, zqs_path: str, config: ActorConfig, device: str | None = None,
                 warm_layers: int | None = None, *, name: str | None = None,
                 on_exit: Callable[[], None] | None = None):
        """`name` and `on_exit` run the actor outside Ray, in its host's process (serve_app/local_cluster.py):
        named by its owner and ended by it (`on_exit` runs once the actor is done). It then reports to no
        telemetry agent, and leaves the process's nice and torch thread count as the host set them."""
        import torch

        from actors.batch_runner import BatchRunner
        from actors.engine import Engine
        from actors.layer_loader import stream_zqs
        from actors.thread_governor import ThreadGovernor
        from actors.threads import compute_on_one_thread

        self.name = name or _own_name()
        self._on_exit = on_exit
        self.config = config
        self._state = _State()
        self._state.enter(Phase.STARTING)
        self._actor_start = self._state.transitions[0][1]
        if on_exit is None:  # the stepping thread alone computes on compute_threads (actors/threads.py)
            compute_on_one_thread()
        if config.is_freed_memory_retained:
            retain_freed_memory()
        self._idle_trimmer = IdleTrimmer(config.idle_trim_after_s)
        if device is None:
            device = "cuda" if config.num_gpus > 0 and torch.cuda.is_available() else "cpu"
        # A no-op where the worker started niced (actor_options). Not in-process: that would lower its host.
        if device == "cpu" and config.cpu_nice and on_exit is None:
            lower_threads(config.cpu_nice)
        self._streamed = stream_zqs(zqs_path, device=device, num_threads=config.load_threads,
                                    warm_layers=warm_layers, compute_dtype=config.compute_dtype)
        self._warm_layers = warm_layers
        self._model = self._streamed.model
        compiled = None
        if config.is_compiled:
            from actors.compiled_step import CompiledDecode

            compiled = CompiledDecode(self._model, config.compiled_slots,
                                      min(config.compiled_max_seq_len, self._model.config.max_position_embeddings))
        self._engine = Engine(self._model, self._streamed.tokenizer, max_batch=config.max_batch,
                              prefill_chunk_tokens=config.prefill_chunk_tokens, step_cost=config.step_cost,
                              compiled=compiled, step_check_recent_steps=config.step_check_recent_steps,
                              is_kv_int8=config.is_kv_int8)
        # A compiled step's kernels keep the thread count they were compiled for: its count stays fixed.
        threads = ThreadGovernor(config.compute_threads if config.is_compiled else config.min_compute_threads,
                                 config.compute_threads) if on_exit is None else None
        self._runner = BatchRunner(self._engine, wait_layer=self._weight_gate, name=f"batch-{self.name}",
                                   threads=threads)
        self._num_layers = self._streamed.config.num_layers
        self._weight_bytes = sum(p.numel() * p.element_size() for p in self._model.parameters())
        is_cuda = str(device).startswith("cuda")
        self._peak = PeakMemory(is_cuda)
        self._reporter = AgentReporter(self.name, config.namespace, is_cuda) if on_exit is None else NO_REPORTER
        self._reporter.report(self._weight_bytes)
        self._stream_open = True
        self._is_loaded = False  # every group resident (then cached: it never goes back)
        self._cold: _Cold | None = None  # the first request's part in loading; set once it arrives
        self._keep_hot = False  # what the latest request asked for
        self._is_failed = False
        self._is_closed = False
        self._state.enter(Phase.LOADING)
        log.info("%s: streaming %s onto %s", self.name, Path(zqs_path).name, device)
        self._is_packed = threading.Event()  # the packed weights are in, or none will come
        if config.packs_weights_on(torch.device(device).type):
            threading.Thread(target=self._pack_when_loaded, name=f"pack-{self.name}", daemon=True).start()
        else:
            self._is_packed.set()

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
            num_rows=self._engine.num_rows,
            resident_fraction=stream.resident_fraction(),
            pid=os.getpid(),
            compute_threads=threads.threads if (threads := self._runner.threads) is not None else 0,
            num_thread_changes=threads.num_changes if threads is not None else 0,
        )

    async def ready(self, timeout_s: float | None = None) -> ActorStatus:
        """Return once a warm actor holds the embeddings and its first layers (at once for a loaded one)."""
        if self._warm_layers is not None and self._cold is None:
            await asyncio.to_thread(self._wait_warm, timeout_s)
            if self._engine.compiled is not None and self._cold is None:
                await asyncio.to_thread(self._compile, timeout_s)
            if self._cold is None:  # no request was bound meanwhile
                self._state.enter(Phase.WARM)
        return self.status()

    # ---- serving ---------------------------------------------------------------------

    async def generate(self, request: ActorRequest):
        """Stream one `Started`, then `TextChunk`s, then one `Completion`, as one row of the batch."""
        if self._state.phase == Phase.EXITED or self._is_failed:
            raise ActorBusyError(f"{self.name} is exiting")
        is_cold = self._cold is None  # the actor's first request: it paid for loading the weights
        if not is_cold and not self._loaded():
            raise ActorBusyError(f"{self.name} is loading; it serves one request until its weights are in")
        arrival = time.time()
        if is_cold:
            self._cold = _Cold(0, lambda i: None, {})  # claimed before the first await
            self._streamed.stream.resume()  # a warm actor's held layers: from now on
        stream: RowStream | None = None
        completion = None
        try:
            if is_cold:
                self._cold = await asyncio.to_thread(self._prepare_cold, request)
            if self._engine.num_rows == 0:
                self._peak.reset()
                self._idle_trimmer.request_started()
            due = request.first_token_due if self.config.is_prefill_paced_by_ttft else None
            stream = self._runner.submit(list(request.prompt_ids), request.sampling, request.tpot_target_s, due)
            self._keep_hot = request.keep_hot
            async for item in self._relay(request, stream, arrival, is_cold):
                yield item
                if isinstance(item, Completion):
                    completion = item
        except BatchFullError:
            raise ActorBusyError(f"{self.name} already runs {self.config.max_batch} requests") from None
        except Exception:
            # Loading or a step failed (a cancelled caller raises no Exception): not trusted again.
            self._is_failed = True
            raise
        finally:
            if stream is not None:
                stream.cancel()  # a no-op once the row has ended; else it leaves at the next step
            self._after_row(completion is not None)

    async def shutdown(self) -> None:
        """Called by the actor on itself: exit once the current call has returned."""
        import ray

        ray.actor.exit_actor()

    # ---- internals -------------------------------------------------------------------

    async def _relay(self, request: ActorRequest, stream: RowStream, arrival: float, is_cold: bool):
        """The row's engine events as the actor's stream items: `Started` and the first token at once,
        later tokens coalesced into one chunk per interval (stream_chunks.py: longer while more rows
        share the actor's chunks a second) — or each on its own, at once, for a low-latency request."""
        is_low_latency = request.is_low_latency
        merge = (lambda items: items) if is_low_latency else coalesce
        loop = asyncio.get_running_loop()
        next_send = 0.0  # loop time before which no further chunk leaves
        has_sent_token = False
        while True:
            items = [await stream.get()]
            wait = next_send - loop.time()
            if wait > 0 and not isinstance(items[0], FinishEvent):
                # Until the next chunk may leave, or the row ends: its last tokens are not held back.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stream.has_ended.wait(), wait)
            items += stream.get_ready()
            for item in merge([self._item(request, event, arrival, is_cold) for event in items]):
                yield item
                if isinstance(item, Completion):
                    return
                has_sent_token |= isinstance(item, TextChunk)
            if has_sent_token and not is_low_latency:  # the first token went out as it came; later ones wait
                config = self.config
                next_send = loop.time() + chunk_interval_s(self._engine.num_rows, config.stream_interval_s,
                                                           config.max_stream_chunks_per_s, config.max_stream_interval_s)

    def _item(self, request: ActorRequest, event, arrival: float, is_cold: bool):
        if isinstance(event, StartEvent):
            self._state.enter(Phase.PREFILL if is_cold else Phase.DECODE)
            self._reporter.report(self._accounted_bytes())  # the row's KV cache is in place now
            return Started(request.request_id, event.time, is_cold, event.step_correction, event.step_baseline)
        if isinstance(event, TokenEvent):
            if event.num_output_tokens == 1 and is_cold:
                self._state.enter(Phase.DECODE)
            return TextChunk((event.token_id,), event.text, event.num_output_tokens, event.time)
        assert isinstance(event, FinishEvent)
        self._state.num_served += 1
        return self._completion(request, arrival, event, is_cold)

    def _prepare_cold(self, request: ActorRequest) -> _Cold:
        """The first request's gate (off the event loop: it reads the prompt's rows from the file)."""
        first_layers = 0 if self._all_resident() else self._first_layers(len(request.prompt_ids))
        is_load_all_first = bool(first_layers) and self.config.is_load_then_compute
        if is_load_all_first:
            first_layers = self._num_layers
        marks: dict[str, float] = {}
        timeout = self.config.load_timeout_s
        stream = self._streamed.stream
        num_layers = self._num_layers
        if is_load_all_first:
            self._streamed.wait_all(timeout)
        is_rows_ready = self._streamed.load_rows(request.prompt_ids)
        if not is_rows_ready:
            stream.wait(EMBEDDINGS_GROUP, timeout)  # a compressed table: all of it first

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
            if i == 0 and "first_layer_compute_start" not in marks:
                marks["first_layer_compute_start"] = time.time()

        return _Cold(first_layers, wait_layer, marks)

    def _wait_warm(self, timeout_s: float | None) -> None:
        stream = self._streamed.stream
        stream.wait(EMBEDDINGS_GROUP, timeout_s)
        for i in range(self._warm_layers):
            stream.wait(i, timeout_s)
        if self._warm_layers:  # the first request's kernel choice, made ahead of it
            from actors.layers import warm_up_kernels

            # On the stepping thread: it times the kernels on the threads that will run them, and a
            # thread of the default executor computing on two threads would form a second OpenMP team
            # that slows every later step (actors/threads.py).
            self._on_stepping_thread(lambda: warm_up_kernels(self._model.group_parameters(0)), timeout_s,
                                     "choosing the kernels")
        if self._warm_layers == self._num_layers and not self._is_packed.wait(timeout_s):
            # Holding every layer, its weights are whole before any request: packed now, its first request
            # computes with the packed kernels and no packing thread holds the GIL beside it (bench_warm, `small`
            # holding all 12 layers: 0.212 s to the first token with the packing beside it, 0.029 s packed first).
            log.warning("%s: packing its weights took over %s s; ready unpacked", self.name, timeout_s)

    def _compile(self, timeout_s: float | None) -> None:
        """Compile (or load from inductor's cache on disk) every bucket of the compiled step, on the stepping
        thread, before a warm actor is ready: its requests' steps then never compile. Its layers not yet resident
        are read as they are: compiling needs their shapes, and the padding slot alone is written."""
        num_compiles = self._on_stepping_thread(self._engine.compiled.compile_buckets, timeout_s,
                                                "compiling the decode step")
        log.info("%s: compiled decode step ready, %d compilations", self.name, num_compiles)

    def _on_stepping_thread(self, fn: Callable[[], object], timeout_s: float | None, what: str) -> object:
        """`fn()` run between steps by the stepping thread, the one thread that computes on compute_threads."""
        done = threading.Event()
        outcome: list = []

        def run() -> None:
            try:
                outcome.append(fn())
            finally:
                done.set()

        self._runner.call_between_steps(run)
        if not done.wait(timeout_s):
            raise TimeoutError(f"{self.name}: {what} took over {timeout_s} s")
        if not outcome:
            raise RuntimeError(f"{self.name}: {what} failed (see the actor's log)")
        return outcome[0]

    def _pack_when_loaded(self) -> None:
        """Once every weight is resident, pack the linear weights; the stepping thread swaps them in between steps.

        A thread of its own: a warm actor's stream holds until its request arrives, and a cold
        one's first request computes while the rest loads (packing reads, never writes, the weights).
        A warm actor that holds every layer holds nothing back: it is packed before `ready()` returns.
        """
        packed = None
        try:
            packed = self._pack_resident()
        finally:
            if packed is None:  # closed, failed or raised: its requests compute with the plain weights
                self._is_packed.set()
        if packed is None:
            return

        def install() -> None:
            try:
                packed.install()
            finally:
                self._is_packed.set()

        self._runner.call_between_steps(install)

    def _pack_resident(self):
        """The packed weights once every weight is resident; None where the actor closed or its load failed first."""
        from actors.packed_weights import pack

        try:
            self._streamed.wait_all()
        except Exception:  # closed or failed: nothing left to pack for
            return None
        return None if self._is_closed else pack(self._model, kernel=self.config.packed_kernel)

    def _weight_gate(self) -> WaitLayer | None:
        """Asked by the stepping thread before each step: the cold gate until every weight is resident."""
        if self._loaded():
            return None
        return self._cold.wait_layer  # only the first request runs before then

    def _loaded(self) -> bool:
        if not self._is_loaded and self._all_resident():
            self._is_loaded = True
        return self._is_loaded

    def _completion(self, request, arrival: float, event: FinishEvent, is_cold: bool) -> Completion:
        ready = self._streamed.stream.ready_times()  # seconds since the stream started
        stream_start = self._stream_started_at()
        cold = self._cold if is_cold and self._cold is not None else None
        marks = cold.marks if cold is not None else {}
        return Completion(
            request_id=request.request_id,
            stop_reason=event.stop_reason,
            stop_sequence=event.stop_sequence,
            input_tokens=event.input_tokens,
            output_tokens=event.output_tokens,
            is_cold=is_cold,
            first_layers=cold.first_layers if cold is not None else 0,
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
            engine_s=event.engine_s,
            mean_step_rows=event.num_step_rows / event.num_steps if event.num_steps else 0.0,
            mean_step_threads=event.num_step_threads / event.num_steps if event.num_steps else 0.0,
            predicted_step_s=event.predicted_step_s,
            checked_step_s=event.checked_step_s,
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
        return self._weight_bytes + self._engine.kv_bytes()

    def _all_resident(self) -> bool:
        stream = self._streamed.stream
        return all(stream.is_ready(i) for i in range(-1, self._num_layers + 1))

    def _stream_started_at(self) -> float:
        # LayerStream's ready times count from its own start, which follows header
        # parsing and model allocation; `started_at` is that instant in epoch seconds.
        return self._streamed.stream.started_at

    def _after_row(self, is_complete: bool) -> None:
        """A row's stream has ended (completed, cancelled or failed): exit, idle, or keep serving."""
        if self._state.phase == Phase.EXITED:
            return
        if self._is_failed or (not is_complete and not self._loaded()):
            self._exit()  # a failed step, or a cold load nobody waits for any more
            return
        if self._engine.num_rows:
            self._reporter.report(self._accounted_bytes())
            return
        if not self._keep_hot:
            self._exit()
            return
        if self._stream_open and self._all_resident():
            self._streamed.close()  # the loader threads are done; free them
            self._stream_open = False
        self._idle_trimmer.request_ended()  # the batch's activations go back if no request follows
        self._state.enter(Phase.IDLE)
        self._reporter.report(self._accounted_bytes())

    def _exit(self) -> None:
        self.close()
        if self._on_exit is not None:
            self._on_exit()
            return
        import ray

        ray.get_runtime_context().current_actor.shutdown.remote()

    def close(self) -> None:
        """Stop computing and let go of everything (its process, under Ray, ends after this)."""
        if self._is_closed:
            return
        self._is_closed = True
        self._state.enter(Phase.EXITED)
        self._runner.close()
        self._reporter.forget()
        self._streamed.close()


def spawn(zqs_path: str, config: ActorConfig, name: str, warm_layers: int | None = None):
    """Create the detached actor; its loading starts at once (up to `warm_layers` layers for a warm one)."""
    import ray

    return ray.remote(RequestActor).options(**config.actor_options(name)).remote(
        zqs_path, config, warm_layers=warm_layers)


def _own_name() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_actor_name() or "request-actor"
    except Exception:  # constructed outside Ray (tests of the class itself)
        return "request-actor"
