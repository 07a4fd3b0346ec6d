"""OpenAI's Chat Completions at our boundary: validation, response and chunk bodies read back by the
official `openai` SDK's own types and client (through an in-memory transport), errors in OpenAI's shape,
and the one models page both SDKs read."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import anthropic
import openai
import pytest
from openai.types import Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from actors.tokenizer import Message, Tokenizer
from serve_app import errors, model_list, openai_api
from serve_app.errors import ApiError
from serve_app.openai_sse import ChunkStream
from serve_app.sse import StreamOrderError

try:
    import httpx2 as httpx  # the transport the SDKs are built on from their next major versions
except ImportError:
    import httpx

MESSAGES = [{"role": "user", "content": "hi"}]


def body(**extra) -> dict:
    return {"model": "tiny", "messages": MESSAGES, **extra}


def refused(data: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        openai_api.parse_chat_request(data)
    return info.value


# ---- requests ------------------------------------------------------------------------------

def test_defaults_and_nulls_are_the_parameters_left_out():
    for req in (openai_api.parse_chat_request(body()),
                openai_api.parse_chat_request(body(temperature=None, n=None, stop=None, stream=None, seed=None,
                                                   max_tokens=None, tools=None, logprobs=None))):
        assert (req.temperature, req.top_p, req.output_limit, req.sampling_seed) == (1.0, None, None, None)
        assert (req.stop, req.stream, req.include_usage) == ([], False, False)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 2}, "n"),
        ({"n": True}, "n"),  # not coerced to 1
        ({"n": 1.0}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1}, "presence_penalty"),
        ({"presence_penalty": False}, "presence_penalty"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"verbosity": "low"}, "verbosity"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "12"}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop[0]"),
        ({"stop": ["a", 5]}, "stop[1]"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream, as OpenAI
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),  # usage in every chunk, but no usage asked for
        ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}},
         "stream_options.continuous_usage_stats"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"use_beam_search": True}, "use_beam_search"),  # a vLLM extension we do not serve: refused by name
        ({"best_of": 2}, "best_of"),
        ({"model": ""}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}, "messages[0].role"),
        ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x"}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "input_audio", "input_audio": {}}]}]},
         "messages[0].content[1].type"),
        ({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content[0].text"),
        ({"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
         "messages[1].tool_calls"),
        ({"messages": [*MESSAGES, {"role": "assistant", "content": "x", "refusal": "no"}]}, "messages[1].refusal"),
        ({"messages": [*MESSAGES, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]},
         "messages[1].content[0].type"),
    ],
)
def test_every_refusal_names_its_parameter_in_the_message_and_in_param(extra, param):
    err = refused(body(**extra))
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert err.message.startswith(f"{param}: "), err.message
    assert openai_api.error_body(err, "req_1") == {
        "error": {"message": err.message, "type": "invalid_request_error", "param": param, "code": None}}


def test_what_asks_for_nothing_is_served():
    req = openai_api.parse_chat_request(body(
        n=1, tools=[], tool_choice="none", functions=[], function_call="none", response_format={"type": "text"},
        logprobs=False, logit_bias={}, frequency_penalty=0, presence_penalty=0.0, modalities=["text"],
        reasoning_effort="none", parallel_tool_calls=False, user="u-1", safety_identifier="s", store=False,
        metadata={"k": "v"}, service_tier="auto", prompt_cache_key="p",
        messages=[{"role": "user", "content": "hi", "name": "ann"},
                  {"role": "assistant", "content": "hello", "tool_calls": [], "refusal": None}],
    ))
    assert req.turns() == (Message("user", "hi"), Message("assistant", "hello"))


def test_max_completion_tokens_takes_precedence_over_max_tokens():
    assert openai_api.parse_chat_request(body(max_tokens=5, max_completion_tokens=7)).output_limit == 7
    assert openai_api.parse_chat_request(body(max_tokens=5)).output_limit == 5
    assert openai_api.parse_chat_request(body(max_completion_tokens=9, max_tokens=None)).output_limit == 9


@pytest.mark.parametrize("stop, expected", [("\n", ["\n"]), (["a", "bc"], ["a", "bc"]), ([], []),
                                            (["1", "2", "3", "4"], ["1", "2", "3", "4"])])
def test_stop_is_a_string_or_up_to_four(stop, expected):
    assert openai_api.parse_chat_request(body(stop=stop)).stop == expected


@pytest.mark.parametrize("seed, sampler_seed", [(0, 0), (7, 7), (2**63 - 1, 2**63 - 1), (-1, 2**64 - 1),
                                                (-(2**63), 2**63)])
def test_a_signed_seed_maps_one_to_one_onto_the_samplers_unsigned_one(seed, sampler_seed):
    assert openai_api.parse_chat_request(body(seed=seed)).sampling_seed == sampler_seed


def test_system_and_developer_messages_are_the_system_prompt_joined_in_order():
    req = openai_api.parse_chat_request(body(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
        {"role": "system", "content": [{"type": "text", "text": "Answer in English."}]},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "why?"},
    ]))
    assert req.system_text() == "Be brief.\n\nAnswer in English."
    assert req.turns() == (Message("user", "Hello"), Message("assistant", "Hi"), Message("user", "why?"))
    assert openai_api.parse_chat_request(body()).system_text() is None


def test_a_body_that_is_not_a_json_object_is_a_400():
    with pytest.raises(ApiError, match="request body must be a JSON object"):
        openai_api.parse_chat_request(b"[1]")


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint)


def test_prompt_for_converts_to_the_runtimes_prompt_and_sampling(tokenizer):
    req = openai_api.parse_chat_request(body(
        messages=[{"role": "system", "content": "Be brief."}, *MESSAGES], max_tokens=5, temperature=1.5, top_p=0.9,
        seed=-1, stop="\n"))
    prompt, sampling = openai_api.prompt_for(req, tokenizer, 256)
    assert prompt == tokenizer.encode_chat([Message(m["role"], m["content"]) for m in MESSAGES], system="Be brief.")
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed) == (5, 1.5, 0.9, 2**64 - 1)
    assert sampling.stop_sequences == ("\n",)
    # No limit: the rest of the context window.
    prompt, sampling = openai_api.prompt_for(openai_api.parse_chat_request(body()), tokenizer, 256)
    assert sampling.max_tokens == 256 - len(prompt)


def test_prompt_refusals_name_the_messages(tokenizer):
    with pytest.raises(ApiError) as info:
        openai_api.prompt_for(openai_api.parse_chat_request(body(max_completion_tokens=1000)), tokenizer, 64)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert info.value.message.startswith("messages: ") and "context window" in info.value.message
    with pytest.raises(ApiError) as info:  # the template's refusal: a prefill must not end in whitespace
        openai_api.prompt_for(openai_api.parse_chat_request(body(
            messages=[*MESSAGES, {"role": "assistant", "content": "{ "}])), tokenizer, 64)
    assert (info.value.param, info.value.message.count("messages:")) == ("messages", 1)


# ---- responses -----------------------------------------------------------------------------

@pytest.mark.parametrize("stop_reason, stop_sequence, finish_reason", [
    ("end_turn", None, "stop"), ("stop_sequence", "\n", "stop"), ("max_tokens", None, "length"),
    ("model_context_window_exceeded", None, "length"),
])
def test_completion_body_is_the_sdks_chat_completion(stop_reason, stop_sequence, finish_reason):
    data = openai_api.completion_response("chatcmpl-1", 1700000000, "tiny", "Hello!", stop_reason, stop_sequence,
                                          input_tokens=5, output_tokens=3)
    completion = ChatCompletion.model_validate(data)
    assert (completion.id, completion.object, completion.created, completion.model) == (
        "chatcmpl-1", "chat.completion", 1700000000, "tiny")
    [choice] = completion.choices
    assert (choice.index, choice.message.role, choice.message.content) == (0, "assistant", "Hello!")
    assert choice.finish_reason == finish_reason
    assert completion.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_an_unknown_stop_reason_is_a_bug_not_a_body():
    with pytest.raises(ValueError, match="stop_reason"):
        openai_api.completion_response("chatcmpl-1", 1, "tiny", "", "cancelled", None, 1, 1)


def test_completion_ids_are_unique_and_prefixed():
    ids = {openai_api.new_completion_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("chatcmpl-") and len(i) == 33 for i in ids)


# ---- the chunk stream ----------------------------------------------------------------------

def complete_stream(pieces: list[str], *, include_usage: bool, num_pings: int = 0,
                    stop=("end_turn", None), is_usage_continuous: bool = False) -> bytes:
    stream = ChunkStream("chatcmpl-1", "tiny", 5, include_usage=include_usage,
                         is_usage_continuous=is_usage_continuous, created=1700000000)
    out = [stream.start()]
    out += [stream.ping() for _ in range(num_pings)]
    out += [stream.text(piece, n) for n, piece in enumerate(pieces, 1)]
    out.append(stream.finish(stop[0], stop[1], output_tokens=len(pieces)))
    assert stream.is_closed
    return b"".join(out)


def data_lines(raw: bytes) -> list[str]:
    return [block.removeprefix("data: ") for block in raw.decode().split("\n\n") if block.startswith("data: ")]


@pytest.mark.parametrize("include_usage", [False, True])
def test_chunk_order_and_every_chunk_parses_as_the_sdks_type(include_usage):
    raw = complete_stream(["Hel", "lo"], include_usage=include_usage, num_pings=2)
    assert raw.count(b": ping\n\n") == 2
    lines = data_lines(raw)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        assert (chunk["id"], chunk["object"], chunk["created"]) == ("chatcmpl-1", "chat.completion.chunk", 1700000000)
        assert ("usage" in chunk) is include_usage
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [None, None, None, "stop"]
    if include_usage:
        assert [c["usage"] for c in chunks] == [None] * 4 + [
            {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}]
        assert chunks[-1]["choices"] == []
    else:
        assert len(chunks) == 4


def test_the_extensions_benchmark_clients_send_are_served_with_vllms_meaning(tokenizer):
    req = openai_api.parse_chat_request(body(
        max_tokens=16, min_tokens=4, ignore_eos=True, top_k=-1, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert (req.min_tokens, req.ignore_eos, req.sampling_top_k, req.continuous_usage) == (4, True, None, True)
    assert openai_api.parse_chat_request(body(top_k=0)).sampling_top_k is None  # vLLM's "no top-k" too
    assert openai_api.parse_chat_request(body(top_k=40)).sampling_top_k == 40
    _, sampling = openai_api.prompt_for(req, tokenizer, 512)
    assert (sampling.max_tokens, sampling.min_tokens, sampling.ignore_eos, sampling.top_k) == (16, 4, True, None)
    # No output limit: the rest of the window, which must still hold min_tokens.
    _, open_ended = openai_api.prompt_for(openai_api.parse_chat_request(body(min_tokens=4)), tokenizer, 512)
    assert open_ended.min_tokens == 4 and open_ended.max_tokens >= 4
    with pytest.raises(ApiError) as info:
        openai_api.prompt_for(openai_api.parse_chat_request(body(min_tokens=600)), tokenizer, 512)
    assert "min_tokens" in info.value.message


def test_continuous_usage_puts_the_usage_so_far_in_every_chunk():
    raw = complete_stream(["Hel", "lo"], include_usage=True, is_usage_continuous=True)
    chunks = [json.loads(line) for line in data_lines(raw)[:-1]]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 2, 2]
    assert all(c["usage"]["prompt_tokens"] == 5 and c["usage"]["total_tokens"] == 5 + c["usage"]["completion_tokens"]
               for c in chunks)
    assert chunks[-1]["choices"] == []  # the usage chunk still ends the stream, as with include_usage alone


def test_empty_text_sends_nothing():
    stream = ChunkStream("chatcmpl-1", "tiny", 1, include_usage=False)
    stream.start()
    assert stream.text("", 0) == b""


def _open() -> ChunkStream:
    stream = ChunkStream("chatcmpl-1", "tiny", 1, include_usage=True)
    stream.start()
    return stream


def _finished() -> ChunkStream:
    stream = _open()
    stream.finish("end_turn", None, 1)
    return stream


def _failed() -> ChunkStream:
    stream = _open()
    stream.error(errors.api_error("x"))
    return stream


@pytest.mark.parametrize(
    "make, call",
    [
        (lambda: ChunkStream("c", "tiny", 1, include_usage=False), lambda s: s.text("x", 1)),
        (lambda: ChunkStream("c", "tiny", 1, include_usage=False), lambda s: s.ping()),
        (lambda: ChunkStream("c", "tiny", 1, include_usage=False), lambda s: s.finish("end_turn", None, 0)),
        (_open, lambda s: s.start()),
        (_finished, lambda s: s.text("x", 1)),
        (_finished, lambda s: s.ping()),
        (_finished, lambda s: s.finish("end_turn", None, 1)),
        (_finished, lambda s: s.error(errors.api_error("late"))),
        (_failed, lambda s: s.text("x", 1)),
        (_failed, lambda s: s.finish("end_turn", None, 1)),
        (_failed, lambda s: s.error(errors.api_error("again"))),
    ],
)
def test_out_of_order_chunks_raise(make, call):
    with pytest.raises(StreamOrderError, match="cannot send"):
        call(make())


def test_bad_finish_leaves_the_stream_open_for_an_error():
    stream = _open()
    with pytest.raises(ValueError, match="stop_reason"):
        stream.finish("cancelled", None, 1)
    assert not stream.is_closed
    assert stream.error(errors.api_error("x")).startswith(b"data: {\"error\"")


def test_an_error_chunk_is_openais_shape_naming_the_request_id_and_ends_the_stream():
    stream = _open()
    raw = stream.error(errors.timeout("the model did not answer in time"), request_id="req_1")
    assert stream.is_closed
    [line] = data_lines(raw)
    assert json.loads(line) == {"error": {"message": "the model did not answer in time (request id req_1)",
                                          "type": "server_error", "param": None, "code": "timeout"}}


# ---- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("err, status, etype, code, param", [
    (errors.invalid_request("x: bad", param="x"), 400, "invalid_request_error", None, "x"),
    (errors.authentication("invalid x-api-key"), 401, "invalid_request_error", "invalid_api_key", None),
    (errors.not_found("model: 'm' is not served here", param="model"), 404, "invalid_request_error",
     "model_not_found", "model"),
    (errors.not_found("GET /v1/chat/x is not a route"), 404, "invalid_request_error", None, None),
    (errors.request_too_large("too big"), 413, "invalid_request_error", "request_too_large", None),
    (errors.api_error("internal error"), 500, "server_error", None, None),
    (errors.overloaded("busy", 2.5), 503, "server_error", "overloaded", None),
    (errors.timeout("late"), 504, "server_error", "timeout", None),
])
def test_errors_in_openais_shape_keep_their_status(err, status, etype, code, param):
    assert err.status == status
    # A server error's message names the request id, as OpenAI's do: it is the one people report.
    message = err.message + (" (request id req_1)" if status >= 500 else "")
    assert openai_api.error_body(err, "req_1") == {"error": {"message": message, "type": etype, "param": param,
                                                             "code": code}}


# ---- the official SDK against a miniature server made of these pieces ----------------------

MODELS = [model_list.model_info("tiny", "Tiny", datetime(2025, 1, 1, tzinfo=timezone.utc)),
          model_list.model_info("zq-other", "Other", datetime(2024, 6, 1, tzinfo=timezone.utc))]


def fake_server(request: httpx.Request) -> httpx.Response:
    """Validate, then answer with the builders: the 'model' echoes the last user turn word by word."""
    headers = {"x-request-id": "req_fake"}
    try:
        if request.method == "GET" and request.url.path == "/v1/models":
            return httpx.Response(200, json=model_list.models_response(MODELS), headers=headers)
        if request.headers.get("authorization") != "Bearer key":
            raise errors.authentication("invalid x-api-key")
        req = openai_api.parse_chat_request(request.content)
        if req.model == "busy":
            raise errors.overloaded("all accelerators are busy", 2.5)
        if req.model not in {m["id"] for m in MODELS}:
            raise errors.not_found(f"model: {req.model!r} is not served here", param="model")
        words = [w + " " for w in req.turns()[-1].content.split()][: req.output_limit]
        stop_reason = "max_tokens" if req.output_limit == len(words) else "end_turn"
        if req.stream:
            stream = ChunkStream("chatcmpl-1", req.model, 3, include_usage=req.include_usage)
            raw = stream.start() + stream.ping() + b"".join(stream.text(w, n) for n, w in enumerate(words, 1))
            if "fail" in words[-1]:
                raw += stream.error(errors.api_error("the model failed"), "req_fake")
            else:
                raw += stream.finish(stop_reason, None, len(words))
            return httpx.Response(200, content=raw, headers=headers | {"content-type": "text/event-stream"})
        data = openai_api.completion_response("chatcmpl-1", 1, req.model, "".join(words), stop_reason, None, 3,
                                              len(words))
        return httpx.Response(200, json=data, headers=headers)
    except ApiError as e:
        return httpx.Response(e.status, json=openai_api.error_body(e, "req_fake"), headers=headers | e.headers)


@pytest.fixture
def client():
    with openai.OpenAI(base_url="http://zeroqueue.test/v1", api_key="key", max_retries=0,
                       http_client=httpx.Client(transport=httpx.MockTransport(fake_server)),
                       _strict_response_validation=True) as c:
        yield c


def test_sdk_create(client):
    completion = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a b c"}],
                                                max_completion_tokens=2)
    assert completion.choices[0].message.content == "a b "
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 2


def test_sdk_stream_with_usage(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a b c"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "a b c "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.total_tokens == 6


def test_sdk_stream_helper_accumulates(client):
    with client.chat.completions.stream(model="tiny", messages=[{"role": "user", "content": "x y"}]) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "x y "


def test_sdk_raises_on_an_error_chunk_mid_stream(client):
    seen = []
    with pytest.raises(openai.APIError) as info:
        for chunk in client.chat.completions.create(model="tiny", stream=True,
                                                    messages=[{"role": "user", "content": "a fail"}]):
            seen.append(chunk.choices[0].delta.content)
    assert seen == ["", "a ", "fail "]  # what came before the error reached the reader
    assert info.value.type == "server_error" and "req_fake" in info.value.message


def test_sdk_raises_its_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=MESSAGES, n=2)
    assert (bad.value.param, bad.value.type, bad.value.request_id) == ("n", "invalid_request_error", "req_fake")
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.InternalServerError) as busy:
        client.chat.completions.create(model="busy", messages=MESSAGES)
    assert busy.value.status_code == 503 and busy.value.response.headers["retry-after"] == "3"
    with pytest.raises(openai.AuthenticationError) as unauthorized:
        client.with_options(api_key="wrong").chat.completions.create(model="tiny", messages=MESSAGES)
    assert unauthorized.value.code == "invalid_api_key"


def test_one_models_page_answers_both_sdks(client):
    assert [m.id for m in client.models.list()] == ["tiny", "zq-other"]
    assert Model.model_validate(MODELS[0]).created == int(datetime(2025, 1, 1, tzinfo=timezone.utc).timestamp())
    assert Model.model_validate(MODELS[0]).owned_by == "zeroqueue"
    with anthropic.Anthropic(base_url="http://zeroqueue.test", api_key="key", max_retries=0,
                             http_client=httpx.Client(transport=httpx.MockTransport(fake_server)),
                             _strict_response_validation=True) as claude:
        models = list(claude.models.list())
    assert [(m.id, m.display_name) for m in models] == [("tiny", "Tiny"), ("zq-other", "Other")]
