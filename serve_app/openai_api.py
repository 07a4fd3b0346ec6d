"""OpenAI's Chat Completions at our HTTP boundary: request validation, response bodies, errors.

`POST /v1/chat/completions` runs through the same admission as `/v1/messages`; this module
only translates. Requests are validated as strictly as the Messages API's (api.py): wrong
JSON types are refused rather than coerced, unknown parameters are refused by name, and
every refusal names the parameter both in its message and in the error's `param`, in
OpenAI's notation (`messages[1].content[0].type`). An explicit `null` is the parameter
left out, as OpenAI reads it.

What is served: roles `system` and `developer` (both the system prompt, joined in order
with a blank line), `user` and `assistant`; content as a string or a list of
`{"type": "text"}` parts (joined with nothing between them); `max_completion_tokens`, or
the deprecated `max_tokens` when it is absent, else the rest of the context window;
`temperature` in [0, 2]; `top_p` in (0, 1]; `stop` (a string or up to 4); `seed`;
`stream` with `stream_options.include_usage`. A final assistant message is continued,
not answered (prompt.py).

Also served, because the benchmark clients people point at an OpenAI server send them
(vLLM's extensions, with vLLM's meaning): `top_k` (an integer >= 1; -1 or 0 is no top-k),
`min_tokens` (no end-of-turn token before that many tokens), `ignore_eos` (generate
exactly the output limit; stop sequences still stop), and
`stream_options.continuous_usage_stats` (with `include_usage`: every chunk carries the
usage so far).

Refused as "not supported", because serving them would change the output without
saying so: tools, tool calls and tool or function messages, `response_format` other
than text, log probabilities, `logit_bias`, non-zero penalties, more than one choice
(`n`), audio, images and files, predicted outputs, web search, moderation, and
`reasoning_effort` and `verbosity` (no served model reasons or has a verbosity to set). A value that asks for nothing (`"n": 1`,
`"tools": []`, `"logprobs": false`, ...) is served. `stream_options` without `stream`
is refused, as OpenAI does.

Accepted and ignored, because they never change the output: `user`,
`safety_identifier`, `metadata`, `store`, `service_tier`, `parallel_tool_calls`, the
prompt-cache hints, `stream_options.include_obfuscation`, and messages' `name` (the
served chat templates have no place for a participant's name, as with vLLM).

`seed` is a signed 64-bit integer, as OpenAI documents it; the sampler's seed is
unsigned, so a negative seed is taken in two's complement (-1 is 2**64 - 1): every seed
is reproducible and distinct seeds stay distinct.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from actors.sampling_params import MAX_TEMPERATURE, SamplingParams
from actors.stop_sequences import MAX_STOP_SEQUENCE_CHARS
from actors.tokenizer import Message, Tokenizer
from serve_app import api, errors
from serve_app.errors import ApiError
from serve_app.prompt import chat_prompt

MAX_STOP = 4  # OpenAI's limit
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
SYSTEM_ROLES = ("system", "developer")

# Parameters this server does not implement, and for each the values that ask for nothing
# (a request carrying one of those is served; any other value is refused by name).
_UNSUPPORTED_PARAMETERS: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "logprobs": (False,),
    "top_logprobs": (),
    "logit_bias": ({},),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": ("none",),
    "verbosity": (),
    "moderation": (),
}
# Fields of an assistant message that ask for nothing when empty.
_UNSUPPORTED_ASSISTANT_FIELDS: dict[str, tuple[Any, ...]] = {"tool_calls": ([],), "function_call": (),
                                                              "audio": (), "refusal": ()}

# OpenAI's error `code` for our refusals, where OpenAI has one (by our Anthropic error type).
_ERROR_CODES = {
    "authentication_error": "invalid_api_key",
    "request_too_large": "request_too_large",
    "overloaded_error": "overloaded",
    "timeout_error": "timeout",
}

_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


class Refusal(ValueError):
    """A validator's refusal of the parameter `at`, named relative to the object being validated."""

    def __init__(self, message: str, at: str) -> None:
        super().__init__(message)
        self.at = at


def _is_no_op(value: Any, no_op_values: tuple[Any, ...]) -> bool:
    # Types compared too: `"n": true` equals 1 in Python, but is not the JSON number 1.
    return any(type(value) is type(v) and value == v for v in no_op_values)


def _refuse_unsupported(data: Any, unsupported: dict[str, tuple[Any, ...]]) -> Any:
    """`data` without those parameters, each of which asks for nothing; else a Refusal naming the first."""
    if not isinstance(data, dict):
        return data
    for name, no_op_values in unsupported.items():
        if data.get(name) is not None and not _is_no_op(data[name], no_op_values):
            shown = json.dumps(data[name])  # ASCII: a lone surrogate in it is escaped, not an encode error
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise Refusal(f"{shown} is not supported by this server, which serves one text-only choice per "
                          f"request; leave it out", name)
    return {k: v for k, v in data.items() if k not in unsupported}


class TextPart(BaseModel):
    """A `{"type": "text", "text": ...}` content part; the only part type we serve."""

    model_config = _STRICT

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _refuse_other_part_types(cls, data: Any) -> Any:
        part_type = data.get("type") if isinstance(data, dict) else None
        if isinstance(part_type, str) and part_type != "text":
            raise Refusal(f"content parts of type {part_type[:40]!r} are not supported by this server; only "
                          f"'text' parts are", "type")
        return data

    @field_validator("text")
    @classmethod
    def _is_unicode(cls, text: str) -> str:
        return api.unicode_text(text)


class ChatMessage(BaseModel):
    """One message of the conversation; `content` is kept as its text parts."""

    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: list[TextPart] = Field(min_length=1)
    name: str | None = None  # accepted and ignored (module doc)

    @model_validator(mode="before")
    @classmethod
    def _refuse_tools(cls, data: Any) -> Any:
        role = data.get("role") if isinstance(data, dict) else None
        if role in ("tool", "function"):
            raise Refusal(f"messages of role {role!r} are not supported by this server (it serves no tools)", "role")
        return _refuse_unsupported(data, _UNSUPPORTED_ASSISTANT_FIELDS) if role == "assistant" else data

    @field_validator("content", mode="before")
    @classmethod
    def _as_parts(cls, content: Any) -> Any:
        """`"hi"` -> `[{"type": "text", "text": "hi"}]`, so one list type is validated."""
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        if isinstance(content, list):
            return content
        raise ValueError("Input should be a string or a list of content parts")

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage in every chunk (needs include_usage)
    include_obfuscation: bool | None = None  # accepted and ignored: we add no padding to chunks

    @model_validator(mode="after")
    def _continuous_needs_usage(self) -> StreamOptions:
        if self.continuous_usage_stats and not self.include_usage:
            raise Refusal("only allowed when include_usage is true", "continuous_usage_stats")
        return self


StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_SEQUENCE_CHARS)]


class ChatCompletionRequest(BaseModel):
    """`POST /v1/chat/completions`. The output limit is checked against the model's context later."""

    model_config = _STRICT

    model: str = Field(min_length=1, max_length=api.MAX_MODEL_NAME_CHARS)
    messages: list[ChatMessage] = Field(min_length=1, max_length=api.MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=api.MAX_OUTPUT_TOKENS)
    max_tokens: int | None = Field(default=None, ge=1, le=api.MAX_OUTPUT_TOKENS)  # deprecated by OpenAI
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    stop: list[StopSequence] = Field(default_factory=list, max_length=MAX_STOP)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions (module doc); top_k -1 or 0 is vLLM's "no top-k".
    top_k: int | None = Field(default=None, ge=-1)
    min_tokens: int = Field(default=0, ge=0, le=api.MAX_OUTPUT_TOKENS)
    ignore_eos: bool = False
    # Accepted and ignored: they never change the output (module doc).
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported_parameters(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        present = {k: v for k, v in data.items() if v is not None}  # null is the parameter left out
        return _refuse_unsupported(present, _UNSUPPORTED_PARAMETERS)

    @field_validator("stop", mode="before")
    @classmethod
    def _as_list(cls, stop: Any) -> Any:
        if isinstance(stop, str):
            return [stop]
        if isinstance(stop, list):
            return stop
        raise ValueError("Input should be a string or a list of strings")

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise Refusal("only allowed when stream is true", "stream_options")
        return self

    @model_validator(mode="after")
    def _min_tokens_within_the_limit(self) -> ChatCompletionRequest:
        limit = self.output_limit
        if limit is not None and self.min_tokens > limit:
            raise Refusal(f"must be at most the output limit ({limit})", "min_tokens")
        return self

    @property
    def output_limit(self) -> int | None:
        """The most tokens to generate; None is the rest of the context window."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def sampling_top_k(self) -> int | None:
        return self.top_k if self.top_k is not None and self.top_k >= 1 else None

    @property
    def sampling_seed(self) -> int | None:
        """The sampler's unsigned seed: a negative one in two's complement (module doc)."""
        return None if self.seed is None else self.seed % 2**64

    def system_text(self) -> str | None:
        parts = [m.text for m in self.messages if m.role in SYSTEM_ROLES]
        return "\n\n".join(parts) if parts else None

    def turns(self) -> tuple[Message, ...]:
        """The conversation in order, without its system messages (`system_text` joins those)."""
        return tuple(Message(m.role, m.text) for m in self.messages if m.role not in SYSTEM_ROLES)


def parse_chat_request(body: bytes | dict[str, Any]) -> ChatCompletionRequest:
    data = api.parse_json_body(body) if isinstance(body, bytes) else dict(body)
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def from_validation_error(exc: ValidationError) -> ApiError:
    """One 400 naming the first problem's parameter, e.g. `messages[1].content: Field required`."""
    first = exc.errors(include_url=False)[0]
    loc: list[str | int] = list(first["loc"])
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, Refusal):
        loc.append(cause.at)
    param = param_path(loc)
    # Our own validators raise ValueError; drop pydantic's "Value error, " prefix.
    problem = str(cause) if first["type"] == "value_error" else first["msg"]
    return errors.invalid_request(f"{param}: {problem}" if param else problem, param=param or None)


def param_path(loc: list[str | int]) -> str:
    """`["messages", 1, "content"]` -> `messages[1].content`, OpenAI's notation."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


def prompt_for(req: ChatCompletionRequest, tokenizer: Tokenizer, max_context: int) -> tuple[list[int], SamplingParams]:
    """`chat_prompt` for a Chat Completions request; its refusals (the template's, the context window's) name
    `messages`, as OpenAI's context_length_exceeded does."""
    try:
        return chat_prompt(req.turns(), req.system_text(), tokenizer, max_context, max_tokens=req.output_limit,
                           temperature=req.temperature, top_k=req.sampling_top_k, top_p=req.top_p,
                           seed=req.sampling_seed, stop_sequences=req.stop, min_tokens=req.min_tokens,
                           ignore_eos=req.ignore_eos)
    except ApiError as e:  # chat_prompt refuses with 400s only
        message = e.message if e.message.startswith("messages:") else f"messages: {e.message}"
        raise errors.invalid_request(message, param="messages") from None


# ---- responses ---------------------------------------------------------------------------

_ID_ALPHABET = string.digits + string.ascii_letters


def new_completion_id() -> str:
    """`chatcmpl-` and 24 base62 characters (about 143 random bits)."""
    return "chatcmpl-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def finish_reason(stop_reason: str, stop_sequence: str | None) -> Literal["stop", "length"]:
    """OpenAI's finish reason for the actor's stop reason: a natural or a requested stop, or out of room."""
    api.check_stop(stop_reason, stop_sequence)
    return "length" if stop_reason in ("max_tokens", "model_context_window_exceeded") else "stop"


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    api.check_token_count("input_tokens", input_tokens)
    api.check_token_count("output_tokens", output_tokens)
    return {"prompt_tokens": input_tokens, "completion_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens}


def completion_response(completion_id: str, created: int, model: str, text: str, stop_reason: str,
                        stop_sequence: str | None, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """The complete non-streamed `ChatCompletion`: one choice, its text, why it stopped, the usage."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish_reason(stop_reason, stop_sequence),
        }],
        "usage": usage(input_tokens, output_tokens),
        "system_fingerprint": None,
    }


# ---- errors ------------------------------------------------------------------------------

def error_body(err: ApiError, request_id: str | None) -> dict[str, Any]:
    """OpenAI's `{"error": {message, type, param, code}}` for one of our refusals (same HTTP status).

    OpenAI's types are by status: `invalid_request_error` for a client's fault (401 too,
    with code `invalid_api_key`), `server_error` for ours (500, 503 with `retry-after`,
    504). The request id is in the `request-id` header; a server error's message names it
    too, as OpenAI's do, since that is the one people report (and a stream's error has no
    headers of its own). Serve's proxy owns `x-request-id`, the header the SDK reads.
    """
    code = _ERROR_CODES.get(err.type)
    if err.status == 404 and err.param == "model":
        code = "model_not_found"
    message = err.message
    if err.status >= 500 and request_id is not None:
        message += f" (request id {request_id})"
    return {"error": {
        "message": message,
        "type": "invalid_request_error" if err.status < 500 else "server_error",
        "param": err.param,
        "code": code,
    }}
