"""Concurrent streams batched on one actor: each stream's events follow the documented SSE order, and each
carries its own answer — never a token of another request's.

Concurrency is made real, not assumed. Every prompt names two files: `hold:<path>` (this module's
`HeldActor`) keeps a row out of the actor's batch until the file exists, and `gate:<path>` (FaultyActor)
holds its Completion until that one does. So all N rows are admitted onto one actor before any of them
is computed (the registry shows them), they enter the engine's batch together, and all N relays are open
at once until the end, pinging while their Completions wait. Each prompt's expected text is its greedy
answer computed alone, with the very same prompt text (both files existing then, so nothing waits).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.ingress.local import MODEL, assert_nothing_left, serve_locally
from tests.reliability import harness
from tests.reliability.faults import FaultyActor
from tests.reliability.harness import call
from tests.serve.waiting import wait_for

N = 6  # concurrent streams, all rows of one batch (of 12 candidate prompts, the first N with distinct answers)
MAX_BATCH = 8  # >= N: every stream joins the one hot actor's batch
MAX_TOKENS = 16
PING_INTERVAL_S = 0.5  # short, so a stream whose Completion is held shows pings before its end
HOLD_COMPLETION_S = 1.5  # >= 2 ping intervals: every stream pings at least once while held
# How long the concurrent streams' clients wait before calling it a hang (the client's own timeout):
# admission of N rows, the hold, N x 16 tokens in one batch, HOLD_COMPLETION_S, on a slow machine.
CONCURRENT_BOUND_S = 60.0

_HOLD = re.compile(r"hold:(\S+)")


class HeldActor(FaultyActor):
    """A row waits before it enters the batch until its `hold:<path>` exists (then FaultyActor's faults and gate)."""

    async def generate(self, request):
        hold = _HOLD.search(self._streamed.tokenizer.decode(request.prompt_ids))
        while hold is not None and not Path(hold.group(1)).exists():
            await asyncio.sleep(0.02)
        async for item in super().generate(request):
            yield item


@pytest.fixture(scope="module")
def zq(tiny_zqs):
    server = serve_locally(tiny_zqs, HeldActor, ping_interval_s=PING_INTERVAL_S,
                           policy={"max_hot_short_actors": 1, "max_batch": MAX_BATCH})
    ending = call(server.base, harness.body(max_tokens=2))  # the hot actor every later request finds
    assert ending.is_complete, ending
    yield server
    server.stop()


def _payload(text: str, *, stream: bool) -> dict:
    return {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": text}]}


def _alone(base: str, text: str) -> dict:
    """The whole Message for `text`, sent alone (greedy: the answer any batch must reproduce)."""
    r = httpx.post(f"{base}/v1/messages", json=_payload(text, stream=False), timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-tier"] == "hot", r.headers  # the fixture's actor: no cold start here
    return r.json()


def assert_documented_order(events: list[dict]) -> None:
    """serve_app/sse.py's contract: message_start, content_block_start(0), (content_block_delta | ping)*,
    content_block_stop(0), message_delta, message_stop — and nothing after it."""
    types = [e["type"] for e in events]
    assert types[:2] == ["message_start", "content_block_start"], types
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"], types
    assert set(types[2:-3]) <= {"content_block_delta", "ping"}, types
    start = events[0]["message"]
    assert (start["role"], start["model"], start["content"], start["stop_reason"]) == ("assistant", MODEL, [], None)
    assert events[1]["index"] == 0 and events[1]["content_block"] == {"type": "text", "text": ""}
    assert all(e["index"] == 0 and e["delta"]["type"] == "text_delta" and e["delta"]["text"]
               for e in events if e["type"] == "content_block_delta"), events
    assert events[-3]["index"] == 0


def test_concurrent_streams_batched_on_one_actor_keep_the_event_order_and_their_own_text(zq, tmp_path):
    server, zq = zq, zq.base
    hold, gate = tmp_path / "hold", tmp_path / "gate"
    candidates = [f"{topic} hold:{hold} gate:{gate} thanks" for topic in
                  ["the sea", "seven green apples", "why is the sky blue", "count to ten", "a poem about rust",
                   "zebra quartz jumps", "tell me of ships", "one two three four five", "Bonjour, ça va ?",
                   "the quick brown fox", "42 * 17 = ?", "list the planets"]]

    # Each prompt's answer alone, the files existing so that nothing waits. The answers of a random-weight
    # model depend on the whole prompt, the files' paths included (they change from run to run), and two
    # prompts may share one: N prompts whose answers are distinct are kept, so that a crossed answer shows.
    hold.touch()
    gate.touch()
    prompts, alone = [], []
    for prompt in candidates:
        message = _alone(zq, prompt)
        text = message["content"][0]["text"]
        if text and text not in (m["content"][0]["text"] for m in alone):
            prompts.append(prompt)
            alone.append(message)
        if len(prompts) == N:
            break
    expected = [m["content"][0]["text"] for m in alone]
    assert len(set(expected)) == N, expected
    hold.unlink()
    gate.unlink()
    assert_nothing_left(server)

    endings: list[harness.Ending | None] = [None] * N

    def stream(k: int) -> None:
        endings[k] = call(zq, _payload(prompts[k], stream=True), timeout=CONCURRENT_BOUND_S + 30)

    threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(N)]
    for t in threads:
        t.start()

    # All N rows admitted onto the one hot actor, none of them computed yet. Rows that run a request: a lease
    # exchange may grant the replica a spare row on the same actor meanwhile (leases.headroom_rows), booked
    # with no request in it (num_tokens 0).
    def requests(actor) -> int:
        return sum(1 for r in actor.rows if r.num_tokens)

    def batched() -> list:
        return [a for a in server.books().actors if requests(a)]

    wait_for(lambda: sum(requests(a) for a in batched()) == N, 30, f"{N} rows admitted")
    running = batched()
    assert len(running) == 1 and requests(running[0]) == N and running[0].state == "busy", running
    name = running[0].name

    def status():
        return server.on_loop(lambda: server.cluster.actors[name].actor.status())

    before = status()
    assert before.num_rows == 0  # held out of the engine until now

    # Into the batch together; every row decodes (the actor counts it served as it makes its Completion)
    # and then holds its Completion, still listed as running.
    hold.touch()

    def decoded() -> bool:
        now = status()
        return now.num_requests_served == before.num_requests_served + N and now.num_rows == 0

    wait_for(decoded, 30, "every row decoded, its Completion held")
    assert sum(requests(a) for a in batched()) == N
    time.sleep(HOLD_COMPLETION_S)  # the relays ping meanwhile
    gate.touch()
    for t in threads:
        t.join(CONCURRENT_BOUND_S + 40)

    for k, ending in enumerate(endings):
        assert ending is not None and ending.is_complete, (k, ending)
        assert ending.request_id and ending.error_type is None, ending
        assert_documented_order(ending.events)
        assert any(e["type"] == "ping" for e in ending.events), ending.events  # held: it pinged
        assert ending.text == expected[k], (k, ending.text, expected)  # its own answer, no other's
        finish = next(e for e in ending.events if e["type"] == "message_delta")
        assert finish["delta"]["stop_reason"] == alone[k]["stop_reason"]
        assert finish["usage"]["output_tokens"] == alone[k]["usage"]["output_tokens"]
        assert ending.events[0]["message"]["usage"]["input_tokens"] == alone[k]["usage"]["input_tokens"]
    assert len({e.request_id for e in endings}) == N
    assert_nothing_left(server)
