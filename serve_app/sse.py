"""Server-sent events for streamed `/v1/messages`, byte for byte what the SDK expects.

Each event is `event: <type>\\ndata: <compact JSON>\\n\\n`, the data's `type` naming
the event again (the SDK dispatches on the `event:` line and parses the data by its
`type`). A stream is exactly:

    message_start, content_block_start(0), (content_block_delta | ping)*,
    content_block_stop(0), message_delta (stop reason + usage), message_stop

and an `error` event may end it at any point, after which nothing is sent. The SDK
skips `ping` events wherever they fall and raises its `APIStatusError` (with the
body's `error.type` and `request_id`) on an `error` event. `SseStream` enforces the
order so the ingress cannot emit a stream the SDK would choke on.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from serve_app.api import check_stop, check_token_count, json_bytes, message_stub
from serve_app.errors import ApiError, error_body

TEXT_BLOCK_INDEX = 0  # we stream one text block per message


def encode_event(event_type: str, data: dict[str, Any]) -> bytes:
    # json_bytes never emits a line break, so the data is one `data:` line.
    return b"event: " + event_type.encode("ascii") + b"\ndata: " + json_bytes(data) + b"\n\n"


def message_start(message: dict[str, Any]) -> bytes:
    """`message` is `api.message_stub(...)`: empty content, null stop reason."""
    return encode_event("message_start", {"type": "message_start", "message": message})


def content_block_start(index: int) -> bytes:
    return encode_event(
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
    )


def content_block_delta(index: int, text: str) -> bytes:
    return encode_event(
        "content_block_delta",
        {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}},
    )


def content_block_stop(index: int) -> bytes:
    return encode_event("content_block_stop", {"type": "content_block_stop", "index": index})


def message_delta(stop_reason: str, stop_sequence: str | None, output_tokens: int) -> bytes:
    """The finish: why generation stopped and the cumulative output token count."""
    check_stop(stop_reason, stop_sequence)
    check_token_count("output_tokens", output_tokens)
    return encode_event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": output_tokens},
        },
    )


def message_stop() -> bytes:
    return encode_event("message_stop", {"type": "message_stop"})


def ping() -> bytes:
    return encode_event("ping", {"type": "ping"})


def error(err: ApiError, request_id: str | None = None) -> bytes:
    return encode_event("error", error_body(err, request_id))


class StreamOrderError(RuntimeError):
    """The ingress tried to emit an event the stream's order does not allow."""


class Phase(enum.Enum):
    NEW = "new"  # nothing sent yet
    OPEN = "open"  # the stream's opening sent
    CLOSED = "closed"  # its end or an error sent; nothing may follow


class OrderedStream:
    """The phases every streamed answer goes through, new -> open -> closed, whatever its API's
    events: `start`, then `ping`s and `text`s, then `finish` or, at any point before, `error`.
    Subclasses (`SseStream` here, `openai_sse.ChunkStream`) call `_require` before each event."""

    def __init__(self) -> None:
        self._phase = Phase.NEW
        self._last_event = ""

    @property
    def is_closed(self) -> bool:
        return self._phase is Phase.CLOSED

    def _require(self, next_phase: Phase, event: str, *allowed: Phase) -> None:
        if self._phase not in allowed:
            raise StreamOrderError(
                f"cannot send {event!r} after {self._last_event or 'nothing'!r} "
                f"(stream is {self._phase.value}; {event!r} needs {' or '.join(p.value for p in allowed)})"
            )
        self._phase = next_phase
        self._last_event = event


class SseStream(OrderedStream):
    """The events of one streamed message, in the only order the protocol allows.

        stream = SseStream(message_id, model, input_tokens)
        yield stream.start()
        yield stream.ping()          # while waiting, e.g. for a cold actor
        yield stream.text("Hel", output_tokens=1)
        yield stream.finish("end_turn", None, output_tokens=3)

    or, at any point before the end, `yield stream.error(err, request_id)`.
    Each call returns the bytes to write; a call out of order raises StreamOrderError.
    """

    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        super().__init__()
        self._stub = message_stub(message_id, model, input_tokens)

    def start(self) -> bytes:
        self._require(Phase.OPEN, "start", Phase.NEW)
        return message_start(self._stub) + content_block_start(TEXT_BLOCK_INDEX)

    def ping(self) -> bytes:
        self._require(Phase.OPEN, "ping", Phase.OPEN)
        return ping()

    def text(self, text: str, output_tokens: int) -> bytes:
        """One text delta; an empty string sends nothing (b""). The Messages API counts tokens only at the end."""
        self._require(Phase.OPEN, "text", Phase.OPEN)
        return content_block_delta(TEXT_BLOCK_INDEX, text) if text else b""

    def finish(self, stop_reason: str, stop_sequence: str | None, output_tokens: int) -> bytes:
        # Validate before changing phase, so a bad stop reason leaves the stream usable
        # for an `error` event.
        check_stop(stop_reason, stop_sequence)
        check_token_count("output_tokens", output_tokens)
        self._require(Phase.CLOSED, "finish", Phase.OPEN)
        return (
            content_block_stop(TEXT_BLOCK_INDEX)
            + message_delta(stop_reason, stop_sequence, output_tokens)
            + message_stop()
        )

    def error(self, err: ApiError, request_id: str | None = None) -> bytes:
        """Ends the stream with an error event; legal until message_stop is sent."""
        self._require(Phase.CLOSED, "error", Phase.NEW, Phase.OPEN)
        return error(err, request_id)


def decode_events(data: bytes) -> list[dict[str, Any]]:
    """The events in `data` (whole events, as this module encodes them) as their JSON objects.

    Python handle callers get the same events an HTTP client parses, from the one
    code path that orders them.
    """
    events = []
    for block in data.decode("utf-8").split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    return events
