"""Relaying an admitted request's actor stream to its client, as one JSON message or as SSE.

One relay loop serves both APIs' streams: it drives a `StreamFormat` (the Messages API's
`sse.SseStream` or Chat Completions' `openai_sse.ChunkStream`), which turns each step into
that API's bytes and keeps them in the order its SDK expects.

The actor streams `Started`, `TextChunk`s, then one `Completion` (actors/request_actor.py).
Every wait on it has a deadline: `start_timeout_s` until the first token of an actor that
is still loading (a cold or warm one), `token_timeout_s` otherwise. An SSE client gets a
`ping` every `ping_interval_s` while a token is slow, so proxies keep the connection.
However a relay ends, `on_end(admitted, outcome)` runs exactly once (`Admitted.end`), so
the ingress releases the request's row exactly once:

    "complete"   the Completion arrived (the actor has already let the row go)
    "cancelled"  the client left, or the actor turned the row away before it started
                 (its batch was full after all): only this row is given up
    "failed"     the actor died, failed, or missed a deadline: it is not trusted again

`on_first_token` runs once, at a request's first token: a cold actor's weights are then
all resident, so the registry may start batching onto it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import ray
from starlette.responses import StreamingResponse

from actors.messages import ActorBusyError, Completion, Started, TextChunk
from serve_app import errors
from serve_app.decisions import Decision
from serve_app.errors import ApiError
from serve_app.offload import within
from serve_app.snapshot import RequestFeatures

Outcome = Literal["complete", "cancelled", "failed"]
# A row turned away by its actor is answered as overload; the client may come straight back.
BUSY_RETRY_AFTER_S = 0.1
# A request whose actor died: the registry forgets the actor at once, so capacity returns as soon as
# its replacement can start.
LOST_RETRY_AFTER_S = 1.0

log = logging.getLogger(__name__)


class StreamFormat(Protocol):
    """One streamed answer in one API's wire format; each call returns the bytes to send."""

    def start(self) -> bytes: ...
    def ping(self) -> bytes: ...
    def text(self, text: str) -> bytes: ...  # b"" for nothing to send
    def finish(self, stop_reason: str, stop_sequence: str | None, output_tokens: int) -> bytes: ...
    def error(self, err: ApiError, request_id: str | None) -> bytes: ...


class ActorLost(ApiError):
    """The actor died before the client saw anything of its answer: the ingress may place it again."""


@dataclass
class Admitted:
    """A request that holds a row on an actor and the actor's stream."""

    request_id: str
    model_id: str
    actor_name: str
    keep_hot: bool
    tier: str  # "hot" (an idle or batching actor), "warm" (a bound warm actor) or "cold" (a fresh one)
    input_tokens: int
    stream: Any  # ray ObjectRefGenerator
    started: Started | None
    arrival: float
    dispatch_time: float
    features: RequestFeatures | None = None
    decision: Decision | None = None
    completion: Completion | None = None
    num_chunks: int = 0
    outcome: Outcome | None = None  # set once, by `end`
    error: ApiError | None = None  # the error event a stream ended with, if it did

    def end(self, outcome: Outcome, on_end: Callable[[Admitted, Outcome], None]) -> None:
        """Run `on_end` for this request, the first time only: its row is released exactly once."""
        if self.outcome is None:
            self.outcome = outcome
            on_end(self, outcome)


@dataclass(frozen=True)
class Relay:
    start_timeout_s: float
    token_timeout_s: float
    ping_interval_s: float
    on_completion: Callable[[Admitted, Completion], None]  # metrics; before on_end
    on_end: Callable[[Admitted, Outcome], None]  # exactly once per admitted request
    on_first_token: Callable[[Admitted], None] = lambda admitted: None

    def end(self, admitted: Admitted, outcome: Outcome) -> None:
        admitted.end(outcome, self.on_end)

    async def first(self, admitted: Admitted) -> Started:
        """The actor's `Started`: it began computing. On failure the request is ended and ApiError raised."""
        try:
            first = await self._next(admitted)
            if not isinstance(first, Started):
                raise RuntimeError(f"actor {admitted.actor_name} sent {type(first).__name__} before Started")
        except (asyncio.CancelledError, GeneratorExit):
            self.end(admitted, "cancelled")
            raise
        except BaseException as e:
            raise self._failed(admitted, e, is_answer_started=False) from None
        admitted.started = first
        return first

    async def collect(self, admitted: Admitted) -> tuple[str, Completion]:
        """The whole text and the `Completion`; raises ApiError."""
        parts: list[str] = []
        try:
            while True:
                item = await self._next(admitted)
                if isinstance(item, TextChunk):
                    parts.append(item.text)
                elif isinstance(item, Completion):
                    self.on_completion(admitted, item)
                    self.end(admitted, "complete")
                    return "".join(parts), item
        except (asyncio.CancelledError, GeneratorExit):
            self.end(admitted, "cancelled")
            raise  # the caller went away: nobody to answer
        except BaseException as e:
            # Nothing was sent yet: a lost actor is ActorLost, which the ingress may place again.
            raise self._failed(admitted, e, is_answer_started=False) from None

    async def sse(self, admitted: Admitted, out: StreamFormat) -> AsyncIterator[bytes]:
        """The answer as `out` formats it; a failure after the start is its error event."""
        pending = None
        try:
            yield out.start()
            pending = asyncio.ensure_future(self._next(admitted))
            while True:
                done, _ = await asyncio.wait({pending}, timeout=self.ping_interval_s)
                if not done:
                    yield out.ping()
                    continue
                item = pending.result()
                if isinstance(item, TextChunk):
                    chunk = out.text(item.text)
                    if chunk:
                        yield chunk
                    pending = asyncio.ensure_future(self._next(admitted))
                elif isinstance(item, Completion):
                    self.on_completion(admitted, item)
                    # Released before the last event leaves: a client that sends its next request the
                    # moment it reads message_stop finds this row free.
                    self.end(admitted, "complete")
                    yield out.finish(item.stop_reason, item.stop_sequence, item.output_tokens)
                    return
        except (asyncio.CancelledError, GeneratorExit):
            raise  # the client went away
        except BaseException as e:
            yield out.error(self._failed(admitted, e, is_answer_started=True), admitted.request_id)
        finally:
            if pending is not None:
                pending.cancel()
            self.end(admitted, "cancelled")  # the client left before the end (a no-op if it had ended)

    def _failed(self, admitted: Admitted, e: BaseException, *, is_answer_started: bool) -> ApiError:
        """End the request on `e`; the error to tell the client (ActorLost: nothing was told yet)."""
        error = as_api_error(e)
        if error.status >= 500:
            log.warning("request %s on actor %s: %s", admitted.request_id, admitted.actor_name, _describe(e))
        if is_answer_started:  # told in the stream: no response status will count it
            admitted.error = error
        self.end(admitted, outcome_of(e))
        if _is_lost(e) and not is_answer_started:
            return ActorLost(error.status, error.type, error.message, error.headers)
        return error

    async def _next(self, admitted: Admitted):
        # Until its first token, an actor that is loading its weights may take as long as a load does.
        is_loading = admitted.num_chunks == 0 and admitted.tier != "hot"
        timeout = self.start_timeout_s if is_loading else self.token_timeout_s
        item = await within(_next_item(admitted.stream), timeout)
        if isinstance(item, TextChunk):
            admitted.num_chunks += 1
            if admitted.num_chunks == 1:
                self.on_first_token(admitted)
        return item


async def _next_item(stream):
    """The stream's next item: one deadline covers its arrival and its value."""
    ref = await stream.__anext__()
    return await ref


def is_busy_refusal(e: BaseException) -> bool:
    """The actor turned the row away (ActorBusyError): nothing ran, the actor is fine."""
    return isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, ActorBusyError)


def outcome_of(e: BaseException) -> Outcome:
    if isinstance(e, (asyncio.CancelledError, GeneratorExit, ray.exceptions.TaskCancelledError)) \
            or is_busy_refusal(e):
        return "cancelled"
    return "failed"


def as_api_error(e: BaseException) -> ApiError:
    """What the client is told. Internal names and exception texts stay in the log (with the request id)."""
    if isinstance(e, ApiError):
        return e
    if is_busy_refusal(e):
        return errors.overloaded("the chosen actor could not take the request after all", BUSY_RETRY_AFTER_S)
    if isinstance(e, asyncio.TimeoutError):
        return errors.timeout("the model did not answer in time")
    if _is_lost(e):
        # A process lost (killed, out of memory, its node gone) is capacity lost, not a bug: retry.
        return errors.overloaded("the model's process was lost while serving the request; retry",
                                 LOST_RETRY_AFTER_S)
    if isinstance(e, ray.exceptions.RayActorError):  # its constructor raised: the model cannot be loaded
        return errors.api_error("the model could not be loaded")
    return errors.api_error("the model failed while serving the request")


def _is_lost(e: BaseException) -> bool:
    """The actor is gone, or could never be placed (its node died after the registry chose it).

    Not an actor whose constructor raised (its model file missing or cut short): that fails the same way
    on every placement, so it is a server fault (500), not capacity to retry elsewhere.
    """
    if isinstance(e, ray.exceptions.RayActorError) and e.actor_init_failed:
        return False
    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError))


def _describe(e: BaseException) -> str:
    if isinstance(e, ray.exceptions.RayTaskError):
        return f"{type(e.cause).__name__}: {e.cause}"
    return f"{type(e).__name__}: {e}"


class RelayedStream(StreamingResponse):
    """An SSE response whose request is released however the response ends — also when its body
    never starts (the client left between the headers and the first event), where the relay's
    own cleanup would never run."""

    def __init__(self, admitted: Admitted, relay: Relay, out: StreamFormat, headers: dict[str, str]) -> None:
        super().__init__(relay.sse(admitted, out), media_type="text/event-stream", headers=headers)
        self._admitted, self._relay = admitted, relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # a body suspended at an event runs its cleanup now
            self._relay.end(self._admitted, "cancelled")  # a no-op if it has ended
