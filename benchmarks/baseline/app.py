"""The queued baseline: a standard Ray Serve LLM deployment, the architecture zeroqueue replaces.

One long-lived replica per slot, each holding the model from start-up, directly behind
Serve's HTTP proxy. Each replica computes one request at a time
(`max_ongoing_requests=1`, as a zeroqueue actor does: one torch thread on one slot;
letting two requests time-slice one core would make both slower and hide nothing), and
every request beyond that waits in Serve's router, in arrival order, in a queue with no
bound (`max_queued_requests=-1`, Serve's default). That is the "standard deployment":
the model deployment itself is the HTTP app, the shape Serve's LLM examples use. An
extra ingress deployment routing through a handle would put the same router queue one
hop later and cost the baseline a hop; without it the comparison errs in the baseline's
favour.

Everything else is zeroqueue's own code, imported: the same builder arguments
(`serve_app.config.AppArgs`, so one args dict describes both apps), the same slots
(`discover_slots`), the same `.zqs` loader and `Engine`, torch threads, dtype and
process priority, and the same Messages API schemas, SSE event order and error bodies.
Only the path from arrival to compute differs.

    serve run benchmarks/baseline/serve.yaml     # the demo model on http://127.0.0.1:8000
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from actors.engine import FinishEvent, TokenEvent
from actors.sampling import SamplingParams
from serve_app import api, errors, sse
from serve_app.config import AppArgs, ingress_config, resolve_model_path
from serve_app.errors import ApiError
from serve_app.prompt import prompt_for
from serve_app.slots import discover_slots

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
    cpu_nice: int
    is_freed_memory_retained: bool
    max_body_bytes: int
    ping_interval_s: float


@serve.deployment(
    name="baseline",
    max_ongoing_requests=1,
    max_queued_requests=UNBOUNDED,
    health_check_period_s=5,
)
class QueuedModel:
    def __init__(self, config: BaselineConfig) -> None:
        import torch

        from actors.engine import Engine
        from actors.heap import retain_freed_memory
        from actors.layer_loader import load_zqs

        self.config = config
        torch.set_num_threads(config.compute_threads)
        if config.is_freed_memory_retained:
            retain_freed_memory()  # as zeroqueue's actors do; the replica never trims (favours it)
        device = config.device if config.device != "cuda" or torch.cuda.is_available() else "cpu"
        if device == "cpu" and config.cpu_nice:
            os.nice(config.cpu_nice)  # the priority zeroqueue's CPU actors compute at
        model, tokenizer = load_zqs(config.zqs_path, device=device, num_threads=config.load_threads)
        self.engine = Engine(model, tokenizer, max_context=config.max_context)
        # Held from a generation's start until its thread has stopped. Serve counts a
        # cancelled request as finished at once, while its decode step may still be
        # running: the next request waits for that step (milliseconds) instead of
        # sharing the core with it.
        self._compute = asyncio.Lock()
        log.info("baseline replica: %s resident on %s", config.model_id, device)

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
        prompt, sampling = self._prepare(req)
        run = _Generation(self.engine, prompt, sampling)
        headers = {"X-Request-Start-Time": f"{start:.6f}"}
        if req.stream:
            # The generation starts inside the stream: a request cancelled before its body
            # is read never starts one.
            out = sse.SseStream(api.new_message_id(), req.model, len(prompt))
            return StreamingResponse(self._sse(run, out, request_id), media_type="text/event-stream",
                                     headers=headers | {"cache-control": "no-cache"})
        await self._begin(run)
        text, done = await run.collect()
        body = api.message_response(api.new_message_id(), req.model, text, done.stop_reason, done.stop_sequence,
                                    done.input_tokens, done.output_tokens)
        return JSONResponse(body, headers=headers)

    def _prepare(self, req: api.MessagesRequest) -> tuple[list[int], SamplingParams]:
        """The same checks, in the same order, as zeroqueue's ingress: all before any compute."""
        if req.model != self.config.model_id:
            raise errors.not_found(f"model: {req.model!r} is not served here")
        return prompt_for(req, self.engine.tokenizer, self.engine.max_context)

    async def _begin(self, run: _Generation) -> None:
        await self._compute.acquire()
        run.start(on_done=self._compute.release)

    async def _sse(self, run: _Generation, out: sse.SseStream, request_id: str) -> AsyncIterator[bytes]:
        try:
            await self._begin(run)
            yield out.start()
            while True:
                try:
                    item = await asyncio.wait_for(run.next(), self.config.ping_interval_s)
                except asyncio.TimeoutError:
                    yield out.ping()
                    continue
                if isinstance(item, TokenEvent):
                    chunk = out.text(item.text)
                    if chunk:
                        yield chunk
                else:
                    yield out.finish(item.stop_reason, item.stop_sequence, item.output_tokens)
                    return
        except (asyncio.CancelledError, GeneratorExit):
            raise  # the client went away: `close` below stops the generation
        except BaseException as e:
            err = e if isinstance(e, ApiError) else errors.api_error(f"generation failed: {e!r}")
            yield out.error(err, request_id)
        finally:
            await run.close()


class _Generation:
    """One generation on a worker thread (the replica's event loop stays free), relayed as events.

    Cancelling (`close` before the end) stops the decode loop within one step, and `close`
    returns only when the thread has stopped, so the replica is free when Serve next uses it.
    """

    def __init__(self, engine, prompt: list[int], sampling: SamplingParams) -> None:
        self._engine, self._prompt, self._sampling = engine, prompt, sampling
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_done) -> None:
        loop = asyncio.get_running_loop()

        def emit(item: Any) -> None:
            loop.call_soon_threadsafe(self._events.put_nowait, item)

        def run() -> None:
            try:
                for event in self._engine.generate(self._prompt, self._sampling, cancel=self._cancel.is_set):
                    emit(event)
            except BaseException as e:  # surfaced to the caller through the stream
                log.exception("generation failed")
                emit(e)
            finally:
                loop.call_soon_threadsafe(on_done)

        self._thread = threading.Thread(target=run, name="baseline-generate", daemon=True)
        self._thread.start()

    async def next(self) -> TokenEvent | FinishEvent:
        item = await self._events.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def collect(self) -> tuple[str, FinishEvent]:
        parts: list[str] = []
        try:
            while True:
                item = await self.next()
                if isinstance(item, FinishEvent):
                    return "".join(parts), item
                parts.append(item.text)
        except (ApiError, asyncio.CancelledError):
            raise
        except Exception as e:
            raise errors.api_error(f"generation failed: {e!r}") from None
        finally:
            await self.close()

    async def close(self) -> None:
        self._cancel.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)


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


def baseline_config(args: dict[str, Any]) -> tuple[BaselineConfig, dict[str, Any], int]:
    """zeroqueue's builder args -> (replica config, ray_actor_options, number of replicas = slots)."""
    parsed = AppArgs.model_validate(resolve_args(args))
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
        cpu_nice=actor.cpu_nice,
        is_freed_memory_retained=actor.is_freed_memory_retained,
        max_body_bytes=ingress.max_body_bytes,
        ping_interval_s=ingress.ping_interval_s,
    )
    options = {"num_cpus": actor.num_cpus, "num_gpus": actor.num_gpus if on_gpu else 0,
               "resources": dict(actor.resources)}
    return config, options, len(slots)


def build_app(args: dict[str, Any]) -> serve.Application:
    """The app builder `benchmarks/baseline/serve.yaml` names: zeroqueue's args (or `same_as` a zeroqueue
    config), the queued architecture."""
    config, options, num_slots = baseline_config(args)
    return QueuedModel.options(num_replicas=num_slots, ray_actor_options=options).bind(config)
