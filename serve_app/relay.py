"""Relaying an admitted request's actor stream to its client, as one JSON message or as SSE.

The actor streams `Started`, `TextChunk`s, then one `Completion` (actors/request_actor.py).
Every wait on it has a deadline (`token_timeout_s`); an SSE client gets a `ping` every
`ping_interval_s` while a token is slow, so proxies keep the connection. However a relay
ends, `on_end(admitted, outcome)` runs exactly once, so the ingress releases the request's
row exactly once:

    "complete"   the Completion arrived (the actor has already let the row go)
    "cancelled"  the client left, or the actor turned the row away before it started
                 (its batch was full after all): only this row is given up
    "failed"     the actor died, failed, or missed a deadline: it is not trusted again

`on_first_token` runs once, at a request's first token: a cold actor's weights are then
all resident, so the registry may start batching onto it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import ray

from actors.messages import ActorBusyError, Completion, Started, TextChunk
from serve_app import api, errors, sse
from serve_app.decisions import Decision
from serve_app.errors import ApiError
from serve_app.snapshot import RequestFeatures

Outcome = Literal["complete", "cancelled", "failed"]
# A row turned away by its actor is answered as overload; the client may come straight back.
BUSY_RETRY_AFTER_S = 0.1


class ActorLost(ApiError):
    """The actor was dead before it started the request: nothing ran, so the ingress may place it again."""


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


@dataclass(frozen=True)
class Relay:
    token_timeout_s: float
    ping_interval_s: float
    on_completion: Callable[[Admitted, Completion], None]  # metrics; before on_end
    on_end: Callable[[Admitted, Outcome], None]  # exactly once per admitted request
    on_first_token: Callable[[Admitted], None] = lambda admitted: None

    async def first(self, admitted: Admitted, timeout_s: float) -> Started:
        """The actor's `Started`: it began computing. On failure the request is ended and ApiError raised."""
        try:
            first = await self._next(admitted, timeout_s)
            if not isinstance(first, Started):
                raise RuntimeError(f"actor {admitted.actor_name} sent {type(first).__name__} before Started")
        except (asyncio.CancelledError, GeneratorExit):
            self.on_end(admitted, "cancelled")
            raise
        except BaseException as e:
            self.on_end(admitted, outcome_of(e))
            error = as_api_error(e, admitted.actor_name)
            if isinstance(e, ray.exceptions.RayActorError):
                raise ActorLost(error.status, error.type, error.message, error.headers) from None
            raise error from None
        admitted.started = first
        return first

    async def collect(self, admitted: Admitted) -> tuple[str, Completion]:
        """The whole text and the `Completion`; raises ApiError."""
        parts: list[str] = []
        outcome: Outcome = "failed"
        try:
            while True:
                item = await self._next(admitted, self.token_timeout_s)
                if isinstance(item, TextChunk):
                    parts.append(item.text)
                elif isinstance(item, Completion):
                    outcome = "complete"
                    self.on_completion(admitted, item)
                    return "".join(parts), item
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise  # the caller went away: nobody to answer
        except BaseException as e:
            outcome = outcome_of(e)
            raise as_api_error(e, admitted.actor_name) from None
        finally:
            self.on_end(admitted, outcome)

    async def sse(self, admitted: Admitted) -> AsyncIterator[bytes]:
        """The Messages API's SSE events; a failure after the start is an `error` event."""
        out = sse.SseStream(api.new_message_id(), admitted.model_id, admitted.input_tokens)
        outcome: Outcome | None = None  # None until known; the client left before the end, unless found otherwise
        pending = None
        try:
            yield out.start()
            pending = asyncio.ensure_future(self._next(admitted, self.token_timeout_s))
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
                    pending = asyncio.ensure_future(self._next(admitted, self.token_timeout_s))
                elif isinstance(item, Completion):
                    outcome = "complete"
                    self.on_completion(admitted, item)
                    # Released before the last event leaves: a client that sends its next request the
                    # moment it reads message_stop finds this row free.
                    self.on_end(admitted, outcome)
                    yield out.finish(item.stop_reason, item.stop_sequence, item.output_tokens)
                    return
        except (asyncio.CancelledError, GeneratorExit):
            raise  # the client went away
        except BaseException as e:
            outcome = outcome_of(e)
            self.on_end(admitted, outcome)
            yield out.error(as_api_error(e, admitted.actor_name), admitted.request_id)
        finally:
            if pending is not None:
                pending.cancel()
            if outcome is None:
                self.on_end(admitted, "cancelled")

    async def _next(self, admitted: Admitted, timeout: float):
        item = await asyncio.wait_for(_next_item(admitted.stream), timeout)
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
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)) or is_busy_refusal(e):
        return "cancelled"
    return "failed"


def as_api_error(e: BaseException, actor_name: str) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if is_busy_refusal(e):
        return errors.overloaded("the chosen actor could not take the request after all", BUSY_RETRY_AFTER_S)
    if isinstance(e, asyncio.TimeoutError):
        return errors.timeout(f"actor {actor_name} did not answer in time")
    if isinstance(e, ray.exceptions.RayActorError):
        return errors.api_error(f"actor {actor_name} died while serving the request")
    if isinstance(e, ray.exceptions.RayTaskError):
        return errors.api_error(f"actor {actor_name} failed: {e.cause!r}")
    return errors.api_error(f"request failed on actor {actor_name}: {e!r}")
