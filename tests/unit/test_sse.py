"""SSE events for streamed messages, read back by the official SDK's own decoder and
message accumulator (`messages.stream`) through an in-memory transport."""

from __future__ import annotations

import json

import anthropic
import pytest
from anthropic._streaming import SSEDecoder
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from serve_app import errors, sse
from serve_app.sse import SseStream, StreamOrderError

try:
    import httpx2 as httpx  # the transport anthropic>=2 is built on
except ImportError:  # older SDKs use httpx
    import httpx

STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)
MESSAGES = [{"role": "user", "content": "hi"}]


def complete_stream(pieces: list[str], *, num_pings: int = 0, stop=("end_turn", None)) -> bytes:
    stream = SseStream("msg_test", "tiny", input_tokens=5)
    out = [stream.start()]
    out += [stream.ping() for _ in range(num_pings)]  # e.g. waiting for a cold actor
    out += [stream.text(piece, n) for n, piece in enumerate(pieces, 1)]
    out.append(stream.finish(stop[0], stop[1], output_tokens=len(pieces)))
    assert stream.is_closed
    return b"".join(out)


def chunked(raw: bytes, size: int) -> list[bytes]:
    # Small chunks split events, lines and multi-byte UTF-8 characters, as TCP may.
    return [raw[i : i + size] for i in range(0, len(raw), size)]


def decode(raw: bytes, chunk_size: int = 3):
    return list(SSEDecoder().iter_bytes(iter(chunked(raw, chunk_size))))


@pytest.fixture
def serve():
    """serve(raw) -> an SDK client whose every request streams back `raw`."""
    clients = []

    def make(raw: bytes) -> anthropic.Anthropic:
        def handler(request: httpx.Request) -> httpx.Response:
            assert json.loads(request.content)["stream"] is True
            headers = {"content-type": "text/event-stream", "request-id": "req_stream"}
            return httpx.Response(200, content=iter(chunked(raw, 5)), headers=headers)

        client = anthropic.Anthropic(
            api_key="unused", base_url="http://zeroqueue.test", max_retries=0,
            http_client=httpx.Client(transport=httpx.MockTransport(handler)),
            _strict_response_validation=True,
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def test_event_order_and_every_event_parses_as_an_sdk_type():
    events = decode(complete_stream(["Hel", "lo"], num_pings=2))
    assert [e.event for e in events] == [
        "message_start", "content_block_start", "ping", "ping",
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]
    for event in events:
        data = event.json()
        assert data["type"] == event.event  # the SDK parses data by its own `type`
        if event.event != "ping":
            assert STREAM_EVENT.validate_python(data).type == event.event


def test_sdk_stream_accumulates_the_final_message(serve):
    pieces = ["The", " answer", " is", " 42."]
    client = serve(complete_stream(pieces, num_pings=1, stop=("stop_sequence", "\n\n")))
    with client.messages.stream(model="tiny", max_tokens=8, messages=MESSAGES) as stream:
        assert list(stream.text_stream) == pieces
        message = stream.get_final_message()
        assert stream.request_id == "req_stream"
    assert message.content[0].text == "The answer is 42."
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "\n\n")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (5, 4)
    assert (message.id, message.model, message.role) == ("msg_test", "tiny", "assistant")


def test_sdk_create_with_stream_true_yields_raw_events_without_pings(serve):
    client = serve(complete_stream(["a", "b"], num_pings=3, stop=("max_tokens", None)))
    events = list(client.messages.create(model="tiny", max_tokens=2, messages=MESSAGES, stream=True))
    assert [e.type for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 2


def test_non_ascii_text_round_trips_through_the_sdk(serve):
    pieces = ["Grüße ", "日本語", " 🙂🚀", " line\u2028sep", " \"quoted\"\n", "\t\\"]
    client = serve(complete_stream(pieces))
    with client.messages.stream(model="tiny", max_tokens=9, messages=MESSAGES) as stream:
        assert stream.get_final_text() == "".join(pieces)
    raw = complete_stream(pieces)
    assert "日本語".encode() in raw  # sent as UTF-8, not \u escapes


def test_error_mid_stream_reaches_the_sdk_as_its_typed_error(serve):
    stream = SseStream("msg_test", "tiny", input_tokens=5)
    err = errors.api_error("the actor died")
    raw = stream.start() + stream.text("partial", 1) + stream.error(err, request_id="req_stream")
    assert stream.is_closed
    seen = []
    client = serve(raw)
    with pytest.raises(anthropic.APIStatusError) as info:
        with client.messages.stream(model="tiny", max_tokens=8, messages=MESSAGES) as sdk_stream:
            for text in sdk_stream.text_stream:
                seen.append(text)
    assert seen == ["partial"]
    assert (info.value.type, info.value.api_message) == ("api_error", "the actor died")
    assert info.value.body["request_id"] == "req_stream"


def test_error_before_anything_is_a_lone_error_event():
    stream = SseStream("msg_test", "tiny", input_tokens=5)
    raw = stream.error(errors.overloaded("busy", 1), request_id="req_1")
    [event] = decode(raw)
    assert event.event == "error"
    assert event.json() == {
        "type": "error", "error": {"type": "overloaded_error", "message": "busy"}, "request_id": "req_1",
    }


def test_exact_bytes():
    assert sse.ping() == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert sse.message_stop() == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    assert sse.content_block_delta(0, "é") == (
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"é"}}\n\n'
    ).encode()


def test_empty_text_sends_nothing():
    stream = SseStream("msg_test", "tiny", input_tokens=1)
    stream.start()
    assert stream.text("", 0) == b""


def _open() -> SseStream:
    stream = SseStream("msg_test", "tiny", input_tokens=1)
    stream.start()
    return stream


def _finished() -> SseStream:
    stream = _open()
    stream.finish("end_turn", None, 1)
    return stream


def _failed() -> SseStream:
    stream = _open()
    stream.error(errors.api_error("x"))
    return stream


@pytest.mark.parametrize(
    "make, call",
    [
        (lambda: SseStream("m", "tiny", 1), lambda s: s.text("x", 1)),
        (lambda: SseStream("m", "tiny", 1), lambda s: s.ping()),
        (lambda: SseStream("m", "tiny", 1), lambda s: s.finish("end_turn", None, 0)),
        (_open, lambda s: s.start()),
        (_finished, lambda s: s.text("x", 1)),
        (_finished, lambda s: s.ping()),
        (_finished, lambda s: s.finish("end_turn", None, 1)),
        (_finished, lambda s: s.error(errors.api_error("late"))),
        (_failed, lambda s: s.text("x", 1)),
        (_failed, lambda s: s.ping()),
        (_failed, lambda s: s.finish("end_turn", None, 1)),
        (_failed, lambda s: s.error(errors.api_error("again"))),
    ],
)
def test_out_of_order_events_raise(make, call):
    stream = make()
    with pytest.raises(StreamOrderError, match="cannot send"):
        call(stream)


def test_bad_finish_leaves_the_stream_open_for_an_error():
    stream = _open()
    with pytest.raises(ValueError, match="stop_reason"):
        stream.finish("cancelled", None, 1)
    with pytest.raises(ValueError, match="output_tokens"):
        stream.finish("end_turn", None, -1)
    assert not stream.is_closed
    [event] = decode(stream.error(errors.api_error("generation was cancelled")))
    assert event.event == "error"
