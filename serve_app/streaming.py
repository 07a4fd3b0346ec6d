"""Writing an answer as a stream: the one loop both APIs' SSE streams go through.

An answer is anything with `async next()` — each text item (`.text`), then one finish
item (`.stop_reason`, `.stop_sequence`, `.output_tokens`), then `StopAsyncIteration` —
and `close()`: an admitted request's `relay.Answer`, or the queued baseline's engine row
(benchmarks/baseline/). A `StreamFormat` turns each step into its API's bytes: the
Messages API's `sse.SseStream` or Chat Completions' `openai_sse.ChunkStream`, each of which
keeps the order its SDK expects. While an item is slow the client gets a ping every
`ping_interval_s`, so proxies keep the connection; a failure (an `ApiError` from `next()`)
is the format's error event, and nothing follows it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from serve_app import errors
from serve_app.errors import ApiError

log = logging.getLogger(__name__)


class StreamFormat(Protocol):
    """One streamed answer in one API's wire format; each call returns the bytes to send."""

    def start(self) -> bytes: ...
    def ping(self) -> bytes: ...
    def text(self, text: str, output_tokens: int) -> bytes: ...  # b"" for nothing; output_tokens: so far
    def finish(self, stop_reason: str, stop_sequence: str | None, output_tokens: int) -> bytes: ...
    def error(self, err: ApiError, request_id: str | None) -> bytes: ...


class StreamedAnswer(Protocol):
    async def next(self) -> Any: ...
    def close(self) -> None: ...


async def event_stream(out: StreamFormat, answer: StreamedAnswer, ping_interval_s: float,
                       request_id: str) -> AsyncIterator[bytes]:
    """The answer's bytes in `out`'s format, pings while it is slow; the answer is closed however this ends."""
    pending: asyncio.Future | None = None
    try:
        yield out.start()
        while True:
            pending = asyncio.ensure_future(answer.next())
            while not (await asyncio.wait({pending}, timeout=ping_interval_s))[0]:
                yield out.ping()
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            if hasattr(item, "stop_reason"):
                yield out.finish(item.stop_reason, item.stop_sequence, item.output_tokens)
                return
            chunk = out.text(item.text, item.num_output_tokens)
            if chunk:
                yield chunk
    except (asyncio.CancelledError, GeneratorExit):
        raise  # the client went away
    except ApiError as e:
        yield out.error(e, request_id)
    except Exception:
        log.exception("request %s: its stream failed", request_id)
        yield out.error(errors.api_error("internal error"), request_id)
    finally:
        if pending is not None:
            pending.cancel()
        answer.close()
