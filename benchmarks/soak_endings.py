"""How each request of the chaos soak ended, judged from what its client recorded. Pure.

How every request ended, judged from what the client recorded (DESIGN.md, invariant 2 and
the API contract):

    complete  a 200 `Message` JSON with its content, or an SSE stream that ends in
              `message_stop` after the documented order
              (message_start, content_block_start, (content_block_delta | ping)*,
              content_block_stop, message_delta, message_stop)
    error     a documented error carrying the request id: a JSON body
              {"type": "error", "error": {"type", "message"}, "request_id"} whose type fits
              its status and whose request_id is the `request-id` header (a 503 also
              carries `retry-after`), or an SSE `error` event carrying the request id,
              where the documented order allows one
    cancel    the soak itself closed the stream part way (on purpose), before any end
    none      anything else: a connection reset or refused, a stream that stops with no
              terminal event, events out of order, a body not of the documented shape, a
              client timeout. Counted, with its reason.

Arrivals the client did not send (over its in-flight bound) are `overflow`, outside the count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

COMPLETE, ERROR, CANCEL, NONE, OVERFLOW = "complete", "error", "cancel", "none", "overflow"
ENDINGS = (COMPLETE, ERROR, CANCEL, NONE)
# Anthropic's error type for each status the API documents.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


@dataclass(frozen=True)
class Ending:
    kind: str  # one of ENDINGS, or OVERFLOW
    reason: str = ""  # for NONE: what was wrong; for ERROR: "<status> <error type>"


def classify(rec: dict[str, Any]) -> Ending:
    """How one recorded request ended (see the module docstring)."""
    if rec.get("overflow"):
        return Ending(OVERFLOW, "not sent: the client's in-flight bound")
    if rec.get("timed_out"):
        return Ending(NONE, "client timeout")
    status = rec.get("status")
    if status is None:
        return Ending(NONE, f"no response: {rec.get('transport_error') or 'unknown'}")
    if status == 200 and rec.get("stream"):
        if "text/event-stream" not in (rec.get("content_type") or ""):
            return Ending(NONE, f"200 stream as {rec.get('content_type')!r}, not text/event-stream")
        return check_sse(rec.get("events") or [], rec.get("request_id"), bool(rec.get("cancelled")),
                         rec.get("transport_error"))
    if rec.get("transport_error"):
        return Ending(NONE, f"{status} body cut: {rec['transport_error']}")
    if status == 200:
        problem = message_problem(rec.get("body"))
        return Ending(COMPLETE) if problem is None else Ending(NONE, f"200 body: {problem}")
    problem = error_problem(rec.get("body"), status, rec.get("request_id"), rec.get("retry_after"))
    if problem is not None:
        return Ending(NONE, f"{status} body: {problem}")
    return Ending(ERROR, f"{status} {rec['body']['error']['type']}")


def message_problem(body: Any) -> str | None:
    """None if `body` is a complete `Message` with content, else what is wrong with it."""
    if not isinstance(body, dict) or body.get("type") != "message":
        return "not a Message object"
    content = body.get("content")
    if not isinstance(content, list) or not content:
        return "no content"
    if not all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content):
        return "a content block is not a text block"
    if not isinstance(body.get("stop_reason"), str):
        return "no stop_reason"
    usage = body.get("usage")
    if not isinstance(usage, dict) or not isinstance(usage.get("output_tokens"), int):
        return "no usage.output_tokens"
    return None


def error_problem(body: Any, status: int | None, request_id: str | None, retry_after: str | None = None) -> str | None:
    """None if `body` is the documented error for `status` carrying `request_id`, else what is wrong.

    `status` None: an SSE `error` event's data (any documented type; no header to check).
    """
    if not isinstance(body, dict) or body.get("type") != "error":
        return "not an error object"
    err = body.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("type"), str) or not isinstance(err.get("message"), str):
        return "no error.type and error.message"
    if not request_id:
        return "no request-id header"
    if body.get("request_id") != request_id:
        return f"request_id {body.get('request_id')!r} is not the header's"
    if status is None:
        return None if err["type"] in ERROR_TYPES.values() else f"undocumented error type {err['type']!r}"
    expected = ERROR_TYPES.get(status)
    if expected is None:
        return f"undocumented status {status}"
    if err["type"] != expected:
        return f"error type {err['type']!r} for status {status} (documented: {expected!r})"
    if status == 503 and not retry_after:
        return "503 without retry-after"
    return None


# The documented SSE order as phases: each event moves the stream to the next one; `ping` may
# come once the message has started, `error` at any point before the end.
_NEXT = {("new", "message_start"): "started", ("started", "content_block_start"): "open",
         ("open", "content_block_delta"): "open", ("open", "content_block_stop"): "stopped",
         ("stopped", "message_delta"): "finished", ("finished", "message_stop"): "done"}


def check_sse(events: list, request_id: str | None, cancelled: bool, transport_error: str | None = None) -> Ending:
    """How a 200 SSE stream ended; `events` are [event name, data] in arrival order."""
    phase, last = "new", "nothing"
    for name, data in events:
        if isinstance(data, dict) and data.get("type") != name:
            return Ending(NONE, f"event {name!r} carries data of type {data.get('type')!r}")
        if phase in ("done", "error"):
            return Ending(NONE, f"{name!r} after the stream's end ({last!r})")
        if name == "error":
            problem = error_problem(data, None, request_id)
            if problem is not None:
                return Ending(NONE, f"error event: {problem}")
            phase, last = "error", name
            continue
        if name == "ping" and phase != "new":
            continue
        nxt = _NEXT.get((phase, name))
        if nxt is None:
            return Ending(NONE, f"{name!r} after {last!r}")
        problem = _event_problem(name, data)
        if problem:
            return Ending(NONE, f"{name!r}: {problem}")
        phase, last = nxt, name
    if phase == "done":
        return Ending(COMPLETE)
    if phase == "error":
        return Ending(ERROR, f"stream {_error_type(events)}")
    if cancelled:
        return Ending(CANCEL)
    if transport_error:
        return Ending(NONE, f"stream cut after {last!r}: {transport_error}")
    return Ending(NONE, f"stream ended after {last!r} with no terminal event")


def _event_problem(name: str, data: Any) -> str | None:
    if not isinstance(data, dict):
        return "no JSON data"
    if name == "message_start" and not isinstance(data.get("message"), dict):
        return "no message"
    if name in ("content_block_start", "content_block_delta", "content_block_stop") and data.get("index") != 0:
        return f"index {data.get('index')!r}, not 0"
    if name == "message_delta":
        delta, usage = data.get("delta"), data.get("usage")
        if not isinstance(delta, dict) or not isinstance(delta.get("stop_reason"), str):
            return "no delta.stop_reason"
        if not isinstance(usage, dict) or not isinstance(usage.get("output_tokens"), int):
            return "no usage.output_tokens"
    return None


def _error_type(events: list) -> str:
    for name, data in events:
        if name == "error":
            return data["error"]["type"]
    return "?"
