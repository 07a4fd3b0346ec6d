"""A streamed response releases its request exactly once, however it ends — also when its body never starts."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from serve_app.relay import Relay, RelayedStream
from serve_app.rows import Admitted
from serve_app.sse import SseStream
from serve_app.streaming import event_stream


class _Stream:
    """An actor stream (cluster.ActorStream) that never yields: the body would wait on it for ever."""

    async def next(self):
        await asyncio.sleep(3600)

    def cancel(self) -> None:
        pass

    async def drain(self) -> None:
        pass


def _admitted() -> Admitted:
    return Admitted("req-1", "m", "zq-m-000000000000", False, "hot", 3, _Stream(), arrival=0.0, dispatch_time=0.0)


class _Rows:
    """The release seam: records each end the way rows.Rows makes it happen, once."""

    def __init__(self) -> None:
        self.ended: list = []

    def end(self, admitted: Admitted, outcome: str) -> None:
        if admitted.outcome is None:
            admitted.outcome = outcome
            self.ended.append((admitted.request_id, outcome))


def _response(admitted: Admitted, rows: _Rows) -> RelayedStream:
    answer = Relay(10.0, 10.0, rows).answer(admitted, is_streamed=True)
    # A ping every 50 ms: with ASGI 2.4 a server tells the app the client left by failing its next send.
    body = event_stream(SseStream("msg_1", "m", 3), answer, 0.05, admitted.request_id)
    return RelayedStream(body, answer.close, {})


def _scope() -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "path": "/v1/messages", "headers": []}


def test_a_client_gone_before_the_first_event_still_releases_the_request():
    rows = _Rows()
    admitted = _admitted()

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        raise OSError("the client closed the connection")  # at http.response.start: the body never starts

    with pytest.raises(ClientDisconnect):  # starlette's name for the failed send
        asyncio.run(_response(admitted, rows)(_scope(), receive, send))
    assert rows.ended == [("req-1", "cancelled")]


def test_a_client_that_disconnects_mid_body_releases_the_request_once():
    rows = _Rows()
    admitted = _admitted()
    sent: list = []

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        if len(sent) == 3:  # message_start, then a ping went out; the client is gone at the next
            raise OSError("the client closed the connection")
        sent.append(message["type"])

    with pytest.raises(ClientDisconnect):
        asyncio.run(_response(admitted, rows)(_scope(), receive, send))
    assert sent[:2] == ["http.response.start", "http.response.body"]  # message_start went out
    assert rows.ended == [("req-1", "cancelled")]
