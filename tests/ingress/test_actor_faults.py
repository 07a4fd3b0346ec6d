"""A request actor that dies, stalls or is lost, seen over real HTTP (over the in-process cluster, where a
death is the actor ending itself; the port's contract test shows Ray's process deaths end the same way):
each request ends one of the documented ways, with its request id, within a stated bound, and leaves
nothing behind.

A death the client never saw (any non-streamed request; a stream before its first event) is
placed again, and a death that keeps happening is a 503 with retry-after, never a 500.
"""

from __future__ import annotations

import httpx
import pytest

from serve_app.sse import decode_events
from tests.ingress.local import assert_nothing_left, serve_locally
from tests.reliability import harness
from tests.reliability.faults import FaultyActor
from tests.reliability.harness import assert_documented_error, body, call

TOKEN_TIMEOUT_S = 1.0
START_TIMEOUT_S = 4.0  # a cold actor's first token: the tiny model loads in-process well within it
# A request that needs up to three cold starts of the tiny model on a busy 2-core CI machine.
BOUND_S = 90.0


class Faulty(FaultyActor):
    SLOW_LOAD_S = 2.0  # between the token deadline and the start deadline
# The ingress's own thread pools (actor placement 4, parsing 2) may grow once to their size; beyond that
# a thread per fault would be a leak.
MAX_POOL_THREADS = 6


@pytest.fixture(scope="module")
def server(tiny_zqs):
    local = serve_locally(tiny_zqs, Faulty, token_timeout_s=TOKEN_TIMEOUT_S, start_timeout_s=START_TIMEOUT_S,
                          policy={"max_hot_short_actors": 0})  # every request cold: the start deadline applies
    assert call(local.base, body()).is_complete  # the happy path runs real, and the pools have their threads
    yield local
    local.stop()


@pytest.fixture(scope="module")
def zq(server) -> str:
    return server.base


@pytest.fixture
def threads(zq):
    before = harness.health(zq)["replica"]["threads"]
    yield
    assert harness.health(zq)["replica"]["threads"] <= before + MAX_POOL_THREADS


@pytest.mark.parametrize("kind", ["die-before-start", "die-mid-load", "die-mid-decode"])
def test_a_non_streamed_request_whose_actor_dies_is_placed_again_and_completes(zq, server, tmp_path,
                                                                                threads, kind):
    ending = call(zq, body(f"fault:{kind} once:{tmp_path / 'died'}", max_tokens=12))
    assert (tmp_path / "died").exists()  # the fault did happen
    assert ending.is_complete and ending.text, ending
    assert_nothing_left(server)


@pytest.mark.parametrize("kind", ["die-mid-load", "die-mid-decode"])
def test_a_stream_whose_actor_dies_after_its_first_event_ends_with_an_overloaded_error_event(
        zq, server, tmp_path, threads, kind):
    seen = tmp_path / "seen"  # die-mid-load waits for it: the death comes after the client has the first event
    payload = body(f"fault:{kind} once:{tmp_path / 'died'} after:{seen}", max_tokens=12, stream=True)
    with httpx.stream("POST", f"{zq}/v1/messages", json=payload, timeout=BOUND_S) as r:
        assert r.status_code == 200
        raw = b""
        for chunk in r.iter_bytes():
            raw += chunk
            if b"message_start" in raw:
                seen.touch()
        request_id = r.headers["request-id"]
    events = decode_events(raw)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "error", events  # nothing after it
    assert events[-1]["error"]["type"] == "overloaded_error" and events[-1]["request_id"] == request_id
    assert_nothing_left(server)


def test_a_stream_whose_actor_died_before_starting_is_placed_again(zq, server, tmp_path, threads):
    ending = call(zq, body(f"fault:die-before-start once:{tmp_path / 'died'}", max_tokens=12, stream=True))
    assert (tmp_path / "died").exists()
    assert ending.is_complete and ending.text, ending
    assert_nothing_left(server)


def test_an_actor_that_dies_every_time_is_a_503_with_retry_after_not_a_500(zq, server, threads):
    ending = call(zq, body("fault:die-mid-decode", max_tokens=12))
    assert_documented_error(ending, 503, "overloaded_error")
    assert_nothing_left(server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stalled_actor_is_a_timeout_error_after_the_token_deadline_and_is_killed(zq, server, threads,
                                                                                    stream):
    ending = call(zq, body("fault:stall", max_tokens=12, stream=stream))
    if stream:
        assert ending.events[0]["type"] == "message_start"
        assert_documented_error(ending, 200, "timeout_error")
    else:
        assert_documented_error(ending, 504, "timeout_error")
    # The deadline that fired is the cold actor's start_timeout_s.
    assert ending.seconds >= START_TIMEOUT_S  # the deadline, not an early end
    assert_nothing_left(server)  # the stalled actor is forgotten and killed


def test_a_cold_load_slower_than_the_token_deadline_completes_within_the_start_deadline(zq, server):
    assert START_TIMEOUT_S > Faulty.SLOW_LOAD_S > TOKEN_TIMEOUT_S  # the token deadline alone would have made it a 504
    ending = call(zq, body("fault:slow-load", max_tokens=8))
    assert ending.is_complete, ending
    assert ending.seconds >= Faulty.SLOW_LOAD_S  # it waited for the load, as the start deadline allows
    assert_nothing_left(server)
