"""Bad input over real HTTP (uvicorn, as Serve's proxy runs it, over the in-process cluster): oversized bodies, huge header sets, deep nesting, out-of-range and malformed
parameters. Each is refused with its documented status and error type, carrying its request id, within a
stated bound, before any work, and leaves no reservation, actor or thread behind.

Requests go through `http.client` or a raw socket, never httpx: paths, headers and bodies reach the server
byte for byte as written here (no normalisation, no automatic content type), and a body can stop halfway.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest

from tests.ingress.local import MODEL, LocalServer, assert_nothing_left, serve_locally
from tests.reliability.harness import Ending, assert_documented_error

HOST = "127.0.0.1"
KEY_ENV = "ZQ_BAD_INPUT_TEST_KEY"
KEY = "zq-bad-input-key-2b7e19"
# Small, so that an oversized body is cheap to send, yet above what the cases that must reach validation
# need: 10,001 minimal messages (~360 KB) and 300,000 `[` must be parsed, not refused for their size.
MAX_BODY_BYTES = 512 << 10
# The bounds only tell an answer from a hang: a refusal makes no registry or actor call (the proxy hop, a
# parse and a JSON answer); bodies of a few hundred KB are parsed on a thread; an accepted request on the
# tiny model includes a cold start. Each bound is far above what the slowest CI machine needs.
REFUSAL_BOUND_S = 20.0
BIG_BODY_BOUND_S = 60.0
SERVED_BOUND_S = 120.0
# The ingress's own pools (actor placement 4, parsing 2) may grow once to their size after the warm-up;
# beyond that a thread per bad request would be a leak.
MAX_POOL_THREADS = 6


@dataclass
class Answer(Ending):
    """An `Ending`, with what the body said."""

    message: str | None = None
    data: Any = None
    headers: dict[str, str] | None = None


def _answer(status: int, headers: dict[str, str], raw: bytes, seconds: float) -> Answer:
    data = json.loads(raw) if raw and headers.get("content-type", "").startswith("application/json") else None
    error = data.get("error") if isinstance(data, dict) and data.get("type") == "error" else None
    return Answer(status, headers.get("request-id"), error and error["type"], data and data.get("request_id"),
                  [], raw.decode("utf-8", "replace") if data is None else "", seconds,
                  message=error and error["message"], data=data, headers=headers)


@dataclass(frozen=True)
class Client:
    """Requests to one deployment on its own connections, paths and headers exactly as given."""

    port: int
    key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"x-api-key": self.key}

    def send(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
             timeout: float = SERVED_BOUND_S) -> Answer:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        t0 = time.monotonic()
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            raw = r.read()
            return _answer(r.status, {k.lower(): v for k, v in r.getheaders()}, raw, time.monotonic() - t0)
        finally:
            conn.close()

    def post(self, path: str, payload: Any, headers: dict[str, str] | None = None, **kw) -> Answer:
        """JSON (or raw bytes) with the key and a JSON content type, unless `headers` say otherwise."""
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        headers = {"content-type": "application/json", **self.auth, **(headers or {})}
        return self.send("POST", path, body, headers, **kw)

    def send_partly(self, head: bytes, parts: Iterable[bytes]) -> Answer:
        """Send the head and some of a body, then read the answer with the rest of the body never sent."""
        with socket.create_connection((HOST, self.port), timeout=REFUSAL_BOUND_S) as s:
            t0 = time.monotonic()
            s.sendall(head)
            for part in parts:
                s.sendall(part)
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = s.recv(65536)
                assert chunk, f"the server closed the connection without an answer: {buf!r}"
                buf += chunk
            head_bytes, _, raw = buf.partition(b"\r\n\r\n")
            status_line, *lines = head_bytes.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
            while len(raw) < int(headers.get("content-length", 0)):
                raw += s.recv(65536)
            return _answer(int(status_line.split()[1]), headers, raw, time.monotonic() - t0)

    def health(self) -> dict:
        answer = self.send("GET", "/health", headers=self.auth)
        assert answer.status == 200, answer
        return answer.data


def messages_body(**fields: Any) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]} | fields


@dataclass(frozen=True)
class Deployed:
    client: Client
    threads: int  # the replica's threads once the happy path has run
    server: LocalServer


@pytest.fixture(scope="module")
def zq(tiny_zqs):
    with pytest.MonkeyPatch.context() as env:
        # Before the app is built: `ingress_config` resolves `api_key_env` then.
        env.setenv(KEY_ENV, KEY)
        server = serve_locally(tiny_zqs, api_key_env=KEY_ENV, max_body_bytes=MAX_BODY_BYTES)
    try:
        client = Client(server.port, KEY)
        warm = client.post("/v1/messages", messages_body())
        assert warm.status == 200, warm  # the happy path runs, and the pools have their threads
        yield Deployed(client, client.health()["replica"]["threads"], server)
    finally:
        server.stop()


def assert_clean(zq: Deployed) -> None:
    """No reservation, busy actor or orphan left, and no thread beyond the pools' own."""
    assert_nothing_left(zq.server)
    assert zq.client.health()["replica"]["threads"] <= zq.threads + MAX_POOL_THREADS


def assert_refused(answer: Answer, status: int, error_type: str, bound_s: float = REFUSAL_BOUND_S,
                   naming: str | None = None) -> None:
    assert_documented_error(answer, status, error_type)
    assert answer.seconds < bound_s, answer
    if naming is not None:
        assert naming.lower() in answer.message.lower(), answer


ROUTES_WITH_BODIES = ["/v1/messages", "/v1/messages/count_tokens"]


# ---- 1. oversized bodies -------------------------------------------------------------------------------

def _head(path: str, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"host: {HOST}", "content-type: application/json", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.parametrize("path", ROUTES_WITH_BODIES)
def test_a_declared_content_length_over_the_limit_is_a_413_before_the_body_is_sent(zq, path):
    # 100 MB declared, 1 KiB sent: the answer comes while the client still holds the rest.
    head = _head(path, f"x-api-key: {KEY}", f"content-length: {100 << 20}")
    answer = zq.client.send_partly(head, [b"{" + b" " * 1023])
    assert_refused(answer, 413, "request_too_large", naming=str(MAX_BODY_BYTES))
    assert_clean(zq)


@pytest.mark.parametrize("path", ROUTES_WITH_BODIES)
def test_a_chunked_body_growing_past_the_limit_is_a_413_before_it_ends(zq, path):
    # No Content-Length: 16 KiB chunks until just past the limit, and no final chunk ever. Sending little
    # more than the limit keeps every byte in flight within the sockets' buffers, whenever the server stops.
    chunk = b"a" * (16 << 10)
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (MAX_BODY_BYTES // len(chunk) + 1)
    answer = zq.client.send_partly(_head(path, f"x-api-key: {KEY}", "transfer-encoding: chunked"), parts)
    assert_refused(answer, 413, "request_too_large", naming=str(MAX_BODY_BYTES))
    assert_clean(zq)


def test_a_content_length_beyond_any_integer_is_refused_never_a_500(zq):
    # The HTTP parser refuses it itself (a plain-text 400 from uvicorn), before the ingress sees it.
    head = _head("/v1/messages", f"x-api-key: {KEY}", "content-length: " + "9" * 30)
    answer = zq.client.send_partly(head, [b"{"])
    assert answer.status in (400, 413), answer
    if answer.error_type is not None:
        assert_refused(answer, 413, "request_too_large")
    assert answer.seconds < REFUSAL_BOUND_S
    assert_clean(zq)


def test_an_oversized_body_without_the_key_is_a_401_before_its_size_is_considered(zq):
    answer = zq.client.send_partly(_head("/v1/messages", f"content-length: {100 << 20}"), [b"{"])
    assert_refused(answer, 401, "authentication_error")
    assert_clean(zq)


# ---- 2. huge header sets -------------------------------------------------------------------------------

HUGE_HEADERS = {
    "200-headers-of-1KiB": {f"x-pad-{i}": "a" * 1024 for i in range(200)},
    "one-header-of-64KiB": {"x-pad": "a" * (64 << 10)},
}


@pytest.mark.parametrize("name", HUGE_HEADERS)
def test_a_huge_header_set_is_a_413_before_authentication(zq, name):
    """Serve's HTTP proxy (uvicorn on httptools, Ray 2.60) sets no limit on headers, so the ingress
    refuses them itself, first, key or no key."""
    # The socket's timeout is the bound: a hang would raise.
    with_key = zq.client.send("GET", "/v1/models", None, {**HUGE_HEADERS[name], **zq.client.auth}, REFUSAL_BOUND_S)
    without = zq.client.send("GET", "/v1/models", None, HUGE_HEADERS[name], REFUSAL_BOUND_S)
    for answer in (with_key, without):
        assert_documented_error(answer, 413, "request_too_large")
        assert answer.seconds < REFUSAL_BOUND_S, answer
    assert_clean(zq)


# ---- 3. nested JSON ------------------------------------------------------------------------------------

NESTINGS = {
    "100k-brackets": b"[" * 100_000,  # parsed on the event loop (< OFF_LOOP_BODY_BYTES)
    "300k-brackets": b"[" * 300_000,  # parsed on a thread
    "100k-objects": b'{"a":' * 100_000,
}


@pytest.mark.parametrize("path", ROUTES_WITH_BODIES)
@pytest.mark.parametrize("name", NESTINGS)
def test_json_nested_too_deeply_is_a_400(zq, path, name):
    answer = zq.client.post(path, NESTINGS[name])
    assert_refused(answer, 400, "invalid_request_error", naming="nested too deeply")
    assert_clean(zq)


def test_deep_but_parseable_nesting_in_an_ignored_field_is_served_or_refused_never_a_500(zq):
    # 500 levels: within the JSON decoder's recursion limit, in `cache_control`, which takes any JSON value.
    deep = json.loads("[" * 500 + "]" * 500)
    answer = zq.client.post("/v1/messages", messages_body(cache_control={"deep": deep}))
    assert answer.status in (200, 400), answer
    if answer.status == 400:
        assert_refused(answer, 400, "invalid_request_error", bound_s=SERVED_BOUND_S)
    assert answer.seconds < SERVED_BOUND_S
    assert_clean(zq)


# ---- 4. huge max_tokens --------------------------------------------------------------------------------

@pytest.mark.parametrize("max_tokens", [2**20, 2**20 + 1, 2**31, 2**63, 10**12, 10**100, 0, -1, 1.5, True])
def test_max_tokens_out_of_range_is_a_400_naming_it(zq, max_tokens):
    # 2**20 passes the schema's cap and is refused against the model's 2048-token window, naming it too.
    answer = zq.client.post("/v1/messages", messages_body(max_tokens=max_tokens))
    assert_refused(answer, 400, "invalid_request_error", naming="max_tokens")
    assert_clean(zq)


# ---- 5. many messages ----------------------------------------------------------------------------------

def _turns(n: int) -> list[dict]:
    return [{"role": ("user", "assistant")[i % 2], "content": "x"} for i in range(n)]


def test_more_messages_than_the_cap_is_a_400(zq):
    from serve_app.api import MAX_MESSAGES

    for path, extra in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
        answer = zq.client.post(path, {"model": MODEL, "messages": _turns(MAX_MESSAGES + 1), **extra})
        assert_refused(answer, 400, "invalid_request_error", bound_s=BIG_BODY_BOUND_S, naming="messages")
    assert_clean(zq)


def test_messages_just_under_the_cap_beyond_the_context_window_are_a_400_naming_it(zq):
    from serve_app.api import MAX_MESSAGES

    turns = _turns(MAX_MESSAGES - 1)  # odd, so the last is the user's (not a prefill)
    answer = zq.client.post("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": turns})
    assert_refused(answer, 400, "invalid_request_error", bound_s=BIG_BODY_BOUND_S, naming="context window")
    assert_clean(zq)


# ---- 6. bad parameters ---------------------------------------------------------------------------------

def _one_turn(content: Any) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


BAD_FIELDS = {  # name: (fields over a valid body, what the 400's message names)
    "temperature-below-0": ({"temperature": -0.1}, "temperature"),
    "temperature-above-1": ({"temperature": 1.01}, "temperature"),
    "temperature-a-string": ({"temperature": "0.5"}, "temperature"),
    "top_p-0": ({"top_p": 0}, "top_p"),
    "top_p-negative": ({"top_p": -0.5}, "top_p"),
    "top_p-above-1": ({"top_p": 1.5}, "top_p"),
    "top_k-negative": ({"top_k": -1}, "top_k"),
    "top_k-0": ({"top_k": 0}, "top_k"),
    "top_k-a-float": ({"top_k": 2.5}, "top_k"),
    "model-not-a-string": ({"model": 7}, "model"),
    "model-too-long": ({"model": "m" * 257}, "model"),
    "empty-messages": ({"messages": []}, "messages"),
    "messages-not-a-list": ({"messages": {"role": "user", "content": "hi"}}, "messages"),
    "first-turn-assistant": ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages.0.role"),
    "two-user-turns": ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
                       "messages.1.role"),
    "system-role-in-messages": ({"messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    "prefill-ending-in-whitespace": ({"messages": [*_turns(1), {"role": "assistant", "content": "x "}]}, "whitespace"),
    "content-a-number": (_one_turn(42), "messages.0.content"),
    "content-null": (_one_turn(None), "messages.0.content"),
    "content-an-object": (_one_turn({"type": "text", "text": "hi"}), "messages.0.content"),
    "content-empty-list": (_one_turn([]), "messages.0.content"),
    "content-whitespace": (_one_turn("  "), "messages.0.content"),
    "content-block-a-string": (_one_turn(["hi"]), "messages.0.content"),
    "content-block-an-image": (_one_turn([{"type": "image", "source": {"type": "base64", "data": "AA=="}}]),
                               "messages.0.content"),
    "content-block-text-a-number": (_one_turn([{"type": "text", "text": 5}]), "messages.0.content"),
    "stream-a-string": ({"stream": "true"}, "stream"),
    "stream-a-number": ({"stream": 1}, "stream"),
    "stream-null": ({"stream": None}, "stream"),
    "system-a-number": ({"system": 5}, "system"),
    "stop_sequences-a-string": ({"stop_sequences": "END"}, "stop_sequences"),
    "too-many-stop_sequences": ({"stop_sequences": [f"s{i}" for i in range(17)]}, "stop_sequences"),
    "stop_sequence-too-long": ({"stop_sequences": ["s" * 257]}, "stop_sequences"),
    "seed-negative": ({"seed": -1}, "seed"),
    "seed-beyond-64-bits": ({"seed": 2**64}, "seed"),
    "metadata-user_id-too-long": ({"metadata": {"user_id": "u" * 257}}, "metadata.user_id"),
    "service_tier-unknown": ({"service_tier": "priority"}, "service_tier"),
    "unknown-field": ({"frequency_penalty": 0.5}, "frequency_penalty"),
    "tools": ({"tools": [{"name": "t", "input_schema": {"type": "object"}}]}, "tools"),
}


@pytest.mark.parametrize("name", BAD_FIELDS)
def test_a_bad_parameter_is_a_400_naming_it(zq, name):
    fields, naming = BAD_FIELDS[name]
    answer = zq.client.post("/v1/messages", messages_body(**fields))
    assert_refused(answer, 400, "invalid_request_error", naming=naming)
    assert_clean(zq)


def test_an_unknown_model_is_a_404(zq):
    answer = zq.client.post("/v1/messages", messages_body(model="no-such-model"))
    assert_refused(answer, 404, "not_found_error", naming="no-such-model")
    assert_clean(zq)


@pytest.mark.parametrize(("fields", "status", "error_type", "naming"), [
    ({"model": "no-such-model"}, 404, "not_found_error", "no-such-model"),
    ({"max_tokens": 4}, 400, "invalid_request_error", "max_tokens"),  # not a field of count_tokens
    ({"messages": []}, 400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "user", "content": 42}]}, 400, "invalid_request_error", "messages.0.content"),
], ids=["unknown-model", "max_tokens", "empty-messages", "content-a-number"])
def test_a_bad_parameter_to_count_tokens_is_its_documented_4xx(zq, fields, status, error_type,
                                                               naming):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} | fields
    answer = zq.client.post("/v1/messages/count_tokens", body)
    assert_refused(answer, status, error_type, naming=naming)
    assert_clean(zq)


MODELS_QUERIES = {
    "limit-0": "limit=0", "limit-1001": "limit=1001", "limit-negative": "limit=-1", "limit-abc": "limit=abc",
    "limit-superscript-2": "limit=%C2%B2",  # str.isdigit() says yes, int() says no
    "limit-4301-digits": "limit=" + "0" * 4300 + "1",  # int() refuses more than 4300 digits (ValueError)
    "after_id-unknown": "after_id=nope", "before_id-unknown": "before_id=nope",
    "after_id-and-before_id": f"after_id={MODEL}&before_id={MODEL}",
}


@pytest.mark.parametrize("name", MODELS_QUERIES)
def test_a_bad_models_query_is_a_400(zq, name):
    answer = zq.client.send("GET", f"/v1/models?{MODELS_QUERIES[name]}", headers=zq.client.auth)
    assert_refused(answer, 400, "invalid_request_error")
    assert_clean(zq)


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "0", "-1", "86401", "1e400", "1" * 40, ""])
@pytest.mark.parametrize("header", ["x-zq-ttft-target-s", "x-zq-total-target-s", "x-zq-tpot-target-s"])
def test_a_bad_latency_target_header_is_a_400_naming_it(zq, header, value):
    answer = zq.client.post("/v1/messages", messages_body(), headers={header: value})
    assert_refused(answer, 400, "invalid_request_error", naming=header)
    assert_clean(zq)


def valid_body(path: str) -> dict:
    """A body the route serves; the cases below break one thing in it."""
    body = messages_body()
    return body if path == "/v1/messages" else {k: v for k, v in body.items() if k != "max_tokens"}


def _with_text(text: str, field: str = "messages") -> Callable[[dict], bytes]:
    def make(body: dict) -> bytes:  # json.dumps escapes a lone surrogate: valid JSON text
        value = [{"role": "user", "content": text}] if field == "messages" else text
        return json.dumps(body | {field: value}).encode()
    return make


BAD_BODIES = {  # name: (the valid body -> the bad one, what the message says, if anything in particular)
    "truncated": (lambda b: json.dumps(b).encode()[:-10], "not valid JSON"),
    "trailing-garbage": (lambda b: json.dumps(b).encode() + b"}", "not valid JSON"),
    "single-quotes": (lambda b: b"{'model': 'zq-tiny'}", "not valid JSON"),
    "nan": (lambda b: json.dumps(b).encode()[:-1] + b', "temperature": NaN}', "not valid JSON"),
    "empty": (lambda b: b"", "not valid JSON"),
    "not-utf8": (lambda b: b'{"model": "\xff\xfe"}', "not valid UTF-8"),
    "an-array": (lambda b: b"[1, 2]", "must be a JSON object"),
    "a-string": (lambda b: b'"hi"', "must be a JSON object"),
    "null": (lambda b: b"null", "must be a JSON object"),
    # Python's int() refuses more than 4300 digits with a plain ValueError, not a JSONDecodeError.
    "a-5001-digit-number": (lambda b: b'{"model": 1' + b"0" * 5000 + b"}", None),
    # Valid JSON text, but no Unicode string: the tokenizer cannot take it.
    "lone-surrogate-in-content": (_with_text("a\ud800b"), None),
    "lone-surrogate-in-system": (_with_text("\udfff", "system"), None),
}


@pytest.mark.parametrize("path", ROUTES_WITH_BODIES)
@pytest.mark.parametrize("name", BAD_BODIES)
def test_a_malformed_body_is_a_400(zq, path, name):
    make, naming = BAD_BODIES[name]
    answer = zq.client.post(path, make(valid_body(path)))
    assert_refused(answer, 400, "invalid_request_error", naming=naming)
    assert_clean(zq)


@pytest.mark.parametrize("content_type", [
    "application/x-www-form-urlencoded",  # what `curl -d` sends
    "text/plain",  # what a browser sends cross-origin without a preflight
    "multipart/form-data; boundary=zq",
])
def test_a_json_body_under_a_content_type_other_than_json_is_a_400(zq, content_type):
    # The body is valid JSON: only its declared type is wrong. (A form-encoded body would be refused as
    # invalid JSON anyway; this checks that the content type itself is.)
    answer = zq.client.post("/v1/messages", messages_body(), headers={"content-type": content_type})
    assert_refused(answer, 400, "invalid_request_error", naming="content-type")
    assert_clean(zq)


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", None])
def test_a_json_content_type_or_none_is_served(zq, content_type):
    headers = zq.client.auth if content_type is None else {**zq.client.auth, "content-type": content_type}
    answer = zq.client.send("POST", "/v1/messages", json.dumps(messages_body()).encode(), headers)
    assert answer.status == 200 and answer.data["type"] == "message", answer
    assert answer.seconds < SERVED_BOUND_S
    assert_clean(zq)
