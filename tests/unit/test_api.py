"""Request validation, error bodies and response shapes of the Messages API boundary.

The response shapes are checked by the official `anthropic` SDK itself: its pydantic
types, and a real client (strict response validation) talking to a fake server built
from these builders through an in-memory transport.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
import time
from datetime import datetime, timedelta, timezone

import anthropic
import pytest
from anthropic.types import Message, MessageTokensCount, ModelInfo
from anthropic.types.shared import ErrorResponse

from actors.tokenizer import Message as Turn
from serve_app import api, errors, model_list
from serve_app.errors import ApiError

try:
    import httpx2 as httpx  # the transport anthropic>=2 is built on
except ImportError:  # older SDKs use httpx
    import httpx


def body(**overrides):
    base = {"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "Hello there"}]}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not _DROP}


_DROP = object()


def refused(data, parse=api.parse_messages_request) -> str:
    with pytest.raises(ApiError) as info:
        parse(data)
    err = info.value
    assert (err.status, err.type) == (400, "invalid_request_error")
    return err.message


# --- validation: each rule is a 400 naming the field --------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"max_tokens": "12"}, "max_tokens: Input should be a valid integer"),
        ({"max_tokens": True}, "max_tokens: Input should be a valid integer"),
        ({"max_tokens": 12.0}, "max_tokens: Input should be a valid integer"),
        ({"temperature": True}, "temperature: Input should be a valid number"),
        ({"temperature": "0.5"}, "temperature: Input should be a valid number"),
        ({"top_k": 2.5}, "top_k: Input should be a valid integer"),
        ({"stream": "yes"}, "stream: Input should be a valid boolean"),
        ({"model": 3}, "model: Input should be a valid string"),
        ({"messages": "hi"}, "messages: Input should be a valid list"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content: Input should be a string or a list"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}, "messages.0.content.0.text: Input should be a valid string"),
        ({"system": 5}, "system: Input should be a string or a list"),
        ({"stop_sequences": "END"}, "stop_sequences: Input should be a valid list"),
        ({"seed": "7"}, "seed: Input should be a valid integer"),
    ],
)
def test_wrong_types_are_refused_not_coerced(overrides, expected):
    assert refused(body(**overrides)).startswith(expected)


@pytest.mark.parametrize("field", ["model", "messages", "max_tokens"])
def test_missing_required_field(field):
    assert refused(body(**{field: _DROP})) == f"{field}: Field required"


def test_missing_content_names_the_message():
    messages = [{"role": "user", "content": "a"}, {"role": "assistant"}]
    assert refused(body(messages=messages)) == "messages.1.content: Field required"


@pytest.mark.parametrize(
    "messages, expected",
    [
        ([], "messages: List should have at least 1 item"),
        ([{"role": "user", "content": ""}], "messages.0.content: text content must contain non-whitespace"),
        ([{"role": "user", "content": " \n"}], "messages.0.content: text content must contain non-whitespace"),
        ([{"role": "user", "content": []}], "messages.0.content: List should have at least 1 item"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "  "}]}],
            "messages.0.content.1.text: text content blocks must contain non-whitespace",
        ),
        ([{"role": "system", "content": "x"}], "messages.0.role: Input should be 'user' or 'assistant'"),
        ([{"role": "assistant", "content": "x"}], "messages.0.role: the first message must have role 'user'"),
        ([{"role": "user", "content": "x", "name": "bob"}], "messages.0.name: Extra inputs are not permitted"),
    ],
)
def test_bad_messages(messages, expected):
    assert refused(body(messages=messages)).startswith(expected)


@pytest.mark.parametrize(
    "roles, bad_index",
    [(["user", "user"], 1), (["user", "assistant", "assistant"], 2), (["user", "assistant", "user", "user"], 3)],
)
def test_consecutive_same_role_turns_are_badly_ordered(roles, bad_index):
    messages = [{"role": role, "content": f"turn {i}"} for i, role in enumerate(roles)]
    message = refused(body(messages=messages))
    assert message.startswith(f"messages.{bad_index}.role: roles must alternate")
    assert "badly ordered" in message and repr(roles[bad_index]) in message


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"max_tokens": -5}, "max_tokens: Input should be greater than or equal to 1"),
        ({"temperature": 1.5}, "temperature: Input should be less than or equal to 1"),
        ({"temperature": -0.1}, "temperature: Input should be greater than or equal to 0"),
        ({"top_p": 0}, "top_p: Input should be greater than 0"),
        ({"top_p": 1.01}, "top_p: Input should be less than or equal to 1"),
        ({"top_k": 0}, "top_k: Input should be greater than or equal to 1"),
        ({"seed": -1}, "seed: Input should be greater than or equal to 0"),
        ({"seed": 2**64}, "seed: Input should be less than or equal to"),
        ({"stop_sequences": ["s"] * 17}, "stop_sequences: List should have at most 16 items"),
        ({"stop_sequences": ["ok", ""]}, "stop_sequences.1: String should have at least 1 character"),
        ({"stop_sequences": ["x" * 257]}, "stop_sequences.0: String should have at most 256 characters"),
        ({"model": ""}, "model: String should have at least 1 character"),
    ],
)
def test_out_of_range(overrides, expected):
    assert refused(body(**overrides)).startswith(expected)


def test_json_nested_too_deeply_is_a_400_not_a_crash():
    assert "nested too deeply" in refused(b"[" * 100_000)
    assert "nested too deeply" in refused(b'{"model": "tiny", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")


def test_max_tokens_and_the_number_of_messages_are_bounded_before_any_work():
    assert refused(body(max_tokens=10**12)).startswith(
        f"max_tokens: Input should be less than or equal to {api.MAX_OUTPUT_TOKENS}")
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(api.MAX_MESSAGES + 1)]
    assert refused(body(messages=turns)).startswith(f"messages: List should have at most {api.MAX_MESSAGES} items")


def test_nan_is_not_json():
    raw = b'{"model": "tiny", "max_tokens": 4, "temperature": NaN, "messages": []}'
    assert refused(raw).startswith("request body is not valid JSON: NaN")


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b'{"model": "tiny",', "request body is not valid JSON"),
        (b"[1, 2]", "request body must be a JSON object, got list"),
        (b'{"model": "\xff"}', "request body is not valid UTF-8"),
    ],
)
def test_undecodable_body(raw, expected):
    assert refused(raw).startswith(expected)


@pytest.mark.parametrize("block_type", ["image", "document", "tool_result", "tool_use", "thinking"])
def test_unsupported_content_blocks(block_type):
    content = [{"type": "text", "text": "look:"}, {"type": block_type, "source": {}}]
    message = refused(body(messages=[{"role": "user", "content": content}]))
    assert message == (
        f"messages.0.content.1: content blocks of type {block_type!r} are not supported "
        "by this server; only 'text' blocks are"
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"name": "get_weather", "input_schema": {"type": "object"}}]),
        ("tool_choice", {"type": "auto"}),
        ("thinking", {"type": "enabled", "budget_tokens": 1024}),
        ("mcp_servers", [{"type": "url", "url": "https://x", "name": "x"}]),
        ("output_format", {"type": "json_schema", "schema": {}}),
        ("speed", "fast"),
    ],
)
def test_unsupported_features_are_refused_by_name(field, value):
    assert refused(body(**{field: value})) == f"{field}: not supported by this server (it serves text-only chat)"


@pytest.mark.parametrize(
    "field, value",
    [("tools", []), ("tools", None), ("tool_choice", {"type": "none"}), ("thinking", {"type": "disabled"})],
)
def test_feature_values_that_ask_for_nothing_are_accepted(field, value):
    request = api.parse_messages_request(body(**{field: value}))
    assert not hasattr(request, field)


def test_unknown_field_is_named():
    assert refused(body(frequency_penalty=0.5)) == "frequency_penalty: Extra inputs are not permitted"


def test_count_tokens_has_no_max_tokens():
    message = refused(body(), parse=api.parse_count_tokens_request)
    assert message == "max_tokens: Extra inputs are not permitted"


def test_count_tokens_validates_turns_too():
    data = body(max_tokens=_DROP, messages=[{"role": "assistant", "content": "x"}])
    assert refused(data, parse=api.parse_count_tokens_request).startswith("messages.0.role: the first message")


# --- accepted requests --------------------------------------------------------------


def test_valid_request_flattens_blocks_and_system():
    request = api.parse_messages_request(
        body(
            system=[{"type": "text", "text": "You are terse. "}, {"type": "text", "text": "Answer in French.", "cache_control": {"type": "ephemeral"}}],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "Name "}, {"type": "text", "text": "a colour."}]},
                {"role": "assistant", "content": "Rouge."},
                {"role": "user", "content": "Another."},
                {"role": "assistant", "content": [{"type": "text", "text": "Bl", "citations": None}]},
            ],
            temperature=0,
            top_p=0.9,
            top_k=40,
            stop_sequences=["\n\n", "END"],
            seed=7,
            stream=True,
            metadata={"user_id": "u-1"},
            service_tier="auto",
        )
    )
    assert request.system_text() == "You are terse. Answer in French."
    assert request.turns() == (
        Turn("user", "Name a colour."),
        Turn("assistant", "Rouge."),
        Turn("user", "Another."),
        Turn("assistant", "Bl"),
    )
    assert request.is_prefill
    assert (request.temperature, request.top_p, request.top_k, request.seed) == (0.0, 0.9, 40, 7)
    assert request.stop_sequences == ["\n\n", "END"] and request.stream is True


def test_defaults_and_string_system():
    request = api.parse_messages_request(json.dumps(body(system="Be kind.")).encode())
    assert request.system_text() == "Be kind."
    assert (request.temperature, request.top_p, request.top_k, request.seed) == (1.0, None, None, None)
    assert request.stop_sequences == [] and request.stream is False and not request.is_prefill
    assert api.parse_messages_request(body(system="")).system_text() is None
    assert api.parse_messages_request(body()).system_text() is None


def test_seed_up_to_u64_and_int_temperature_accepted():
    request = api.parse_messages_request(body(seed=2**64 - 1, temperature=1))
    assert request.seed == 2**64 - 1 and request.temperature == 1.0


def test_request_is_immutable():
    request = api.parse_messages_request(body())
    with pytest.raises(Exception, match="frozen"):
        request.max_tokens = 99


# --- errors -------------------------------------------------------------------------


def test_body_size_limit():
    api.check_body_size(1024, max_bytes=1024)
    with pytest.raises(ApiError) as info:
        api.check_body_size(1025, max_bytes=1024)
    assert (info.value.status, info.value.type) == (413, "request_too_large")
    assert "1025" in info.value.message and "1024" in info.value.message


@pytest.mark.parametrize(
    "retry_after_s, seconds, ms",
    [(0.0, "1", "1"), (0.2, "1", "200"), (1.0, "1", "1000"), (2.1, "3", "2100"), (30, "30", "30000")],
)
def test_overloaded_retry_after_is_whole_seconds_at_least_one(retry_after_s, seconds, ms):
    err = errors.overloaded("no free accelerator", retry_after_s)
    assert (err.status, err.type) == (503, "overloaded_error")
    assert err.headers == {"retry-after": seconds, "retry-after-ms": ms}


@pytest.mark.parametrize("retry_after_s", [-1.0, float("nan"), float("inf")])
def test_overloaded_refuses_nonsense_delay(retry_after_s):
    with pytest.raises(ValueError, match="retry_after_s"):
        errors.overloaded("x", retry_after_s)


@pytest.mark.parametrize(
    "err, status",
    [
        (errors.invalid_request("bad"), 400),
        (errors.authentication("who?"), 401),
        (errors.not_found("no such model"), 404),
        (errors.api_error("boom"), 500),
        (errors.overloaded("busy", 1), 503),
        (errors.timeout("too slow"), 504),
    ],
)
def test_error_body_parses_as_sdk_error_response(err, status):
    data = errors.error_body(err, "req_abc")
    parsed = ErrorResponse.model_validate(data)
    assert (parsed.error.type, parsed.error.message, parsed.request_id) == (err.type, err.message, "req_abc")
    assert err.status == status
    assert errors.error_body(err, None) == {"type": "error", "error": {"type": err.type, "message": err.message}}


def test_api_error_pickles_and_passes_through_contextlib():
    err = errors.overloaded("busy", 2)
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.status, clone.type, clone.message) == (503, "overloaded_error", "busy")
    assert clone.headers == err.headers

    @contextlib.contextmanager
    def scope():
        yield

    with pytest.raises(ApiError), scope():
        raise err


# --- response builders, checked by the SDK's own types ------------------------------


def test_message_response_is_an_sdk_message():
    data = api.message_response("msg_1", "tiny", "Bonjour ✓", "stop_sequence", "END", 12, 5)
    message = Message.model_validate(data)
    assert message.content[0].type == "text" and message.content[0].text == "Bonjour ✓"
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (12, 5)
    assert (message.id, message.model, message.role, message.type) == ("msg_1", "tiny", "assistant", "message")


def test_message_stub_is_an_sdk_message():
    message = Message.model_validate(api.message_stub("msg_2", "tiny", 7))
    assert message.content == [] and message.stop_reason is None and message.usage.input_tokens == 7


@pytest.mark.parametrize(
    "stop_reason, stop_sequence",
    [("cancelled", None), ("stop_sequence", None), ("end_turn", "END"), ("max_tokens", "x")],
)
def test_message_response_refuses_inconsistent_finish(stop_reason, stop_sequence):
    with pytest.raises(ValueError, match="stop_"):
        api.message_response("msg_1", "tiny", "", stop_reason, stop_sequence, 1, 1)


@pytest.mark.parametrize("bad", [-1, True, 1.0])
def test_token_counts_must_be_non_negative_ints(bad):
    with pytest.raises(ValueError, match="output_tokens"):
        api.message_response("msg_1", "tiny", "", "end_turn", None, 1, bad)
    with pytest.raises(ValueError, match="input_tokens"):
        api.count_tokens_response(bad)


def test_count_tokens_response_is_sdk_shaped():
    assert MessageTokensCount.model_validate(api.count_tokens_response(42)).input_tokens == 42


def test_ids_have_documented_format_and_differ():
    message_ids = {api.new_message_id() for _ in range(100)}
    request_ids = {api.new_request_id() for _ in range(100)}
    assert len(message_ids) == 100 and len(request_ids) == 100
    assert all(re.fullmatch(r"msg_[0-9A-Za-z]{24}", i) for i in message_ids)
    assert all(re.fullmatch(r"req_[0-9A-Za-z]{24}", i) for i in request_ids)


EPOCH = datetime(2025, 1, 1, tzinfo=timezone.utc)
MODELS = [
    model_list.model_info(f"model-{i}", f"Model {i}", EPOCH - timedelta(days=i), max_input_tokens=4096, max_tokens=1024)
    for i in range(5)
]


def test_model_info_is_sdk_shaped():
    info = ModelInfo.model_validate(MODELS[1])
    assert (info.id, info.display_name, info.type) == ("model-1", "Model 1", "model")
    assert info.created_at == EPOCH - timedelta(days=1)
    assert MODELS[1]["created_at"] == "2024-12-31T00:00:00Z"
    with pytest.raises(ValueError, match="timezone-aware"):
        model_list.model_info("m", "M", datetime(2025, 1, 1))


@pytest.mark.parametrize(
    "params, ids, has_more",
    [
        ({}, ["model-0", "model-1", "model-2", "model-3", "model-4"], False),
        ({"limit": "2"}, ["model-0", "model-1"], True),
        ({"limit": "2", "after_id": "model-1"}, ["model-2", "model-3"], True),
        ({"limit": "2", "after_id": "model-3"}, ["model-4"], False),
        ({"limit": "2", "before_id": "model-3"}, ["model-1", "model-2"], True),
        ({"limit": "2", "before_id": "model-2"}, ["model-0", "model-1"], False),
        ({"after_id": "model-4"}, [], False),
    ],
)
def test_models_pages(params, ids, has_more):
    page = model_list.models_response(MODELS, model_list.parse_models_query(params))
    assert [m["id"] for m in page["data"]] == ids
    assert page["has_more"] is has_more
    assert (page["first_id"], page["last_id"]) == ((ids[0], ids[-1]) if ids else (None, None))


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"limit": "0"}, "limit: must be an integer from 1 to 1000"),
        ({"limit": "1001"}, "limit: must be an integer from 1 to 1000"),
        ({"limit": "²"}, "limit: must be an integer"),
        ({"after_id": "a", "before_id": "b"}, "after_id and before_id cannot both be given"),
    ],
)
def test_models_query_refusals(params, expected):
    assert refused(params, parse=model_list.parse_models_query).startswith(expected)


def test_models_unknown_cursor():
    query = model_list.parse_models_query({"after_id": "nope"})
    assert refused(query, parse=lambda q: model_list.models_response(MODELS, q)) == "after_id: no model with id 'nope'"


def test_json_bytes_survives_any_str():
    text = "a\u2028b\u2029c\u0085d\ud800e é 中"
    raw = api.json_bytes({"t": text})
    assert b"\n" not in raw and b"\r" not in raw
    assert len(raw.decode("utf-8").splitlines()) == 1  # even str.splitlines sees one line
    assert json.loads(raw) == {"t": text}


# --- the official SDK against a fake server made of these pieces ---------------------

MAX_BODY_BYTES = 4096
BRIEFLY_BUSY_ATTEMPTS: list[float] = []


def fake_server(request: httpx.Request) -> httpx.Response:
    """A miniature ingress: validate, then answer with the builders (the 'model'
    echoes the last user turn's words reversed; a token is a word)."""
    request_id = api.new_request_id()
    try:
        if request.method == "GET" and request.url.path == "/v1/models":
            data = model_list.models_response(MODELS, model_list.parse_models_query(dict(request.url.params)))
        elif request.url.path == "/v1/messages/count_tokens":
            req = api.parse_count_tokens_request(request.content)
            data = api.count_tokens_response(sum(len(m.content.split()) for m in req.turns()))
        elif request.url.path == "/v1/messages":
            api.check_body_size(len(request.content), MAX_BODY_BYTES)
            req = api.parse_messages_request(request.content)
            if req.model == "busy":
                raise errors.overloaded("all accelerators are busy", 2.5)
            if req.model == "briefly-busy":
                BRIEFLY_BUSY_ATTEMPTS.append(time.monotonic())
                raise errors.overloaded("all accelerators are busy", 0.05)
            if req.model not in {m["id"] for m in MODELS}:
                raise errors.not_found(f"model: {req.model!r} is not served here")
            words = req.turns()[-1].content.split()[::-1][: req.max_tokens]
            input_tokens = sum(len(m.content.split()) for m in req.turns())
            stop_reason = "max_tokens" if len(words) == req.max_tokens else "end_turn"
            data = api.message_response(
                api.new_message_id(), req.model, " ".join(words), stop_reason, None, input_tokens, len(words)
            )
        else:
            raise errors.not_found(f"no route {request.url.path}")
    except ApiError as err:
        headers = {"request-id": request_id, "content-type": "application/json", **err.headers}
        return httpx.Response(err.status, content=api.json_bytes(errors.error_body(err, request_id)), headers=headers)
    headers = {"request-id": request_id, "content-type": "application/json"}
    return httpx.Response(200, content=api.json_bytes(data), headers=headers)


@pytest.fixture
def client():
    http_client = httpx.Client(transport=httpx.MockTransport(fake_server))
    sdk = anthropic.Anthropic(
        api_key="unused", base_url="http://zeroqueue.test", http_client=http_client,
        max_retries=0, _strict_response_validation=True,
    )
    with sdk:
        yield sdk


def test_sdk_messages_create(client):
    message = client.messages.create(
        model="model-0", max_tokens=3, messages=[{"role": "user", "content": "one two three four"}],
        extra_body={"seed": 1, "temperature": 0.5},
    )
    assert message.content[0].text == "four three two"
    assert (message.stop_reason, message.usage.input_tokens, message.usage.output_tokens) == ("max_tokens", 4, 3)
    assert message.id.startswith("msg_")


def test_sdk_count_tokens(client):
    count = client.messages.count_tokens(model="model-0", messages=[{"role": "user", "content": "a b c"}])
    assert count.input_tokens == 3


def test_sdk_models_list_paginates_through_everything(client):
    assert [m.id for m in client.models.list(limit=2)] == [m["id"] for m in MODELS]
    first_page = client.models.list(limit=2)
    assert first_page.has_more and first_page.last_id == "model-1"


def test_sdk_raises_typed_errors_with_request_id(client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="model-0", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert bad.value.type == "invalid_request_error"
    assert bad.value.api_message == "max_tokens: Input should be greater than or equal to 1"
    assert bad.value.request_id.startswith("req_") and bad.value.body["request_id"] == bad.value.request_id

    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert missing.value.type == "not_found_error"

    with pytest.raises(anthropic.InternalServerError) as busy:
        client.messages.create(model="busy", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert (busy.value.status_code, busy.value.type) == (503, "overloaded_error")
    assert busy.value.response.headers["retry-after"] == "3"

    with pytest.raises(anthropic.APIStatusError) as too_large:
        client.messages.create(model="model-0", max_tokens=4, messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}])
    assert (too_large.value.status_code, too_large.value.type) == (413, "request_too_large")

    with pytest.raises(anthropic.BadRequestError, match="tools: not supported"):
        client.messages.create(
            model="model-0", max_tokens=4, messages=[{"role": "user", "content": "x"}],
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
        )


def test_sdk_retries_a_503_after_retry_after_ms(client):
    BRIEFLY_BUSY_ATTEMPTS.clear()
    retrying = client.with_options(max_retries=1)
    with pytest.raises(anthropic.InternalServerError):
        retrying.messages.create(model="briefly-busy", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert len(BRIEFLY_BUSY_ATTEMPTS) == 2
    # The SDK waited our 50 ms, not the 1 s that whole-second `retry-after` says.
    assert 0.05 <= BRIEFLY_BUSY_ATTEMPTS[1] - BRIEFLY_BUSY_ATTEMPTS[0] < 0.9
