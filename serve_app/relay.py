"""An admitted request's answer, item by item from its actor's stream, with a deadline on every wait.

The actor streams `Started`, `TextChunk`s, then one `Completion` (actors/request_actor.py),
through the cluster port's `ActorStream` (cluster.py), whose typed endings map to API errors here.
`Relay.first` waits for the `Started` (the actor began computing); `Relay.answer` gives the
rest as an `Answer`, whose `next()` returns each `TextChunk` and then the `Completion`:
typed items, which the ingress writes as one JSON body, as either API's stream
(sse.event_stream), or hands to a Python caller as they are. Every wait has a deadline:
`start_timeout_s` until the first token of an actor that is still loading (a cold or warm
one), `token_timeout_s` otherwise.

What the stream did is told down to the request's row (rows.py), never back up: its first
token (a cold actor's weights are all resident, so it may batch), its Completion (its
timings), and how it ended — complete, cancelled or failed — exactly once. A failure ends
the request and raises the `ApiError` to tell the client; an actor lost before the client
saw anything of its answer raises `ActorLost`, which admission may place again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse

from actors.messages import Completion, Started, TextChunk
from serve_app import errors
from serve_app.cluster import StreamBusy, StreamEnded, StreamFailed, StreamLost
from serve_app.errors import ApiError
from serve_app.offload import within
from serve_app.rows import Admitted, Outcome, Rows

# A row turned away by its actor is answered as overload; the client may come straight back.
BUSY_RETRY_AFTER_S = 0.1
# A request whose actor died: the registry forgets the actor at once, so capacity returns as soon as
# its replacement can start.
LOST_RETRY_AFTER_S = 1.0

log = logging.getLogger(__name__)


class ActorLost(ApiError):
    """The actor died before the client saw anything of its answer: the ingress may place it again."""


@dataclass(frozen=True)
class Relay:
    start_timeout_s: float
    token_timeout_s: float
    rows: Rows

    async def first(self, admitted: Admitted) -> Started:
        """The actor's `Started`: it began computing. On failure the request is ended and ApiError raised."""
        try:
            first = await self._next(admitted)
            if not isinstance(first, Started):
                raise RuntimeError(f"actor {admitted.actor_name} sent {type(first).__name__} before Started")
        except (asyncio.CancelledError, GeneratorExit):
            self.rows.end(admitted, "cancelled")
            raise
        except BaseException as e:
            raise self._failed(admitted, e, is_answer_started=False) from None
        admitted.started, admitted.started_at = first, time.time()
        self.rows.started(admitted, first)
        return first

    def answer(self, admitted: Admitted, *, is_streamed: bool) -> Answer:
        """The rest of the answer. `is_streamed`: the client has its first bytes already, so a failure
        is told in the stream (and an actor lost is not placed again)."""
        return Answer(self, admitted, is_streamed)

    async def collect(self, admitted: Admitted) -> tuple[str, Completion]:
        """The whole text and the `Completion`; raises ApiError (ActorLost: nothing was sent yet)."""
        answer = self.answer(admitted, is_streamed=False)
        parts: list[str] = []
        try:
            async for item in answer:
                if isinstance(item, Completion):
                    admitted.answered_at = time.time()
                    return "".join(parts), item
                parts.append(item.text)
        finally:
            answer.close()
        raise AssertionError("an answer ends with its Completion")

    def _failed(self, admitted: Admitted, e: BaseException, *, is_answer_started: bool) -> ApiError:
        """End the request on `e`; the error to tell the client (ActorLost: nothing was told yet)."""
        error = as_api_error(e)
        if error.status >= 500:
            log.warning("request %s on actor %s: %s", admitted.request_id, admitted.actor_name, _describe(e))
        if is_answer_started:  # told in the stream: no response status will count it
            admitted.error = error
        if isinstance(e, StreamBusy) and admitted.lease_row is not None:
            admitted.is_turned_away = True  # the row was recalled, or the batch is full: not ours to reuse
        self.rows.end(admitted, outcome_of(e))
        if (isinstance(e, StreamLost) or admitted.is_turned_away) and not is_answer_started:
            return ActorLost(error.status, error.type, error.message, error.headers)
        return error

    async def _next(self, admitted: Admitted):
        # Until its first token, an actor that is loading its weights may take as long as a load does.
        is_loading = admitted.num_chunks == 0 and admitted.tier != "hot"
        timeout = self.start_timeout_s if is_loading else self.token_timeout_s
        item = await within(admitted.stream.next(), timeout)
        if isinstance(item, TextChunk):
            admitted.num_chunks += 1
            if admitted.num_chunks == 1:
                self.rows.first_token(admitted)
        return item


class Answer:
    """One admitted request's `TextChunk`s, then its `Completion`; `close()` when done with it.

    Each `next()` is a call of its own (cancelling one leaves the answer usable, which a
    stream writer waiting with pings relies on). The row is released before the Completion
    is returned: a client that sends its next request the moment it reads the end finds
    this row free. `close()` releases it as cancelled if it has not ended (the caller left).
    """

    def __init__(self, relay: Relay, admitted: Admitted, is_streamed: bool) -> None:
        self._relay, self.admitted, self._is_streamed = relay, admitted, is_streamed
        self._is_done = False

    async def next(self) -> TextChunk | Completion:
        if self._is_done:
            raise StopAsyncIteration
        relay, admitted = self._relay, self.admitted
        try:
            item = await relay._next(admitted)
        except (asyncio.CancelledError, GeneratorExit):
            raise  # the caller stopped waiting; `close` releases the row if nobody waits again
        except BaseException as e:
            self._is_done = True
            raise relay._failed(admitted, e, is_answer_started=self._is_streamed) from None
        if isinstance(item, Completion):
            self._is_done = True
            relay.rows.completed(admitted, item)
            relay.rows.end(admitted, "complete")
        return item

    def close(self) -> None:
        self._relay.rows.end(self.admitted, "cancelled")  # a no-op if it has ended

    def __aiter__(self) -> Answer:
        return self

    async def __anext__(self) -> TextChunk | Completion:
        return await self.next()


def outcome_of(e: BaseException) -> Outcome:
    """How a row whose stream raised `e` is released: only the client's leaving, a cancelled call or a
    row the actor turned away is "cancelled"; anything else fails the actor."""
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    return e.outcome if isinstance(e, StreamEnded) else "failed"


def as_api_error(e: BaseException) -> ApiError:
    """What the client is told. Internal names and exception texts stay in the log (with the request id)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, StreamBusy):
        return errors.overloaded("the chosen actor could not take the request after all", BUSY_RETRY_AFTER_S)
    if isinstance(e, asyncio.TimeoutError):
        return errors.timeout("the model did not answer in time")
    if isinstance(e, StreamLost):
        # A process lost (killed, out of memory, its node gone) is capacity lost, not a bug: retry.
        return errors.overloaded("the model's process was lost while serving the request; retry",
                                 LOST_RETRY_AFTER_S)
    if isinstance(e, StreamFailed) and e.is_load_failure:
        # Its model file missing or cut short fails the same way on every placement: a server fault.
        return errors.api_error("the model could not be loaded")
    return errors.api_error("the model failed while serving the request")


def _describe(e: BaseException) -> str:
    if isinstance(e, StreamEnded):
        return f"{type(e).__name__}: {e.detail}"
    return f"{type(e).__name__}: {e}"


class RelayedStream(StreamingResponse):
    """A streamed response whose `on_close` runs however the response ends — also when its body
    never starts (the client left between the headers and the first event), where the body's
    own cleanup would never run."""

    def __init__(self, body: Any, on_close: Any, headers: dict[str, str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # a body suspended at an event runs its cleanup now
            self._on_close()
