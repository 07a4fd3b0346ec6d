"""Relaying an admitted request's actor stream to its client, as one JSON message or as SSE.

The actor streams `Started`, `TextChunk`s, then one `Completion` (actors/request_actor.py).
Every wait on it has a deadline (`token_timeout_s`); an SSE client gets a `ping` every
`ping_interval_s` while a token is slow, so proxies keep the connection. However a relay
ends — completion, failure, timeout or the client leaving — `on_end(admitted, ok)` runs
exactly once, so the ingress releases the reservation exactly once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import ray

from actors.messages import Completion, Started, TextChunk
from serve_app import api, errors, sse
from serve_app.errors import ApiError
from serve_app.policy import Decision, RequestFeatures


@dataclass
class Admitted:
    """A request that holds a reservation and an actor stream."""

    request_id: str
    model_id: str
    actor_name: str
    keep_hot: bool
    is_cold: bool
    input_tokens: int
    stream: Any  # ray ObjectRefGenerator
    started: Started | None
    arrival: float
    dispatch_time: float
    features: RequestFeatures | None = None
    decision: Decision | None = None
    completion: Completion | None = None


@dataclass(frozen=True)
class Relay:
    token_timeout_s: float
    ping_interval_s: float
    on_completion: Callable[[Admitted, Completion], None]  # metrics; before on_end
    on_end: Callable[[Admitted, bool], None]  # exactly once per admitted request

    async def first(self, admitted: Admitted, timeout_s: float) -> Started:
        """The actor's `Started`: it began computing. On failure the request is ended and ApiError raised."""
        try:
            first = await self._next(admitted, timeout_s)
            if not isinstance(first, Started):
                raise RuntimeError(f"actor {admitted.actor_name} sent {type(first).__name__} before Started")
        except BaseException as e:
            self.on_end(admitted, False)
            raise as_api_error(e, admitted.actor_name) from None
        admitted.started = first
        return first

    async def collect(self, admitted: Admitted) -> tuple[str, Completion]:
        """The whole text and the `Completion`; raises ApiError."""
        parts: list[str] = []
        ok = False
        try:
            while True:
                item = await self._next(admitted, self.token_timeout_s)
                if isinstance(item, TextChunk):
                    parts.append(item.text)
                elif isinstance(item, Completion):
                    ok = True
                    self.on_completion(admitted, item)
                    return "".join(parts), item
        except BaseException as e:
            raise as_api_error(e, admitted.actor_name) from None
        finally:
            self.on_end(admitted, ok)

    async def sse(self, admitted: Admitted) -> AsyncIterator[bytes]:
        """The Messages API's SSE events; a failure after the start is an `error` event."""
        out = sse.SseStream(api.new_message_id(), admitted.model_id, admitted.input_tokens)
        ok = False
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
                    ok = True
                    self.on_completion(admitted, item)
                    yield out.finish(item.stop_reason, item.stop_sequence, item.output_tokens)
                    return
        except (asyncio.CancelledError, GeneratorExit):
            raise  # the client went away: `on_end` cancels the actor's stream
        except BaseException as e:
            yield out.error(as_api_error(e, admitted.actor_name), admitted.request_id)
        finally:
            if pending is not None:
                pending.cancel()
            self.on_end(admitted, ok)

    async def _next(self, admitted: Admitted, timeout: float):
        ref = await asyncio.wait_for(admitted.stream.__anext__(), timeout)
        return await asyncio.wait_for(_await(ref), timeout)


async def _await(ref):
    return await ref


def as_api_error(e: BaseException, actor_name: str) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, asyncio.TimeoutError):
        return errors.timeout(f"actor {actor_name} did not answer in time")
    if isinstance(e, ray.exceptions.RayActorError):
        return errors.api_error(f"actor {actor_name} died while serving the request")
    if isinstance(e, ray.exceptions.RayTaskError):
        return errors.api_error(f"actor {actor_name} failed: {e.cause!r}")
    return errors.api_error(f"request failed on actor {actor_name}: {e!r}")
