"""The queued baselines: a standard Ray Serve deployment of the same batched engine, behind Serve's queue.

One long-lived replica per slot, each holding the model from start-up, directly behind
Serve's HTTP proxy. Each replica runs the very engine a zeroqueue hot actor runs — a batch
of up to `max_batch` rows stepped on one thread (actors/batch_runner.py), one torch thread
on one slot — and takes up to `max_batch` requests at once (`max_ongoing_requests =
max_batch`); every request beyond that waits in Serve's router, in arrival order. So the
comparison isolates the queue, not the engine. Two queues, as an operator would pick:

- unbounded (`max_queued_requests=-1`, Serve's default): nothing is ever refused;
- bounded (`baseline: {max_queued_requests: N}` in the builder args): Serve answers 503
  at once to whatever finds N requests already waiting — Serve's own backpressure.

The model deployment itself is the HTTP app, the shape Serve's LLM examples use. An
extra ingress deployment routing through a handle would put the same router queue one
hop later and cost the baseline a hop; without it the comparison errs in the baseline's
favour.

Everything else is zeroqueue's own code, imported: the same builder arguments
(`serve_app.config.AppArgs`, so one args dict describes both apps), the same slots
(`discover_slots`), the same `.zqs` loader, `Engine` and `BatchRunner`, torch threads,
dtype and process priority, and the same Messages API schemas, SSE event order and error
bodies. Only the path from arrival to compute differs.

    serve run benchmarks/baseline/serve.yaml     # the demo model on http://127.0.0.1:8000
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from actors.batch_runner import BatchRunner, RowStream
from actors.events import FinishEvent, StartEvent, TokenEvent
from actors.priority import lower_threads
from serve_app import api, errors, sse
from serve_app.config import AppArgs, ingress_config, resolve_model_path
from serve_app.errors import ApiError
from serve_app.prompt import prompt_for
from serve_app.ray_cluster.slots import discover_slots
from serve_app.streaming import event_stream

log = logging.getLogger(__name__)

# Serve's router keeps what a replica cannot take yet; -1 is its default: no bound.
UNBOUNDED = -1
ZEROQUEUE_BUILDER = "serve_app.app:build_app"


@dataclass(frozen=True)
class BaselineConfig:
    model_id: str
    zqs_path: str
    max_context: int | None
    device: str  # "cpu" or "cuda", as the zeroqueue actors choose it
    load_threads: int
    compute_threads: int
    min_compute_threads: int
    compute_dtype: str
    cpu_nice: int
    is_freed_memory_retained: bool
    is_weight_packed: bool
    max_body_bytes: int
    ping_interval_s: float
    max_batch: int
    prefill_chunk_tokens: int


@serve.deployment(
    name="baseline",
    max_ongoing_requests=1,  # set to max_batch by build_app
    max_queued_requests=UNBOUNDED,
    health_check_period_s=5,
)
class QueuedModel:
    def __init__(self, config: BaselineConfig) -> None:
        import torch

        from actors.engine import Engine
        from actors.heap import retain_freed_memory
        from actors.layer_loader import load_zqs
        from actors.thread_governor import ThreadGovernor
        from actors.threads import compute_on_one_thread

        self.config = config
        compute_on_one_thread()  # as zeroqueue's actors: the batch's stepping thread alone on compute_threads
        if config.is_freed_memory_retained:
            retain_freed_memory()  # as zeroqueue's actors do; the replica never trims (favours it)
        device = config.device if config.device != "cuda" or torch.cuda.is_available() else "cpu"
        if device == "cpu" and config.cpu_nice:
            lower_threads(config.cpu_nice)  # the priority zeroqueue's CPU actors compute at
        model, tokenizer = load_zqs(config.zqs_path, device=device, num_threads=config.load_threads,
                                    compute_dtype=config.compute_dtype,
                                    is_weight_packed=config.is_weight_packed)  # packs CPU bf16 weights only
        engine = Engine(model, tokenizer, max_context=config.max_context, max_batch=config.max_batch,
                        prefill_chunk_tokens=config.prefill_chunk_tokens)
        self.runner = BatchRunner(engine, name="baseline-batch",
                                  threads=ThreadGovernor(config.min_compute_threads, config.compute_threads))
        log.info("baseline replica: %s resident on %s, batches of %d", config.model_id, device, config.max_batch)

    async def __call__(self, request: Request) -> Response:
        request_id = api.new_request_id()
        try:
            route = (request.method, request.url.path.rstrip("/") or "/")
            if route == ("POST", "/v1/messages"):
                response = await self._messages(request, request_id)
            elif route == ("GET", "/health"):
                response = JSONResponse({"status": "ok", "models": [self.config.model_id]})
            else:
                raise errors.not_found(f"{request.method} {request.url.path} is not a route of this API")
        except ApiError as e:
            response = JSONResponse(errors.error_body(e, request_id), status_code=e.status, headers=e.headers)
        except Exception:
            log.exception("request %s failed", request_id)
            response = JSONResponse(errors.error_body(errors.api_error("internal error"), request_id),
                                    status_code=500)
        response.headers["request-id"] = request_id
        return response

    async def _messages(self, request: Request, request_id: str) -> Response:
        start = time.time()  # the replica took it: Serve's queue is behind it
        body = await request.body()
        api.check_body_size(len(body), self.config.max_body_bytes)
        req = api.parse_messages_request(body)
        if req.model != self.config.model_id:
            raise errors.not_found(f"model: {req.model!r} is not served here")
        # The same checks, in the same order, as zeroqueue's ingress: all before any compute.
        prompt, sampling = prompt_for(req, self.runner.engine.tokenizer, self.runner.engine.max_context)
        headers = {"X-Request-Start-Time": f"{start:.6f}"}
        answer = _RowAnswer(self.runner, prompt, sampling)
        if req.stream:  # the same stream writer as zeroqueue's ingress
            out = sse.SseStream(api.new_message_id(), req.model, len(prompt))
            return StreamingResponse(event_stream(out, answer, self.config.ping_interval_s, request_id),
                                     media_type="text/event-stream", headers=headers | {"cache-control": "no-cache"})
        parts: list[str] = []
        try:
            async for event in answer:
                if isinstance(event, FinishEvent):
                    text, done = "".join(parts), event
                    break
                parts.append(event.text)
        finally:
            answer.close()
        body = api.message_response(api.new_message_id(), req.model, text, done.stop_reason, done.stop_sequence,
                                    done.input_tokens, done.output_tokens)
        return JSONResponse(body, headers=headers)


class _RowAnswer:
    """One engine row's answer, as zeroqueue's relay gives an actor's: `next()` returns each
    `TokenEvent`, then the `FinishEvent`; `close()` takes the row out of the batch if it runs."""

    def __init__(self, runner: BatchRunner, prompt: list[int], sampling) -> None:
        self._runner, self._prompt, self._sampling = runner, prompt, sampling
        self._stream: RowStream | None = None
        self._is_done = False

    async def next(self) -> TokenEvent | FinishEvent:
        if self._is_done:
            raise StopAsyncIteration
        if self._stream is None:  # joins at the first read: a request cancelled before it never joins
            self._stream = self._runner.submit(self._prompt, self._sampling)
        while True:
            try:
                event = await self._stream.get()
            except (ApiError, asyncio.CancelledError):
                raise
            except Exception as e:
                self._is_done = True
                raise errors.api_error(f"generation failed: {e!r}") from None
            if isinstance(event, FinishEvent):
                self._is_done = True
            if not isinstance(event, StartEvent):
                return event

    def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()  # a no-op once it finished; else the row leaves at the next step

    def __aiter__(self) -> _RowAnswer:
        return self

    async def __anext__(self) -> TokenEvent | FinishEvent:
        return await self.next()


def resolve_args(args: dict[str, Any]) -> dict[str, Any]:
    """`{"same_as": "configs/serve.yaml"}` -> the args of the zeroqueue app in that `serve run` config
    (so the baseline cannot drift from it); any other args are zeroqueue builder args already."""
    if set(args) != {"same_as"}:
        return args
    config = yaml.safe_load(Path(args["same_as"]).read_text())
    apps = [a for a in config["applications"] if a.get("import_path") == ZEROQUEUE_BUILDER]
    if len(apps) != 1:
        raise ValueError(f"{args['same_as']}: expected one application built by {ZEROQUEUE_BUILDER}, found {len(apps)}")
    return apps[0].get("args", {})


def baseline_config(args: dict[str, Any]) -> tuple[BaselineConfig, dict[str, Any], int, int]:
    """zeroqueue's builder args (plus an optional `baseline: {max_queued_requests, max_ongoing_requests}`) ->
    (replica config, ray_actor_options, number of replicas = slots, Serve's queue bound).

    `max_ongoing_requests`: what each replica takes at once, and so its engine's `max_batch` (default:
    zeroqueue's `actor.max_batch`); the benchmark tries several to compare against the best-configured queue."""
    args = dict(args)
    queue = dict(args.pop("baseline", None) or {})
    args = resolve_args(args)
    max_queued = int(queue.pop("max_queued_requests", UNBOUNDED))
    max_ongoing = queue.pop("max_ongoing_requests", None)
    if queue or not (max_queued == UNBOUNDED or max_queued >= 1) or not (max_ongoing is None or int(max_ongoing) >= 1):
        raise ValueError(f"baseline args: only max_queued_requests (-1 or >= 1) and max_ongoing_requests (>= 1) are "
                         f"known, got {queue or (max_queued, max_ongoing)}")
    parsed = AppArgs.model_validate(args)
    if len(parsed.models) != 1:
        raise ValueError(f"the baseline serves one model per deployment, got {len(parsed.models)}")
    ingress = ingress_config(parsed)
    spec, actor = ingress.models[0], ingress.actor
    slots = discover_slots(parsed.slots, actor)
    # discover_slots' own rule: `auto` means GPU slots wherever the cluster has GPUs.
    kind = parsed.slots.kind
    if kind == "auto":
        kind = "gpu" if ray.cluster_resources().get("GPU", 0) else "cpu"
    on_gpu = kind == "gpu"
    config = BaselineConfig(
        model_id=spec.id,
        zqs_path=str(resolve_model_path(spec)),
        max_context=spec.max_context,
        device="cuda" if on_gpu else "cpu",
        load_threads=actor.load_threads,
        compute_threads=actor.compute_threads,
        min_compute_threads=actor.min_compute_threads,
        compute_dtype=actor.compute_dtype,
        cpu_nice=actor.cpu_nice,
        is_freed_memory_retained=actor.is_freed_memory_retained,
        is_weight_packed=actor.is_weight_packed,
        max_body_bytes=ingress.max_body_bytes,
        ping_interval_s=ingress.ping_interval_s,
        max_batch=actor.max_batch if max_ongoing is None else int(max_ongoing),
        prefill_chunk_tokens=actor.prefill_chunk_tokens,
    )
    options = {"num_cpus": actor.num_cpus, "num_gpus": actor.num_gpus if on_gpu else 0,
               "resources": dict(actor.resources)}
    return config, options, len(slots), max_queued


def build_app(args: dict[str, Any]) -> serve.Application:
    """The app builder `benchmarks/baseline/serve.yaml` names: zeroqueue's args (or `same_as` a zeroqueue
    config), the queued architecture."""
    config, options, num_slots, max_queued = baseline_config(args)
    return QueuedModel.options(num_replicas=num_slots, ray_actor_options=options, max_ongoing_requests=config.max_batch,
                               max_queued_requests=max_queued).bind(config)
