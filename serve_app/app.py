"""The zero-queue ingress: the HTTP face of zeroqueue. Validate, then admit or refuse at once.

Per request (`POST /v1/messages`, or OpenAI's `POST /v1/chat/completions`): authenticate;
read the body (bounded in size and time) and validate it — 400/401/404/413 before any work
— parsing large bodies off the event loop; tokenize with the model's chat template and
check the context window; then hand it to admission (admission.py), which decides, places,
relays and releases, or refuses with 503 `overloaded_error` and `retry-after`. The answer
goes back as one JSON message or as SSE (relay.py, streaming.py), in the route's API (api.py and sse.py,
or openai_api.py and openai_sse.py); every error carries the request id, and errors on the
Chat Completions routes come in OpenAI's shape.

Nothing here waits for capacity: every await is on work already placed, and has a deadline.
`build_app(args)` is the app builder `configs/serve.yaml` names by `import_path`;
`Ingress.bind(config, cluster=spec)` chooses the cluster behind admission (cluster.py): Ray's
by default, with the seam where tests inject faulty actors and registries, or the in-process
one (local_cluster.py) that the HTTP tests drive through `asgi.IngressApp`, with no Serve at all.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import resource
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig
from ray.util import metrics as ray_metrics
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from actors.messages import ActorRequest, Completion, TextChunk
from actors.priority import control_plane_runtime_env
from actors.sampling_params import SamplingParams
from actors.tokenizer import Tokenizer
from serve_app import api, errors, model_list, openai_api, openai_sse, sse
from serve_app.admission import Admission
from serve_app.cluster import ClusterSpec, RegistryUnavailable
from serve_app.config import AppArgs, IngressConfig, ingress_config
from serve_app.errors import ApiError
from serve_app.latency_targets import request_targets
from serve_app.loaded_model import LoadedModel, load_model
from serve_app.memory import request_features
from serve_app.metrics import IngressMetrics
from serve_app.offload import BoundedExecutor
from serve_app.prompt import count_prompt_tokens, prompt_for
from serve_app.ray_cluster.cluster import RayClusterSpec
from serve_app.relay import RelayedStream
from serve_app.rows import Admitted
from serve_app.scorer import RuleScorer
from serve_app.snapshot import ClusterSummary
from serve_app.streaming import StreamFormat, event_stream
from serve_app.xgb_scorer import load_scorer

log = logging.getLogger(__name__)


# Bodies from this size on are parsed, validated and tokenized on a thread: validating tens of
# thousands of messages and rendering the chat template take tenths of a second, and the Python
# parts of that yield the event loop its turn every few milliseconds (the GIL's switch interval).
OFF_LOOP_BODY_BYTES = 256 << 10


LOW_LATENCY, COALESCED = "low-latency", "coalesced"  # X-Stream-Mode values
# Request headers: far more than any API client sends; a set past these is not a request of this API.
MAX_HEADERS = 100
MAX_HEADER_BYTES = 32 << 10
# Paths whose errors, from the first check on, are in OpenAI's shape (openai_api.error_body).
OPENAI_PATH_PREFIX = "/v1/chat/"

ChatRequest = api.MessagesRequest | openai_api.ChatCompletionRequest
# A request to its prompt ids and sampling parameters for one model: prompt.prompt_for, openai_api.prompt_for.
PromptFor = Callable[[Any, Tokenizer, int], tuple[list[int], SamplingParams]]


def _timing(t: float) -> str:
    return f"{t:.6f}"


@serve.deployment(
    name="zeroqueue",
    # The ingress only decides and relays; it never waits for capacity, so it takes every
    # request it is handed (up to max_ongoing_requests). Serve's router holds a request
    # only while it picks a replica — microseconds, since replicas never fill up. Its
    # queue is bounded all the same: past it Serve answers 503 at once instead of parking
    # requests. (A bound of 1 is not usable: concurrent arrivals meet each other there
    # during replica assignment and are refused with capacity to spare.)
    max_ongoing_requests=512,
    max_queued_requests=64,
    # Its Python at nice 0, not Ray's default 15: ahead of the request actors for the CPU (priority.py).
    ray_actor_options={"num_cpus": 0, "runtime_env": control_plane_runtime_env()},
    health_check_period_s=5,
)
class Ingress:
    # Async: Serve awaits a replica's constructor before it routes there (and `serve run` reports the app
    # ready), so the wait for the first warm actors below holds no request. Built outside Serve as Serve
    # builds it: `__new__`, then `await __init__` (asgi.py).
    async def __init__(self, config: IngressConfig, cluster: ClusterSpec | None = None) -> None:  # type: ignore[misc]
        """`cluster`: what admission places requests on (cluster.py); Ray's real one by default."""
        self.config = config
        self.metrics = IngressMetrics(ray_metrics)
        self.models = {m.id: load_model(m, config.actor) for m in config.models}
        # Loaded (and validated) here; a missing or invalid model means the rule, with a warning.
        scorer = load_scorer(config.scorer_path)
        if isinstance(scorer, RuleScorer):  # no model, or an unusable one: the rule as this app configures it
            scorer = config.rule_scorer
        self.replica_id = _replica_id()
        self._parser = BoundedExecutor("request parsing", max_threads=2, max_pending=8,
                                       timeout_s=config.body_timeout_s)
        spec = cluster if cluster is not None else RayClusterSpec()
        self.admission = Admission(config, self.models, spec.build(config, self.models, scorer, self.replica_id),
                                   self.metrics, self.replica_id, scorer)
        self._is_closed = False
        log.info("zeroqueue ingress: models %s, %d slots", list(self.models), self.admission.cluster.num_slots)
        if config.startup_wait_s > 0:
            started = time.monotonic()
            waiting = await self.admission.wait_for_ready_actors(config.startup_wait_s)
            if waiting:
                log.warning("no warm actor of %s ready within startup_wait_s=%s s; answering anyway (their requests "
                            "are refused as starting until one is)", sorted(waiting), config.startup_wait_s)
            else:
                log.info("every warm pool has an actor ready after %.1f s", time.monotonic() - started)

    def __del__(self) -> Awaitable[None] | None:
        """Serve stops this replica, and awaits what this returns: the last replica to go takes every actor
        with it (admission.py). A plain method, so that a replica collected after it was closed (or whose
        __init__ failed) leaves no coroutine unawaited."""
        if getattr(self, "_is_closed", True):
            return None
        self._is_closed = True
        self._parser.close()
        return self.admission.close()

    # ---- HTTP ------------------------------------------------------------------------

    async def __call__(self, request: Request) -> Response:
        request_id = api.new_request_id()
        route = (request.method, request.url.path.rstrip("/") or "/")
        error_body = openai_api.error_body if (route[1] + "/").startswith(OPENAI_PATH_PREFIX) else errors.error_body
        try:
            _check_headers(request)
            self._authenticate(request)
            if route == ("POST", "/v1/messages"):
                response = await self._messages(request, request_id)
            elif route == ("POST", "/v1/chat/completions"):
                response = await self._chat_completions(request, request_id)
            elif route == ("POST", "/v1/messages/count_tokens"):
                response = await self._count_tokens(request)
            elif route == ("GET", "/v1/models"):
                infos = [self._model_info(m) for m in self.models.values()]
                response = JSONResponse(model_list.models_response(infos, model_list.parse_models_query(request.query_params)))
            elif route[0] == "GET" and route[1].startswith("/v1/models/"):
                model = self._model(route[1].removeprefix("/v1/models/"))
                response = JSONResponse(self._model_info(model))
            elif route == ("GET", "/health"):
                response = JSONResponse(await self._health())
            else:
                raise errors.not_found(f"{request.method} {request.url.path} is not a route of this API")
        except ApiError as e:
            self.metrics.errors.inc(tags={"type": e.type})
            response = JSONResponse(error_body(e, request_id), status_code=e.status, headers=e.headers)
        except asyncio.CancelledError:  # the client left: nobody to answer, and not an error of ours
            self.metrics.cancellations.inc()
            raise
        except Exception:
            log.exception("request %s failed", request_id)
            e = errors.api_error("internal error")
            self.metrics.errors.inc(tags={"type": e.type})
            response = JSONResponse(error_body(e, request_id), status_code=500)
        # Not also `x-request-id`, which the OpenAI SDK reads: Serve's proxy sets that one to its own id on
        # every response, and a second value would join it into one unusable "id, id" string.
        response.headers["request-id"] = request_id
        return response

    def _authenticate(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("x-api-key")
        if given is None:
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth[:7].lower() == "bearer " else ""
        # Constant-time: the comparison takes as long for a near miss as for a wild guess.
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise errors.authentication("invalid x-api-key")

    async def _read_body(self, request: Request) -> bytes:
        media_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if media_type != "application/json":
            # Also what keeps a web page from making a keyless deployment compute: a browser sends
            # text/plain and form bodies cross-origin without asking first.
            raise errors.invalid_request(f"content-type must be application/json, got {media_type!r}")
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit():
            api.check_body_size(int(declared), limit)

        async def read() -> bytes:
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                api.check_body_size(len(body), limit)
            return bytes(body)

        try:  # a client that trickles its body does not hold a request open for ever
            return await asyncio.wait_for(read(), self.config.body_timeout_s)
        except asyncio.TimeoutError:
            raise errors.timeout(f"the request body did not arrive within {self.config.body_timeout_s:g} s") \
                from None

    def _model(self, model_id: str) -> LoadedModel:
        model = self.models.get(model_id)
        if model is None:
            raise errors.not_found(f"model: {model_id!r} is not served here; see GET /v1/models", param="model")
        return model

    def _model_info(self, m: LoadedModel) -> dict:
        from datetime import datetime, timezone

        return model_list.model_info(m.id, m.display_name, datetime.fromtimestamp(m.created_at, timezone.utc),
                              max_input_tokens=m.max_context)

    async def _count_tokens(self, request: Request) -> Response:
        body = await self._read_body(request)

        def parse_and_count() -> int:
            req = api.parse_count_tokens_request(body)
            return count_prompt_tokens(req, self._model(req.model).tokenizer)

        n = parse_and_count() if len(body) < OFF_LOOP_BODY_BYTES else await self._parser.run(parse_and_count)
        return JSONResponse(api.count_tokens_response(n))

    async def _health(self) -> dict:
        try:
            snap = await self.admission.cluster.snapshot(self.config.registry_timeout_s)
        except RegistryUnavailable:
            raise errors.overloaded("the admission registry is unavailable; retry shortly",
                                    self.config.policy.retry_after_s) from None
        summary = self.admission.summary(snap)
        dispatch_us = self.metrics.dispatch_jitter_us()
        return {
            "status": "ok",
            "dispatch_latency_us": dispatch_us,
            # p99 - p50 of recent dispatch latencies (µs), where operators of seed 001 read it; null before any.
            "dispatch_jitter_us": dispatch_us.get("jitter"),
            # Seed 001's per-request dimension in place of a queue length: engine time over time in the
            # system (1: computed the whole time), and the rows its steps ran with, over recent requests.
            "compute_density": self.metrics.recent_density(),
            # The engine's steps, measured over predicted (actors/step_cost.py), over recent requests.
            "step_time_ratio": self.metrics.recent_step_prediction(),
            # The router's predicted TTFT against the measured one, per tier (hot, warm, cold).
            "ttft_ratio": self.metrics.recent_ttft_prediction(),
            "actors": {state: n for state, n in summary.actors.items() if n},
            "rows": summary.num_rows,
            "batch_occupancy": round(summary.batch_occupancy, 3),
            "slots": {"total": summary.num_slots, "free": summary.num_free_slots, "free_bytes": summary.free_bytes},
            # The capacity planner's, as of the last lease exchange (serve_app/capacity.py); null where it is off.
            "capacity": _capacity(self.admission.last_summary),
            "models": list(self.models),
            # What each model's actors compute in (actors/compute_dtype.py): fp32 on a CPU without bf16.
            "compute_dtype": {m.id: m.compute_dtype for m in self.models.values()},
            # What their KV caches hold: the compute dtype, or int8 (actor.kv_dtype, actors/kv_cache.py).
            "kv_dtype": {m.id: m.kv_dtype for m in self.models.values()},
            # Which replica answered, and what it holds: soak runs watch its memory across hours.
            "replica": {"id": self.replica_id, "pid": os.getpid(), "rss_bytes": _rss_bytes(),
                        "running": self.admission.num_running, "threads": threading.active_count(),
                        # The CPU priority this replica decides at (0: ahead of the request actors).
                        "nice": os.getpriority(os.PRIO_PROCESS, threading.get_native_id())},
        }

    # ---- /v1/messages and /v1/chat/completions ---------------------------------------

    async def _messages(self, request: Request, request_id: str) -> Response:
        req, admitted, collected = await self._generate(request, request_id, api.parse_messages_request, prompt_for)
        if collected is None:
            out = sse.SseStream(api.new_message_id(), req.model, admitted.input_tokens)
            return self._streamed(admitted, out, request.headers)
        text, done = collected
        body = api.message_response(api.new_message_id(), req.model, text, done.stop_reason, done.stop_sequence,
                                    done.input_tokens, done.output_tokens)
        return JSONResponse(body, headers=self._timing_headers(admitted))

    async def _chat_completions(self, request: Request, request_id: str) -> Response:
        req, admitted, collected = await self._generate(request, request_id, openai_api.parse_chat_request,
                                                        openai_api.prompt_for)
        if collected is None:
            out = openai_sse.ChunkStream(openai_api.new_completion_id(), req.model, admitted.input_tokens,
                                         include_usage=req.include_usage, is_usage_continuous=req.continuous_usage)
            return self._streamed(admitted, out, request.headers)
        text, done = collected
        body = openai_api.completion_response(openai_api.new_completion_id(), int(time.time()), req.model, text,
                                              done.stop_reason, done.stop_sequence, done.input_tokens,
                                              done.output_tokens)
        return JSONResponse(body, headers=self._timing_headers(admitted))

    async def _generate(self, request: Request, request_id: str, parse: Callable[[bytes], ChatRequest],
                        to_prompt: PromptFor) -> tuple[Any, Admitted, tuple[str, Completion] | None]:
        """Read, parse and prepare the request, then admit it: (request, admitted, its whole answer unless
        it streams)."""
        arrival = time.time()
        body = await self._read_body(request)

        is_small = len(body) < OFF_LOOP_BODY_BYTES
        req = parse(body) if is_small else await self._parser.run(lambda: parse(body))
        self.admission.refuse_early(req.model)  # a burst over capacity: before tokenizing (404 comes next)

        def prepare():
            return self._prepare(req, to_prompt, request_id, request.headers)

        placed = prepare() if is_small else await self._parser.run(prepare)
        prepared_at = time.time()
        admitted, collected = await self.admission.run(*placed, arrival, is_collected=not req.stream,
                                                       prepared_at=prepared_at)
        return req, admitted, collected

    def _streamed(self, admitted: Admitted, out: StreamFormat, request_headers: Mapping[str, str]) -> Response:
        mode = _stream_mode(request_headers)  # already checked by _prepare
        headers = self._timing_headers(admitted) | {"cache-control": "no-cache", "X-Stream-Mode": mode}
        answer = self.admission.relay.answer(admitted, is_streamed=True)
        body = event_stream(out, answer, self.config.ping_interval_s, admitted.request_id)
        return RelayedStream(body, answer.close, headers)

    @staticmethod
    def _timing_headers(admitted: Admitted) -> dict[str, str]:
        a = admitted
        # Where the ingress's time went, in ms (W3C Server-Timing): parse and tokenize, the registry's
        # decision, placing it (the actor looked up or created, and called), the actor's Started back
        # at the ingress, and for a collected answer the rest of it.
        hops = [("parse", a.prepared_at - a.arrival), ("admit", a.decided_at - a.prepared_at),
                ("place", a.dispatch_time - a.decided_at), ("start", a.started_at - a.dispatch_time)]
        if a.answered_at:
            hops.append(("answer", a.answered_at - a.started_at))
        return {
            "X-Request-Dispatch-Time": _timing(a.dispatch_time),
            "X-Request-Start-Time": _timing(a.started.time),
            # Where it ran: "hot" (an idle or batching actor), "warm" (a bound warm actor) or "cold".
            "X-Request-Tier": a.tier,
            "Server-Timing": ", ".join(f"{name};dur={max(0.0, s) * 1e3:.3f}" for name, s in hops),
        }

    def _prepare(self, req: ChatRequest, to_prompt: PromptFor, request_id: str, headers: Mapping[str, str] | None):
        """Validate against the model (404, 400 before any work): the model, features and actor request.
        Either API's request: `to_prompt` turns it into the prompt and the sampling it asks for."""
        model = self._model(req.model)
        ttft_target_s, total_target_s, tpot_target_s = request_targets(
            headers or {}, model.ttft_target_s, model.total_target_s, model.tpot_target_s)
        prompt, sampling = to_prompt(req, model.tokenizer, model.max_context)
        is_low_latency = req.stream and _stream_mode(headers or {}) == LOW_LATENCY
        features = request_features(model.id, model.numbers, len(prompt), sampling, self.config.policy,
                                    ttft_target_s=ttft_target_s, total_target_s=total_target_s,
                                    tpot_target_s=tpot_target_s)
        return model, features, ActorRequest(request_id, tuple(prompt), sampling, is_low_latency=is_low_latency,
                                             tpot_target_s=tpot_target_s)

    # ---- Python handles (serve.get_app_handle("zeroqueue")) ---------------------------

    async def create(self, request: api.MessagesRequest | dict) -> dict:
        """The `Message` JSON for a request, as `POST /v1/messages` returns it; raises ApiError."""
        req = request if isinstance(request, api.MessagesRequest) else api.parse_messages_request(request)
        arrival = time.time()
        _, (text, done) = await self.admission.run(*self._prepare(req, prompt_for, api.new_request_id(), None),
                                                   arrival, is_collected=True)
        return api.message_response(api.new_message_id(), req.model, text, done.stop_reason, done.stop_sequence,
                                    done.input_tokens, done.output_tokens)

    async def stream(self, request: api.MessagesRequest | dict) -> AsyncIterator[TextChunk | Completion]:
        """The answer as the actor's typed items: `TextChunk`s, then the `Completion` (call with
        `handle.options(stream=True).stream.remote(...)`); a failure raises ApiError."""
        req = request if isinstance(request, api.MessagesRequest) else api.parse_messages_request(request)
        arrival = time.time()
        admitted, _ = await self.admission.run(*self._prepare(req, prompt_for, api.new_request_id(), None), arrival,
                                               is_collected=False)
        answer = self.admission.relay.answer(admitted, is_streamed=True)
        try:
            async for item in answer:
                yield item
        finally:
            answer.close()


def _stream_mode(headers: Mapping[str, str]) -> str:
    """`X-Stream-Mode`: `low-latency` sends every token as it is sampled; `coalesced` (the default)
    lets tokens sampled within the row's chunk interval ride in one event (actors/stream_chunks.py)."""
    mode = headers.get("x-stream-mode", COALESCED).strip().lower()
    if mode not in (LOW_LATENCY, COALESCED):
        raise errors.invalid_request(f"x-stream-mode: must be {LOW_LATENCY!r} or {COALESCED!r}, got {mode!r}")
    return mode


def _check_headers(request: Request) -> None:
    """Refuse a header set no client of this API sends. Serve's proxy sets no limit of its own, so
    without this every request would carry whatever a client sends through every layer below."""
    num_bytes = sum(len(k) + len(v) for k, v in request.headers.raw)
    if num_bytes > MAX_HEADER_BYTES or len(request.headers.raw) > MAX_HEADERS:
        raise errors.request_too_large(f"request headers are too large: {len(request.headers.raw)} headers, "
                                       f"{num_bytes} bytes; at most {MAX_HEADERS} and {MAX_HEADER_BYTES}")


def _rss_bytes() -> int:
    """This process's resident set now (Linux's statm), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # constructed outside a Serve replica (tests of the class itself)
        import uuid

        return f"ingress-{uuid.uuid4().hex[:12]}"


def build_app(args: dict[str, Any]) -> serve.Application:
    """The app builder named in configs/serve.yaml: validate args, bind the ingress."""
    parsed = AppArgs.model_validate(args)
    config = ingress_config(parsed)
    if parsed.autoscaling_config is not None:  # replicas share the hot batches through their leases
        replicas = {"autoscaling_config": AutoscalingConfig(**parsed.autoscaling_config)}
    else:
        replicas = {"num_replicas": parsed.num_replicas}
    return Ingress.options(
        **replicas, max_ongoing_requests=parsed.max_ongoing_requests,
        # A replica being replaced (a redeploy) or stopped drains its streams for this long before Serve kills it.
        graceful_shutdown_timeout_s=parsed.graceful_shutdown_timeout_s,
    ).bind(config)


def _capacity(summary: ClusterSummary | None) -> dict | None:
    if summary is None or summary.num_slots_wanted is None:
        return None
    return {"slots_wanted": summary.num_slots_wanted, "slots_present": summary.num_slots,
            "nodes_pending": summary.num_nodes_pending, "refused_for_capacity": summary.num_refused_for_capacity}
