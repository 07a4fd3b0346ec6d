"""The Anthropic Messages API at our HTTP boundary: request validation and response bodies.

Requests are validated strictly, before any work, like Anthropic's own API: wrong
JSON types are refused rather than coerced (`"max_tokens": "12"` and
`"temperature": true` are 400s), unknown fields are refused by name, and features this
server does not implement (tools, thinking, images, documents, ...) are refused with a
"not supported" message instead of being silently dropped. Every refusal is an
`ApiError` whose message starts with the field path, e.g.
`messages.1.content: Field required`.

Accepted and ignored, because they never change the output: `metadata` (a caller's
user id for abuse tracking), `service_tier`, and `cache_control` (prompt-caching
hints, top level or on text blocks; we keep no prompt cache). `citations` on input
text blocks (an earlier response passed back in) is ignored too.

zeroqueue extension: `seed` (a 64-bit unsigned integer) makes sampling reproducible;
the SDK sends it with `extra_body={"seed": 7}`. Recent SDKs also pass `temperature`,
`top_p` and `top_k` through `extra_body`.

Ids are a prefix and 24 base62 characters (about 143 random bits):
`msg_...` for messages, `req_...` for request ids.

Response builders return plain dicts shaped exactly like the SDK's `Message`,
`MessageTokensCount` and `models.list()` page; `json_bytes` serialises them. The models
page and its entries also carry OpenAI's fields (`object`, `created`, `owned_by`), so the
one `GET /v1/models` answers both SDKs: each reads its own fields and ignores the other's.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from actors.stop_sequences import MAX_STOP_SEQUENCE_CHARS, MAX_STOP_SEQUENCES
from actors.tokenizer import Message
from serve_app.errors import from_validation_error, invalid_request, request_too_large

MAX_MODEL_NAME_CHARS = 256
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts any unsigned 64-bit value
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # Anthropic's limit for /v1/messages
# Bounds that keep a request's parse and admission cheap, far beyond what a real one needs:
# no served model's context comes near either (each message is at least a few tokens).
MAX_OUTPUT_TOKENS = 1 << 20
MAX_MESSAGES = 10_000

# Anthropic features this server does not implement, and for each the values that ask
# for nothing (a request carrying one of those is served; any other value is refused).
_UNSUPPORTED_FEATURES: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, {"type": "none"}),
    "thinking": (None, {"type": "disabled"}),
    "container": (None,),
    "context_management": (None,),
    "diagnostics": (None,),
    "inference_geo": (None,),
    "mcp_servers": (None, []),
    "output_config": (None,),
    "output_format": (None,),
    "speed": (None, "standard"),
}

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "model_context_window_exceeded"]
STOP_REASONS: frozenset[str] = frozenset(StopReason.__args__)  # type: ignore[attr-defined]

_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


class TextBlock(BaseModel):
    """An input `{"type": "text", "text": ...}` block; the only block type we serve."""

    model_config = _STRICT

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_other_block_types(cls, data: Any) -> Any:
        block_type = data.get("type") if isinstance(data, dict) else None
        if isinstance(block_type, str) and block_type != "text":
            raise ValueError(
                f"content blocks of type {block_type!r} are not supported by this server; only 'text' blocks are"
            )
        return data

    @field_validator("text")
    @classmethod
    def _has_visible_text(cls, text: str) -> str:
        if not text.strip():
            raise ValueError("text content blocks must contain non-whitespace text")
        return unicode_text(text)


def unicode_text(text: str) -> str:
    """JSON's `\ud800` escapes make lone surrogates, which are not text: no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode: a lone surrogate at character {e.start}") from None
    return text


def _as_blocks(content: Any) -> Any:
    """`"hi"` -> `[{"type": "text", "text": "hi"}]`, so one list type is validated."""
    if isinstance(content, str):
        if not content.strip():
            raise ValueError("text content must contain non-whitespace text")
        return [{"type": "text", "text": unicode_text(content)}]
    if isinstance(content, list):
        return content
    raise ValueError("Input should be a string or a list of content blocks")


class InputMessage(BaseModel):
    model_config = _STRICT

    role: Literal["user", "assistant"]
    content: list[TextBlock] = Field(min_length=1)

    @field_validator("content", mode="before")
    @classmethod
    def _normalise_content(cls, content: Any) -> Any:
        return _as_blocks(content)

    @property
    def text(self) -> str:
        # Blocks are joined with nothing between them, as chat templates that take
        # content lists render consecutive text parts.
        return "".join(block.text for block in self.content)


class Metadata(BaseModel):
    model_config = _STRICT

    user_id: str | None = Field(default=None, max_length=256)


class _Conversation(BaseModel):
    """What `/v1/messages` and `/v1/messages/count_tokens` share."""

    model_config = _STRICT

    model: str = Field(min_length=1, max_length=MAX_MODEL_NAME_CHARS)
    messages: list[InputMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: list[TextBlock] | None = None
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported_features(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, no_op_values in _UNSUPPORTED_FEATURES.items():
            if name in data and not any(data[name] == v for v in no_op_values):
                raise ValueError(f"{name}: not supported by this server (it serves text-only chat)")
        # What is left of them asks for nothing; drop it so `extra="forbid"` passes.
        return {k: v for k, v in data.items() if k not in _UNSUPPORTED_FEATURES}

    @field_validator("system", mode="before")
    @classmethod
    def _normalise_system(cls, system: Any) -> Any:
        if system is None or system == "":
            return None
        return _as_blocks(system)

    @model_validator(mode="after")
    def _check_turn_order(self) -> _Conversation:
        if self.messages[0].role != "user":
            raise ValueError("messages.0.role: the first message must have role 'user'")
        for i in range(1, len(self.messages)):
            role = self.messages[i].role
            if role == self.messages[i - 1].role:
                raise ValueError(
                    f"messages.{i}.role: roles must alternate between 'user' and 'assistant', but messages "
                    f"{i - 1} and {i} are both {role!r} (badly ordered turns; merge them into one message)"
                )
        return self

    def turns(self) -> tuple[Message, ...]:
        """The conversation in order, its content blocks joined; a trailing assistant turn is a prefill to
        continue."""
        return tuple(Message(m.role, m.text) for m in self.messages)

    def system_text(self) -> str | None:
        if self.system is None:
            return None
        return "".join(block.text for block in self.system)

    @property
    def is_prefill(self) -> bool:
        return self.messages[-1].role == "assistant"


StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_SEQUENCE_CHARS)]


class MessagesRequest(_Conversation):
    """`POST /v1/messages`. `max_tokens` is checked against the model's context later."""

    max_tokens: int = Field(ge=1, le=MAX_OUTPUT_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    stop_sequences: list[StopSequence] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


class CountTokensRequest(_Conversation):
    """`POST /v1/messages/count_tokens`."""


RequestT = TypeVar("RequestT", bound=_Conversation)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid_request(f"request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise invalid_request(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:  # the decoder recurses per level of nesting: a body can exhaust the stack
        raise invalid_request("request body is nested too deeply to be a request") from None
    except ValueError as e:  # e.g. an integer past Python's 4,300-digit conversion limit
        raise invalid_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid_request(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _refuse_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON does not.
    raise json.JSONDecodeError(f"{name} is not valid JSON", name, 0)


def parse_messages_request(body: bytes | Mapping[str, Any]) -> MessagesRequest:
    return _validate(MessagesRequest, body)


def parse_count_tokens_request(body: bytes | Mapping[str, Any]) -> CountTokensRequest:
    return _validate(CountTokensRequest, body)


def _validate(model: type[RequestT], body: bytes | Mapping[str, Any]) -> RequestT:
    data = parse_json_body(body) if isinstance(body, bytes) else dict(body)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def check_body_size(num_bytes: int, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """413 before the body is parsed (call with Content-Length, then the real length)."""
    if num_bytes > max_bytes:
        raise request_too_large(f"request body is {num_bytes} bytes; the limit is {max_bytes} bytes")


_ID_ALPHABET = string.digits + string.ascii_letters


def _new_id(prefix: str) -> str:
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def new_message_id() -> str:
    return _new_id("msg_")


def new_request_id() -> str:
    return _new_id("req_")


def check_stop(stop_reason: str, stop_sequence: str | None) -> None:
    """A finish we report must be one the SDK knows, with a sequence iff one matched."""
    if stop_reason not in STOP_REASONS:
        raise ValueError(f"stop_reason must be one of {sorted(STOP_REASONS)}, got {stop_reason!r}")
    if (stop_reason == "stop_sequence") != (stop_sequence is not None):
        raise ValueError(f"stop_sequence is set iff stop_reason is 'stop_sequence', got {stop_reason!r}, {stop_sequence!r}")


def check_token_count(name: str, n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {n!r}")


def message_stub(message_id: str, model: str, input_tokens: int) -> dict[str, Any]:
    """The `message` of a stream's `message_start`: no content and no stop reason yet."""
    check_token_count("input_tokens", input_tokens)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }


def message_response(
    message_id: str,
    model: str,
    text: str,
    stop_reason: str,
    stop_sequence: str | None,
    input_tokens: int,
    output_tokens: int,
) -> dict[str, Any]:
    """The complete non-streaming `Message`. One text block, even when empty, so a
    client's `content[0].text` works and matches what the stream accumulates to."""
    check_stop(stop_reason, stop_sequence)
    check_token_count("output_tokens", output_tokens)
    body = message_stub(message_id, model, input_tokens)
    body["content"] = [{"type": "text", "text": text}]
    body["stop_reason"] = stop_reason
    body["stop_sequence"] = stop_sequence
    body["usage"]["output_tokens"] = output_tokens
    return body


def count_tokens_response(input_tokens: int) -> dict[str, Any]:
    check_token_count("input_tokens", input_tokens)
    return {"input_tokens": input_tokens}


def json_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON that cannot fail on any Python str and stays on one line.

    U+2028, U+2029 and U+0085 are escaped because readers that split text with
    `str.splitlines` treat them as line ends (an SSE data line must not break). A lone
    surrogate (possible in a str, impossible in UTF-8) becomes a `\\udxxx` escape, valid
    JSON that decodes back to the same str, instead of an encode error mid-response.
    """
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    for char in ("\u2028", "\u2029", "\u0085"):
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text.encode("utf-8", errors="backslashreplace")
