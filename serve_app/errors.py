"""Errors the ingress returns, in the Anthropic Messages API's shape.

Every refusal is an `ApiError`: an HTTP status, an Anthropic error `type`, a message
for people, and any headers the status calls for (`retry-after` on overload). The
ingress turns one into a JSON body with `error_body` (or an SSE `error` event once a
stream has begun), always carrying the request id, so the official SDK raises its
matching exception class (chosen by status) with `.type`, `.api_message` and
`.request_id` filled in.

An error may also name the request parameter at fault (`param`): Anthropic's shape says it
in the message only; OpenAI's (openai_api.py) carries it in a field of its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError


class ApiError(Exception):
    """A refusal with its HTTP status and Anthropic error type.

    A plain exception, not a frozen dataclass: `contextlib` assigns `__traceback__` on
    exceptions passing through it, which a frozen dataclass forbids. All fields go to
    `Exception.__init__` so the error pickles (e.g. across a Ray call) unchanged.
    """

    def __init__(self, status: int, type: str, message: str, headers: Mapping[str, str] | None = None,
                 param: str | None = None) -> None:
        super().__init__(status, type, message, dict(headers or {}), param)
        self.status = status
        self.type = type
        self.message = message
        self.headers: dict[str, str] = dict(headers or {})
        self.param = param

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"


def invalid_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request_error", message, param=param)


def authentication(message: str) -> ApiError:
    return ApiError(401, "authentication_error", message)


def not_found(message: str, param: str | None = None) -> ApiError:
    return ApiError(404, "not_found_error", message, param=param)


def request_too_large(message: str) -> ApiError:
    # Anthropic's documented type for 413 is `request_too_large` (no `_error` suffix).
    return ApiError(413, "request_too_large", message)


def api_error(message: str) -> ApiError:
    return ApiError(500, "api_error", message)


def overloaded(message: str, retry_after_s: float) -> ApiError:
    """503: no capacity right now, and we refuse rather than queue.

    `retry-after` is delay-seconds, which HTTP defines as a non-negative integer; it is
    rounded up and kept >= 1 so a plain client never retries in a tight loop.
    `retry-after-ms` carries the precise delay: the Anthropic SDK reads it first, so its
    automatic retry of a 503 comes back when capacity is expected, not up to a second
    later.
    """
    if not math.isfinite(retry_after_s) or retry_after_s < 0:
        raise ValueError(f"retry_after_s must be a finite number >= 0, got {retry_after_s!r}")
    headers = {
        "retry-after": str(max(1, math.ceil(retry_after_s))),
        "retry-after-ms": str(max(1, math.ceil(retry_after_s * 1000))),
    }
    return ApiError(503, "overloaded_error", message, headers)


def timeout(message: str) -> ApiError:
    """504: a deadline passed (e.g. a spawned actor never became ready)."""
    return ApiError(504, "timeout_error", message)


def error_body(err: ApiError, request_id: str | None) -> dict[str, Any]:
    """The JSON body of an error response (also the data of an SSE `error` event)."""
    body: dict[str, Any] = {"type": "error", "error": {"type": err.type, "message": err.message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def from_validation_error(exc: ValidationError) -> ApiError:
    """One `invalid_request_error` naming the first problem's field path.

    Pydantic lists errors in field order, so a missing `model` is reported before a bad
    `max_tokens`; one clear message beats a wall of them (Anthropic reports one too).
    The result reads like `messages.1.content: Field required`.
    """
    first = exc.errors(include_url=False)[0]
    path = ".".join(str(part) for part in first["loc"])
    if first["type"] == "value_error":
        # Our own validators raise ValueError; drop pydantic's "Value error, " prefix.
        problem = str(first["ctx"]["error"])
    else:
        problem = first["msg"]
    return invalid_request(f"{path}: {problem}" if path else problem)
