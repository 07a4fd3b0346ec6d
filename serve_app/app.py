"""The zero-queue ingress: validate, decide, and either start the request on an actor or refuse it.

Per request (`POST /v1/messages`):
  1. validate the body (400/404/413 before any work), tokenize with the model's chat
     template and check the context window;
  2. `registry.admit(features)`: the pure `decide()` and the reservation it implies, in
     one atomic call on the shared registry actor (no replica can over-commit a slot or a
     batch);
  3. act: call the idle hot actor, add a row to a hot actor's batch, bind a warm actor, or
     create a detached actor on the reserved slot (first killing the idle actors the
     decision evicts) — or answer 503 `overloaded_error` at once, with the registry's
     predicted `retry-after` / `retry-after-ms`. An actor found dead before it started the
     request (a warm or idle one that died unseen) is given up and the request decided
     once more;
  4. relay the actor's stream as JSON or SSE (serve_app/relay.py), then tell the registry
     how it ended (complete, cancelled, failed): exactly once, releasing just that row.

Warm pools (serve_app/warm_filler.py) are refilled on a background thread, never awaited
by a request. When Serve stops the replica (`serve shutdown`, the app deleted), `__del__`
detaches it from the registry; the last replica to go takes every actor with it.

Nothing here waits for capacity: every await is on work already placed, and has a deadline;
the decision's is `registry_timeout_s`, past which (a dead, restarting or stalled registry)
the request is a 503 at once and whatever its admission may still commit is undone.
The registry decides with the XGBoost scorer when `scorer_path` names a usable model (else
the rule); with traces on, every request leaves one JSON line (serve_app/traces.py).
`build_app(args)` is the app builder `configs/serve.yaml` names by `import_path`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from actors.cold_start import warm_layers
from actors.layer_loader import open_zqs
from actors.messages import ActorRequest, Completion
from actors.request_actor import RequestActor, new_actor_name
from actors.tokenizer import Tokenizer
from serve_app import api, errors, sse, traces
from serve_app.config import AppArgs, IngressConfig, ingress_config, resolve_model_path
from serve_app.decisions import Bind, Reject, Spawn
from serve_app.errors import ApiError
from serve_app.latency_targets import request_targets
from serve_app.memory import ModelNumbers, request_features
from serve_app.metrics import IngressMetrics
from serve_app.prompt import prompt_for
from serve_app.registry_actor import RegistryConfig, get_registry
from serve_app.relay import ActorLost, Admitted, Outcome, Relay
from serve_app.scorer import RuleScorer
from serve_app.slots import SlotRefresher
from serve_app.warm_filler import WarmFiller
from serve_app.warm_pool import LANES, WarmFill, WarmSpec
from serve_app.xgb_scorer import load_scorer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    id: str
    display_name: str
    zqs_path: str
    tokenizer: Tokenizer
    numbers: ModelNumbers
    max_context: int
    created_at: float
    ttft_target_s: float | None = None
    total_target_s: float | None = None
    tpot_target_s: float | None = None
    warm_layers: int = 0  # a warm actor's layers resident before its request


# A request whose actor is found dead before starting it is decided again, up to this many tries in all
# (a warm pool lost at once, its node gone, costs one try per dead actor the registry still lists).
MAX_ATTEMPTS = 3


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
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=5,
)
class Ingress:
    def __init__(self, config: IngressConfig) -> None:
        self.config = config
        self.metrics = IngressMetrics()
        self.models = {m.id: self._load_model(m) for m in config.models}
        # Loaded (and validated) here; a missing or invalid model means the rule, with a warning.
        scorer = load_scorer(config.scorer_path)
        if isinstance(scorer, RuleScorer):  # no model, or an unusable one: the rule as this app configures it
            scorer = config.rule_scorer
        self.registry = get_registry(
            RegistryConfig(namespace=config.actor.namespace, actor_namespace=config.actor.namespace),
            config.policy, scorer,
        )
        self.traces = traces.TraceWriter(config.traces) if config.traces is not None else None
        self.relay = Relay(config.token_timeout_s, config.ping_interval_s, self._observe, self._ended,
                           self._first_token)
        self._releasing: set[asyncio.Task] = set()  # rows given up, released once their stream has ended
        self.replica_id = _replica_id()  # attached to the registry by the slot refresher, at once and per refresh
        # Slots (and their telemetry) are kept current in the background: GPU workers may
        # join after the ingress starts, and a restarted registry comes back empty.
        self.slot_refresher = SlotRefresher(self.registry, config.slots, config.actor,
                                            slot_refresh_s=config.slot_refresh_s,
                                            telemetry_refresh_s=config.telemetry_refresh_s,
                                            replica_id=self.replica_id)
        self.slot_refresher.start()
        self._handles: dict[str, Any] = {}
        # One remote class for every spawn: `ray.remote()` per spawn would export the class anew each time.
        self._actor_class = ray.remote(RequestActor)
        policy = config.policy
        self.warm_filler = WarmFiller(
            self.registry,
            [WarmSpec(m.id, m.numbers.weight_bytes + policy.actor_overhead_bytes) for m in self.models.values()],
            {m: sum(policy.num_warm(m, lane) for lane in LANES) for m in self.models},
            self._create_warm, new_actor_name, refresh_s=config.warm_refresh_s,
            ready_timeout_s=config.actor.load_timeout_s)
        self.warm_filler.start()
        log.info("zeroqueue ingress: models %s, %d slots", list(self.models), len(self.slot_refresher.slots))

    async def __del__(self) -> None:
        """Serve stops this replica: stop refilling, and detach (the last replica takes every actor with it)."""
        self.warm_filler.stop()
        try:
            await asyncio.wait_for(self.registry.detach.remote(self.replica_id), timeout=30)
        except Exception:  # the registry shut itself down while answering, or is gone already
            log.info("registry detach of %s ended without an answer", self.replica_id)

    def _load_model(self, spec) -> LoadedModel:
        path = resolve_model_path(spec)
        reader, config, tokenizer = open_zqs(path)  # header only: config + tokenizer
        reader.close()
        actor = self.config.actor
        num_warm = actor.warm_layers if actor.warm_layers is not None else warm_layers(
            config, actor.initial_load_bytes_per_s, actor.prefill_flops_per_s, actor.warm_prompt_tokens)
        window = config.max_position_embeddings
        return LoadedModel(
            id=spec.id, display_name=spec.display_name, zqs_path=str(path), tokenizer=tokenizer,
            numbers=ModelNumbers.from_config(config),
            max_context=min(window, spec.max_context) if spec.max_context else window,
            created_at=path.stat().st_mtime, ttft_target_s=spec.ttft_target_s, total_target_s=spec.total_target_s,
            tpot_target_s=spec.tpot_target_s, warm_layers=min(num_warm, config.num_layers),
        )

    # ---- HTTP ------------------------------------------------------------------------

    async def __call__(self, request: Request) -> Response:
        request_id = api.new_request_id()
        try:
            self._authenticate(request)
            route = (request.method, request.url.path.rstrip("/") or "/")
            if route == ("POST", "/v1/messages"):
                response = await self._messages(request, request_id)
            elif route == ("POST", "/v1/messages/count_tokens"):
                response = await self._count_tokens(request)
            elif route == ("GET", "/v1/models"):
                infos = [self._model_info(m) for m in self.models.values()]
                response = JSONResponse(api.models_response(infos, api.parse_models_query(request.query_params)))
            elif route[0] == "GET" and route[1].startswith("/v1/models/"):
                model = self._model(route[1].removeprefix("/v1/models/"))
                response = JSONResponse(self._model_info(model))
            elif route == ("GET", "/health"):
                response = JSONResponse(await self._health())
            else:
                raise errors.not_found(f"{request.method} {request.url.path} is not a route of this API")
        except ApiError as e:
            self.metrics.errors.inc(tags={"type": e.type})
            response = JSONResponse(errors.error_body(e, request_id), status_code=e.status, headers=e.headers)
        except Exception:
            log.exception("request %s failed", request_id)
            e = errors.api_error("internal error")
            response = JSONResponse(errors.error_body(e, request_id), status_code=500)
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
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit():
            api.check_body_size(int(declared), limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            api.check_body_size(len(body), limit)
        return bytes(body)

    def _model(self, model_id: str) -> LoadedModel:
        model = self.models.get(model_id)
        if model is None:
            raise errors.not_found(f"model: {model_id!r} is not served here; see GET /v1/models")
        return model

    def _model_info(self, m: LoadedModel) -> dict:
        from datetime import datetime, timezone

        return api.model_info(m.id, m.display_name, datetime.fromtimestamp(m.created_at, timezone.utc),
                              max_input_tokens=m.max_context)

    async def _count_tokens(self, request: Request) -> Response:
        req = api.parse_count_tokens_request(await self._read_body(request))
        model = self._model(req.model)
        messages = [{"role": r, "content": t} for r, t in req.flat_messages()]
        n = len(model.tokenizer.encode_chat(messages, system=req.system_text()))
        return JSONResponse(api.count_tokens_response(n))

    async def _health(self) -> dict:
        snap = await asyncio.wait_for(self.registry.snapshot.remote(), timeout=2.0)
        by_state: dict[str, int] = {}
        for a in snap.actors:
            by_state[a.state] = by_state.get(a.state, 0) + 1
        free_slots = sum(1 for s in snap.slots if s.num_actors == 0)
        num_rows = sum(a.num_rows for a in snap.actors)
        for state in ("starting", "busy", "idle"):
            self.metrics.actors.set(by_state.get(state, 0), tags={"state": state})
        self.metrics.free_slots.set(free_slots)
        return {
            "status": "ok",
            "dispatch_latency_us": self.metrics.dispatch_jitter_us(),
            "actors": by_state,
            "rows": num_rows,
            "slots": {"total": len(snap.slots), "free": free_slots,
                      "free_bytes": sum(s.free_bytes for s in snap.slots)},
            "models": list(self.models),
        }

    # ---- /v1/messages ----------------------------------------------------------------

    async def _messages(self, request: Request, request_id: str) -> Response:
        arrival = time.time()
        req = api.parse_messages_request(await self._read_body(request))
        admitted = await self.admit(req, request_id, arrival, request.headers)
        headers = {
            "X-Request-Dispatch-Time": _timing(admitted.dispatch_time),
            "X-Request-Start-Time": _timing(admitted.started.time),
            # Where it ran: "hot" (an idle or batching actor), "warm" (a bound warm actor) or "cold".
            "X-Request-Tier": admitted.tier,
        }
        if req.stream:
            return StreamingResponse(self.relay.sse(admitted), media_type="text/event-stream",
                                     headers=headers | {"cache-control": "no-cache"})
        text, done = await self.relay.collect(admitted)
        body = api.message_response(api.new_message_id(), req.model, text, done.stop_reason, done.stop_sequence,
                                    done.input_tokens, done.output_tokens)
        return JSONResponse(body, headers=headers)

    async def admit(self, req: api.MessagesRequest, request_id: str, arrival: float,
                    headers: Mapping[str, str] | None = None) -> Admitted:
        """Validate, decide, act. Returns once the actor has started computing, or raises ApiError."""
        model = self._model(req.model)
        ttft_target_s, total_target_s, tpot_target_s = request_targets(
            headers or {}, model.ttft_target_s, model.total_target_s, model.tpot_target_s)
        prompt, sampling = prompt_for(req, model.tokenizer, model.max_context)
        features = request_features(model.id, model.numbers, len(prompt), req.max_tokens, self.config.policy,
                                    ttft_target_s, total_target_s, req.temperature, req.top_k, req.top_p,
                                    tpot_target_s)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return await self._place(model, features, ActorRequest(request_id, tuple(prompt), sampling),
                                         arrival)
            except ActorLost as lost:
                # Nothing ran: the actor (a warm or idle one) was dead before it started the request. Its
                # row was released as failed, which forgot and killed it; decide again on what is left.
                log.warning("request %s: %s (attempt %d of %d)", request_id, lost.message, attempt, MAX_ATTEMPTS)
                if attempt == MAX_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    async def _place(self, model: LoadedModel, features, actor_request: ActorRequest, arrival: float) -> Admitted:
        """One decision and the action it names; raises ActorLost if the actor was dead before it started."""
        request_id = actor_request.request_id
        spawn_name = new_actor_name(model.id)
        decision = await self._admit(features, spawn_name, request_id)
        kind = type(decision).__name__.lower()
        self.metrics.decisions.inc(tags={"model": model.id, "kind": kind})
        if isinstance(decision, Reject):
            self.metrics.rejections.inc(tags={"reason": decision.reason})
            self.metrics.observe_dispatch(model.id, time.time() - arrival)
            self._trace(request_id, model.id, arrival, features, decision, None)
            if decision.http_status == 400:
                raise errors.invalid_request(decision.message)
            raise errors.overloaded(decision.message, decision.retry_after_s or self.config.policy.retry_after_s)
        rows = decision.candidate.batch_rows + 1 if decision.candidate is not None else 1
        self.metrics.batch_rows.observe(rows, tags={"model": model.id})
        actor_request = ActorRequest(request_id, actor_request.prompt_ids, actor_request.sampling,
                                     keep_hot=decision.keep_hot)
        if isinstance(decision, Spawn):
            try:
                # Creating a named actor makes blocking GCS calls: off the event loop, so that
                # other requests' admissions and refusals do not wait behind it.
                name, handle = spawn_name, await asyncio.to_thread(self._spawn, spawn_name, model, decision)
            except Exception:
                self.registry.remove.remote(spawn_name)  # nothing was started: give the slot back
                raise
        else:  # Dispatch, Join or Bind: an actor that exists
            name, handle = decision.actor_name, await self._handle(decision.actor_name)
            if isinstance(decision, Bind):
                self.warm_filler.wake()  # its pool is one short now
        tier = _tier(decision)
        stream = handle.generate.remote(actor_request)
        dispatch_time = time.time()
        self.metrics.observe_dispatch(model.id, dispatch_time - arrival)
        self.metrics.queue_wait.observe(dispatch_time - arrival, tags={"model": model.id})
        admitted = Admitted(request_id, model.id, name, decision.keep_hot, tier, len(actor_request.prompt_ids),
                            stream, started=None, arrival=arrival, dispatch_time=dispatch_time,
                            features=features, decision=decision)
        await self.relay.first(admitted, self.config.start_timeout_s)
        return admitted

    async def _admit(self, features, spawn_name: str, request_id: str):
        """The registry's decision, or a 503 at once when it does not answer within `registry_timeout_s`."""
        try:
            return await asyncio.wait_for(
                self.registry.admit.remote(features, spawn_name, request_id, self.slot_refresher.take_stats()),
                self.config.registry_timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            # Calls from this replica reach the registry in order: if the admission still lands, this
            # undoes it right after, so nothing stays reserved for a request that was refused.
            self.registry.abandon.remote(request_id)
            self.metrics.rejections.inc(tags={"reason": "registry_unavailable"})
            log.warning("request %s: the registry did not decide in time (%s)", request_id, type(e).__name__)
            raise errors.overloaded("the admission registry is unavailable; retry shortly",
                                    self.config.policy.retry_after_s) from None

    # ---- Python handles (serve.get_app_handle("zeroqueue")) ---------------------------

    async def create(self, request: api.MessagesRequest | dict) -> dict:
        """The `Message` JSON for a request, as `POST /v1/messages` returns it; raises ApiError."""
        req = request if isinstance(request, api.MessagesRequest) else api.parse_messages_request(request)
        admitted = await self.admit(req, api.new_request_id(), time.time())
        text, done = await self.relay.collect(admitted)
        return api.message_response(api.new_message_id(), req.model, text, done.stop_reason, done.stop_sequence,
                                    done.input_tokens, done.output_tokens)

    async def stream(self, request: api.MessagesRequest | dict) -> AsyncIterator[dict]:
        """The SSE events as dicts (call with `handle.options(stream=True).stream.remote(...)`)."""
        req = request if isinstance(request, api.MessagesRequest) else api.parse_messages_request(request)
        admitted = await self.admit(req, api.new_request_id(), time.time())
        async for chunk in self.relay.sse(admitted):
            for event in sse.decode_events(chunk):
                yield event

    def _spawn(self, name: str, model: LoadedModel, decision: Spawn):
        for evicted in decision.evict:  # forgotten by the registry already; gone before the new actor starts
            self._kill(evicted)
            self.metrics.evictions.inc(tags={"model": model.id})
        handle = self._create(name, model, decision.node_id)
        if decision.keep_hot:
            self._handles[name] = handle
        return handle

    def _create_warm(self, name: str, fill: WarmFill):
        """The warm filler's thread: a warm actor of `fill.model` on its slot."""
        model = self.models[fill.model]
        handle = self._create(name, model, fill.node_id, model.warm_layers)
        self._handles[name] = handle
        return handle

    def _create(self, name: str, model: LoadedModel, node_id: str, warm_layers: int | None = None):
        # The registry's node for the slot: this replica may not have discovered it (another replica's CPU slots).
        options = self.config.actor.actor_options(name)
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return self._actor_class.options(**options).remote(model.zqs_path, self.config.actor, warm_layers=warm_layers)

    def _kill(self, name: str) -> None:
        handle = self._handles.pop(name, None)
        try:
            ray.kill(handle or ray.get_actor(name, namespace=self.config.actor.namespace), no_restart=True)
        except ValueError:  # gone already
            pass

    async def _handle(self, name: str):
        handle = self._handles.get(name)
        if handle is None:  # started by another replica: a GCS lookup, off the event loop
            handle = await asyncio.to_thread(ray.get_actor, name, namespace=self.config.actor.namespace)
            self._handles[name] = handle
        return handle

    def _observe(self, admitted: Admitted, done: Completion) -> None:
        admitted.completion = done
        t, model = done.timings, admitted.model_id
        if t.first_token is not None:
            self.metrics.ttft.observe(t.first_token - admitted.arrival, tags={"model": model, "kind": admitted.tier})
            if admitted.tier == "cold":
                self.metrics.cold_start.observe(t.first_token - t.actor_start, tags={"model": model})
        if t.last_token is not None and done.output_tokens > 1:
            self.metrics.tpot.observe((t.last_token - t.first_token) / (done.output_tokens - 1), tags={"model": model})

    def _first_token(self, admitted: Admitted) -> None:
        if admitted.tier != "hot":  # every weight is resident now: starting -> busy, and it may batch
            self.registry.actor_started.remote(admitted.actor_name)

    def _ended(self, admitted: Admitted, outcome: Outcome) -> None:
        """Exactly once per admitted request: release its row (the actor may stay hot)."""
        if outcome == "complete":  # the actor let the row go before it sent the Completion
            self._finish(admitted, outcome)
        else:
            ray.cancel(admitted.stream)  # the row leaves the batch at the actor's next step
            if outcome == "failed":
                self._handles.pop(admitted.actor_name, None)
                self._finish(admitted, outcome)  # the registry forgets the actor and kills it
            else:
                # Released once the actor's stream has ended, i.e. the row has left its batch:
                # released earlier, a new row could be sent to a batch the actor still sees full.
                task = asyncio.get_running_loop().create_task(self._finish_when_gone(admitted, outcome))
                self._releasing.add(task)
                task.add_done_callback(self._releasing.discard)
        if self.traces is not None and admitted.decision is not None:
            ok = outcome == "complete"
            record = traces.outcome_record(admitted.arrival, admitted.dispatch_time,
                                           admitted.decision.reserve_bytes, admitted.completion if ok else None,
                                           None if ok else outcome)
            self._trace(admitted.request_id, admitted.model_id, admitted.arrival, admitted.features,
                        admitted.decision, record)

    async def _finish_when_gone(self, admitted: Admitted, outcome: Outcome) -> None:
        try:
            await asyncio.wait_for(_drain(admitted.stream), self.config.token_timeout_s)
        except Exception:  # cancelled, failed or timed out: the actor's row is gone or the actor is
            pass
        self._finish(admitted, outcome)

    def _finish(self, admitted: Admitted, outcome: Outcome) -> None:
        self.registry.finish.remote(admitted.actor_name, admitted.request_id, outcome)
        if outcome != "complete" or not admitted.keep_hot:
            self.warm_filler.wake()  # its actor exits: a slot may come free for a pool

    def _trace(self, request_id: str, model: str, arrival: float, features, decision, outcome) -> None:
        if self.traces is None:
            return
        try:  # a trace is never worth a request
            self.traces.write(traces.trace_record(request_id, model, arrival, features, decision, outcome))
        except Exception:
            log.exception("trace of request %s not recorded", request_id)


def _tier(decision) -> str:
    """Where a placed request runs, as X-Request-Tier says: the kind of candidate it was scored as.

    A bound actor still warming was scored as a fresh one (it pays the rest of its process start): cold.
    """
    if decision.candidate is None:  # decided outside `decide` (tests)
        return "cold" if isinstance(decision, Spawn) else "hot"
    kind = decision.candidate.kind
    return "hot" if kind == "join" else kind


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # constructed outside a Serve replica (tests of the class itself)
        import uuid

        return f"ingress-{uuid.uuid4().hex[:12]}"


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def build_app(args: dict[str, Any]) -> serve.Application:
    """The app builder named in configs/serve.yaml: validate args, bind the ingress."""
    parsed = AppArgs.model_validate(args)
    config = ingress_config(parsed)
    return Ingress.options(
        num_replicas=parsed.num_replicas, max_ongoing_requests=parsed.max_ongoing_requests
    ).bind(config)
