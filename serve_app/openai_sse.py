"""The chunk stream of a streamed `/v1/chat/completions`, byte for byte what the `openai` SDK reads.

Each chunk is `data: <compact JSON>\\n\\n` (no `event:` line), a `chat.completion.chunk`
with one choice. A stream is exactly:

    role chunk (delta {"role": "assistant", "content": ""}), content chunk*,
    finish chunk (empty delta, finish_reason), [usage chunk (choices [])], data: [DONE]

The usage chunk is sent only when the request asked for it (`stream_options.include_usage`);
then every chunk carries `"usage": null` until that one, as OpenAI's do — or, with vLLM's
`continuous_usage_stats`, the usage so far (the role chunk's counts no output tokens). While a token is
slow, `: ping` comment lines keep proxies from closing the connection; SSE readers skip them.
An error after the start is `data: {"error": {...}}`, on which the SDK raises its
`APIError`; nothing follows it (no `[DONE]`). `ChunkStream` enforces the order, with the
interface of the Messages API's `SseStream` (sse.py), so the relay drives either.
"""

from __future__ import annotations

import time
from typing import Any

from serve_app.api import json_bytes
from serve_app.errors import ApiError
from serve_app.openai_api import error_body, finish_reason, usage
from serve_app.sse import OrderedStream, Phase

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"


def encode_chunk(data: dict[str, Any]) -> bytes:
    # json_bytes never emits a line break, so the data is one `data:` line.
    return b"data: " + json_bytes(data) + b"\n\n"


class ChunkStream(OrderedStream):
    """The chunks of one streamed chat completion, in the only order the protocol allows.

    Used as `sse.SseStream` is (streaming.StreamFormat): `start`, `ping`s, `text`s, then `finish`,
    or `error` at any point before the end; a call out of order raises StreamOrderError.
    """

    def __init__(self, completion_id: str, model: str, input_tokens: int, *, include_usage: bool,
                 is_usage_continuous: bool = False, created: int | None = None) -> None:
        super().__init__()
        self._head = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()) if created is None else created,  # the same in every chunk
            "model": model,
            "system_fingerprint": None,
        }
        self._input_tokens = input_tokens
        self._include_usage = include_usage
        self._is_usage_continuous = include_usage and is_usage_continuous

    def start(self) -> bytes:
        self._require(Phase.OPEN, "start", Phase.NEW)
        return self._chunk({"role": "assistant", "content": ""}, output_tokens=0)

    def ping(self) -> bytes:
        self._require(Phase.OPEN, "ping", Phase.OPEN)
        return PING

    def text(self, text: str, output_tokens: int) -> bytes:
        """One content delta, `output_tokens` made so far; an empty string sends nothing (b"")."""
        self._require(Phase.OPEN, "text", Phase.OPEN)
        return self._chunk({"content": text}, output_tokens=output_tokens) if text else b""

    def finish(self, stop_reason: str, stop_sequence: str | None, output_tokens: int) -> bytes:
        # Validate before changing phase, so a bad stop reason leaves the stream usable for an error.
        reason = finish_reason(stop_reason, stop_sequence)
        totals = usage(self._input_tokens, output_tokens)
        self._require(Phase.CLOSED, "finish", Phase.OPEN)
        out = self._chunk({}, reason, output_tokens=output_tokens)
        if self._include_usage:
            out += encode_chunk(self._head | {"choices": [], "usage": totals})
        return out + DONE

    def error(self, err: ApiError, request_id: str | None = None) -> bytes:
        """Ends the stream with an error chunk; legal until [DONE] is sent."""
        self._require(Phase.CLOSED, "error", Phase.NEW, Phase.OPEN)
        return encode_chunk(error_body(err, request_id))

    def _chunk(self, delta: dict[str, Any], reason: str | None = None, *, output_tokens: int) -> bytes:
        chunk = self._head | {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        if self._include_usage:
            chunk["usage"] = usage(self._input_tokens, output_tokens) if self._is_usage_continuous else None
        return encode_chunk(chunk)
