"""The request actor in this process (as the in-process cluster runs it): parity, exit, hot reuse, cancel,
batching, overlap, warm, coalescing. What needs Ray — its actor table, a process killed from outside, the
node's telemetry agent — is in tests/serve/test_request_actor.py.

Each test runs its scenario on an event loop of its own (`asyncio.run`); an actor's stream is pumped by a
task (`LocalStream`), so cancelling it is what Ray's cancel of the call is: a CancelledError in the actor's
`generate`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from actors.actor_config import ActorConfig
from actors.chat import GenerationRequest, build_prompt
from actors.engine import Engine
from actors.layer_loader import load_zqs
from actors.messages import ActorRequest, Completion, Phase, Started, TextChunk
from actors.request_actor import RequestActor
from actors.sampling import SamplingParams
from actors.shard_header import open_zqs
from actors.stream_chunks import chunk_interval_s
from actors.tokenizer import Message
from serve_app.cluster import StreamBusy, StreamFailed
from serve_app.local_cluster import LocalStream

CONFIG = ActorConfig(num_cpus=1, load_threads=1, compute_threads=1)


def _request(zqs, max_tokens=16, seed=7, keep_hot=False, temperature=1.0) -> ActorRequest:
    """Tokenized from the shard file's header alone, as the ingress does."""
    reader, config, tokenizer = open_zqs(zqs)
    reader.close()
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    req = GenerationRequest((Message("user", "Why do queues hurt tail latency?"),), sampling)
    prompt = build_prompt(tokenizer, req, config.max_position_embeddings)
    return ActorRequest(f"req-{seed}-{time.time_ns()}", tuple(prompt), sampling, keep_hot)


def _in_process_tokens(zqs, request: ActorRequest) -> list[int]:
    model, tokenizer = load_zqs(zqs)
    events = Engine(model, tokenizer).generate(list(request.prompt_ids), request.sampling)
    return [e.token_id for e in events if hasattr(e, "token_id")]


class Actor:
    """A RequestActor with what its owner sees: whether it exited, and its calls as streams."""

    def __init__(self, zqs, config: ActorConfig = CONFIG, warm_layers: int | None = None) -> None:
        self.exited = asyncio.Event()
        self.actor = RequestActor(str(zqs), config, warm_layers=warm_layers, name="zq-test-actor",
                                  on_exit=self.exited.set)

    def call(self, request: ActorRequest) -> LocalStream:
        return LocalStream(self.actor.generate(request), lambda _: None)

    async def consume(self, request: ActorRequest) -> tuple[list[TextChunk], Completion]:
        return await _consume(self.call(request))

    async def wait_rows(self, expected: int) -> None:
        for _ in range(500):
            if self.actor.status().num_rows == expected:
                return
            await asyncio.sleep(0.01)
        assert self.actor.status().num_rows == expected

    def close(self) -> None:
        self.actor.close()  # a hot actor is retired as the registry retires it


async def _consume(stream: LocalStream) -> tuple[list[TextChunk], Completion]:
    items = []
    while True:
        try:
            items.append(await stream.next())
        except StopAsyncIteration:
            break
    assert isinstance(items[0], Started) and isinstance(items[-1], Completion)
    assert all(isinstance(i, TextChunk) for i in items[1:-1])
    return items[1:-1], items[-1]


def _token_ids(chunks: list[TextChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


@pytest.mark.parametrize("table", ["raw", "compressed"])
def test_actor_generates_what_the_in_process_runtime_generates_then_exits(tiny_zqs, tiny_zqs_compressed_embeddings,
                                                                          table):
    # A raw table: layer 0 runs on the prompt's rows read alone; compressed: on the whole table.
    zqs = tiny_zqs if table == "raw" else tiny_zqs_compressed_embeddings
    request = _request(zqs)

    async def scenario():
        actor = Actor(zqs)
        chunks, done = await actor.consume(request)
        await asyncio.wait_for(actor.exited.wait(), 10)  # no keep_hot: it exits after its request
        return chunks, done

    chunks, done = asyncio.run(scenario())
    assert _token_ids(chunks) == _in_process_tokens(zqs, request)
    assert done.output_tokens == len(_token_ids(chunks)) == chunks[-1].num_output_tokens == 16
    assert done.stop_reason == "max_tokens" and done.is_cold and 0 <= done.first_layers <= 2
    t = done.timings
    assert t.actor_start <= t.compute_start <= t.first_token <= t.last_token


def test_hot_actor_serves_a_second_request_as_a_fresh_actor_would(tiny_zqs):
    first, second = _request(tiny_zqs, seed=1, keep_hot=True), _request(tiny_zqs, seed=2, keep_hot=True)

    async def scenario():
        actor = Actor(tiny_zqs)
        await actor.consume(first)
        status = actor.actor.status()
        assert status.phase == Phase.IDLE and status.num_layers_resident == status.num_layers
        assert status.num_requests_served == 1
        hot_chunks, hot_done = await actor.consume(second)
        assert not hot_done.is_cold
        fresh_chunks, _ = await Actor(tiny_zqs).consume(ActorRequest("fresh", second.prompt_ids, second.sampling))
        assert _token_ids(hot_chunks) == _token_ids(fresh_chunks)
        phases = [p for p, _ in actor.actor.status().transitions]
        # The second request joins a loaded actor: no cold prefill phase of its own.
        assert phases == ["STARTING", "LOADING", "PREFILL", "DECODE", "IDLE", "DECODE", "IDLE"]
        assert not actor.exited.is_set()
        actor.close()

    asyncio.run(scenario())


def test_cancel_mid_decode_stops_the_row_within_a_step_and_a_hot_actor_stays(tiny_zqs):
    async def scenario():
        actor = Actor(tiny_zqs)
        stream = actor.call(_request(tiny_zqs, max_tokens=1500, temperature=0.0, keep_hot=True))
        for _ in range(3):  # Started and two chunks of tokens
            await stream.next()
        stream.cancel()
        await actor.wait_rows(0)
        # The row left (far fewer than 1500 tokens were made); the loaded actor stays hot for the next one.
        assert actor.actor.status().phase == Phase.IDLE and not actor.exited.is_set()
        _, done = await actor.consume(_request(tiny_zqs, max_tokens=3, keep_hot=True))
        assert done.output_tokens == 3 and not done.is_cold
        actor.close()

    asyncio.run(scenario())


def test_prefill_overlaps_loading(layered_zqs):
    request = _request(layered_zqs, max_tokens=4)
    overlapped = ActorConfig(num_cpus=1, load_threads=1, compute_threads=1, first_layers=1)
    # The benchmark's baseline: nothing computes before every group is resident.
    load_then_compute = replace(overlapped, first_layers=None, is_load_then_compute=True)

    async def scenario():
        return [(await Actor(layered_zqs, c).consume(request))[1] for c in (overlapped, load_then_compute)]

    done, baseline = asyncio.run(scenario())
    t = done.timings
    assert done.first_layers == 1
    assert t.first_layer_resident is not None and t.all_layers_resident is not None
    assert t.first_layer_compute_start < t.all_layers_resident, t
    # Layer 0 ran on the prompt's embedding rows; the table itself came after the layers.
    assert t.embeddings_resident is not None and t.first_layer_compute_start < t.embeddings_resident, t
    t = baseline.timings
    assert baseline.first_layers == 8 and t.all_layers_resident is not None
    assert t.first_layer_compute_start >= t.all_layers_resident >= t.embeddings_resident, t


def test_a_corrupt_embedding_row_fails_the_request_before_any_token(tiny_zqs, tmp_path):
    # The prompt's rows are read unchecked ahead of the table; the table's checksum must
    # still stop the request before a token computed from them leaves the actor.
    from weights_tool.reader import ShardReader

    bad = tmp_path / "bad-row.zqs"
    bad.write_bytes(tiny_zqs.read_bytes())
    request = _request(bad, max_tokens=4, temperature=0.0)
    with ShardReader(bad) as r:
        t = r.tensors["model.embed_tokens.weight"]
        row_bytes = t.size // t.shape[0]
        offset = r.group("embed").frames[t.frame].offset + t.offset + request.prompt_ids[-1] * row_bytes
    data = bytearray(bad.read_bytes())
    data[offset + 1] ^= 0x40
    bad.write_bytes(bytes(data))

    async def scenario():
        actor = Actor(bad)
        stream, items = actor.call(request), []
        with pytest.raises(StreamFailed, match="CRC|checksum|crc"):
            while True:
                items.append(await stream.next())
        assert [type(i) for i in items] == [Started]
        await asyncio.wait_for(actor.exited.wait(), 10)  # it exits on its own, as after any failed request

    asyncio.run(scenario())


async def _loaded_hot_actor(zqs, config: ActorConfig = CONFIG) -> Actor:
    """An actor that has served one request and stays hot (every weight resident)."""
    actor = Actor(zqs, config)
    await actor.consume(_request(zqs, max_tokens=2, keep_hot=True))
    return actor


def test_a_hot_actor_runs_several_requests_at_once_each_as_it_would_alone(tiny_zqs):
    requests = [_request(tiny_zqs, max_tokens=n, seed=s, temperature=t, keep_hot=True)
                for n, s, t in ((40, 1, 0.0), (24, 2, 1.0), (33, 3, 0.7))]
    expected = [_in_process_tokens(tiny_zqs, r) for r in requests]

    async def scenario():
        actor = await _loaded_hot_actor(tiny_zqs)
        weights = actor.actor.status().accounted_bytes
        streams = [actor.call(r) for r in requests]  # all three in flight together
        results = [await _consume(s) for s in streams]
        assert [_token_ids(chunks) for chunks, _ in results] == expected
        assert [done.request_id for _, done in results] == [r.request_id for r in requests]
        status = actor.actor.status()
        assert status.num_rows == 0 and status.phase == Phase.IDLE
        assert status.accounted_bytes == weights  # every row's KV cache was freed
        actor.close()

    asyncio.run(scenario())


def test_cancelling_one_row_leaves_the_others_untouched(tiny_zqs):
    keep = _request(tiny_zqs, max_tokens=64, seed=4, temperature=0.0, keep_hot=True)
    drop = _request(tiny_zqs, max_tokens=1500, seed=5, temperature=0.0, keep_hot=True)

    async def scenario():
        actor = await _loaded_hot_actor(tiny_zqs)
        dropped = actor.call(drop)
        await dropped.next()  # Started: the row is in the batch
        kept = actor.call(keep)
        dropped.cancel()
        chunks, done = await _consume(kept)
        actor.close()
        return chunks, done

    chunks, done = asyncio.run(scenario())
    assert _token_ids(chunks) == _in_process_tokens(tiny_zqs, keep) and done.stop_reason == "max_tokens"


def test_back_to_back_requests_never_find_a_hot_actor_busy(tiny_zqs):
    """The row leaves before its Completion is sent: the next request may follow at once."""

    async def scenario():
        actor = await _loaded_hot_actor(tiny_zqs, replace(CONFIG, max_batch=1))
        for i in range(40):
            _, done = await actor.consume(_request(tiny_zqs, max_tokens=2, seed=i, keep_hot=True))
            assert done.output_tokens == 2
        actor.close()

    asyncio.run(scenario())


def test_a_full_batch_refuses_the_extra_request_at_once(tiny_zqs):
    async def scenario():
        actor = await _loaded_hot_actor(tiny_zqs, replace(CONFIG, max_batch=2))
        running = [actor.call(_request(tiny_zqs, max_tokens=1500, seed=s, keep_hot=True)) for s in (1, 2)]
        for stream in running:
            await stream.next()  # both rows started
        with pytest.raises(StreamBusy, match="already runs 2"):  # the actor's ActorBusyError
            await actor.call(_request(tiny_zqs, max_tokens=4, keep_hot=True)).next()
        for stream in running:
            stream.cancel()
        await actor.wait_rows(0)
        actor.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("warm_layers", [1, 8])
def test_warm_actor_holds_its_first_layers_then_serves_as_a_fresh_actor(layered_zqs, warm_layers):
    request = _request(layered_zqs, seed=11)

    async def scenario():
        warm = Actor(layered_zqs, warm_layers=warm_layers)
        status = await warm.actor.ready(60.0)
        assert status.phase == Phase.WARM and status.num_layers == 8
        await asyncio.sleep(0.3)  # held: nothing more streams in until a request is bound
        assert warm.actor.status().num_layers_resident == warm_layers
        chunks, done = await warm.consume(request)
        assert done.is_cold  # its first request: the rest of the weights streamed in for it
        fresh_chunks, _ = await Actor(layered_zqs).consume(ActorRequest("fresh", request.prompt_ids,
                                                                        request.sampling))
        assert _token_ids(chunks) == _token_ids(fresh_chunks) and len(_token_ids(chunks)) == 16
        # Bound without keep_hot: it exits after its request, as a cold actor does.
        await asyncio.wait_for(warm.exited.wait(), 10)

    asyncio.run(scenario())


def test_a_warm_actor_chooses_its_kernels_on_its_stepping_thread(tiny_zqs, monkeypatch):
    """The warm-up computes: on any thread but the stepping one it would form a second OpenMP team, and every
    later step would pay for it (actors/threads.py)."""
    import threading

    import actors.layers

    threads = []
    choose = actors.layers.warm_up_kernels
    monkeypatch.setattr(actors.layers, "warm_up_kernels",
                        lambda params: (threads.append(threading.current_thread()), choose(params)))

    async def scenario():
        warm = Actor(tiny_zqs, warm_layers=1)
        await warm.actor.ready(60.0)
        assert threads == [warm.actor._runner._thread]
        chunks, _ = await warm.consume(_request(tiny_zqs, max_tokens=4))
        assert len(_token_ids(chunks)) == 4  # and the actor serves after it
        await asyncio.wait_for(warm.exited.wait(), 10)

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_warm_compiled_actor_compiles_before_it_is_ready_and_serves_the_eager_tokens(tiny_zqs):
    config = replace(CONFIG, is_compiled=True, compiled_slots=2, compiled_max_seq_len=96, compute_dtype="float32")
    first, second = (_request(tiny_zqs, max_tokens=24, seed=s, keep_hot=True, temperature=0) for s in (1, 2))
    model, tokenizer = load_zqs(tiny_zqs, compute_dtype="float32")
    eager = [e.token_id for e in Engine(model, tokenizer).generate(list(second.prompt_ids), second.sampling)
             if hasattr(e, "token_id")]

    async def scenario():
        warm = Actor(tiny_zqs, config, warm_layers=1)
        await warm.actor.ready(120.0)
        engine = warm.actor._engine
        assert engine.compiled.num_compiles == 4  # (1, 2 rows) x (64, 96 positions), before any request
        await warm.consume(first)  # bound while the rest loads: its steps wait on weights, eagerly
        before = engine.compiled.num_steps
        chunks, done = await warm.consume(second)
        assert not done.is_cold and _token_ids(chunks) == eager and len(eager) == 24
        assert engine.compiled.num_steps - before == 23  # every step after its prompt's, compiling nothing
        assert engine.compiled.num_compiles == 4 and engine.compiled.num_free == 2
        warm.close()

    asyncio.run(scenario())


def test_a_low_latency_request_gets_every_token_alone_and_a_default_one_gets_them_coalesced(tiny_zqs):
    interval = 0.5

    async def scenario():
        actor = Actor(tiny_zqs, replace(CONFIG, stream_interval_s=interval))
        default = _request(tiny_zqs, max_tokens=16, keep_hot=True, temperature=0)
        coalesced, done = await actor.consume(default)
        # Coalesced: the first token alone, then at most one chunk per interval of the decode, and the last.
        decode_s = done.timings.last_token - done.timings.first_token
        assert len(coalesced) <= 3 + decode_s / interval, (len(coalesced), decode_s)
        fast = replace(_request(tiny_zqs, max_tokens=16, temperature=0), is_low_latency=True)
        chunks, done = await actor.consume(fast)
        assert [len(c.token_ids) for c in chunks] == [1] * done.output_tokens  # each token its own chunk
        assert _token_ids(chunks) == _token_ids(coalesced)  # the same tokens either way
        await asyncio.wait_for(actor.exited.wait(), 10)  # the second asked not to stay hot

    asyncio.run(scenario())


def test_a_rows_last_tokens_leave_as_it_ends_not_at_its_next_chunk_time(tiny_zqs):
    # A chunk interval of an hour: the first token leaves at once (with any sampled meanwhile), every later one with
    # the end. Held back, they would wait out the hour: the answer would not come at all within the test.
    config = replace(CONFIG, stream_interval_s=3600.0)

    async def scenario():
        actor = Actor(tiny_zqs, config)
        return await asyncio.wait_for(actor.consume(_request(tiny_zqs, max_tokens=16, temperature=0)), 300)

    chunks, done = asyncio.run(scenario())
    assert len(chunks) <= 2 and len(_token_ids(chunks)) == done.output_tokens == 16


def test_rows_sharing_an_actor_share_its_chunks_a_second_and_a_low_latency_row_still_gets_every_token(
        tiny_zqs, monkeypatch):
    from actors import request_actor

    rows_seen = []

    def recording(num_rows, *args):
        rows_seen.append(num_rows)
        return chunk_interval_s(num_rows, *args)

    monkeypatch.setattr(request_actor, "chunk_interval_s", recording)
    # No per-row minimum: only the share spaces the chunks, 1 s apart while two rows run, 0.5 s for one.
    config = replace(CONFIG, stream_interval_s=0.0, max_stream_chunks_per_s=2.0, max_stream_interval_s=10.0)

    async def scenario():
        actor = Actor(tiny_zqs, config)
        await actor.consume(_request(tiny_zqs, max_tokens=2, seed=9, keep_hot=True))  # the cold one: loads alone
        pair = [_request(tiny_zqs, max_tokens=16, seed=s, keep_hot=True, temperature=0) for s in (1, 2)]
        both = await asyncio.gather(*(actor.consume(r) for r in pair))
        fast = replace(_request(tiny_zqs, max_tokens=16, seed=3, keep_hot=True, temperature=0), is_low_latency=True)
        alone = await actor.consume(fast)
        actor.close()
        return both, alone

    both, (fast_chunks, fast_done) = asyncio.run(scenario())
    assert 2 in rows_seen  # a row's interval was its share while both ran
    for chunks, done in both:
        assert len(_token_ids(chunks)) == done.output_tokens == 16
        # The first token alone, then at most one chunk per 0.5 s of its decode (1 s while both ran), and the last.
        decode_s = done.timings.last_token - done.timings.first_token
        assert len(chunks) <= 3 + decode_s / 0.5, (len(chunks), decode_s)
    assert [len(c.token_ids) for c in fast_chunks] == [1] * fast_done.output_tokens == [1] * 16


@pytest.fixture(scope="module")
def bf16_zqs(tmp_path_factory):
    """The `tiny` model in bf16: the dtype whose linear weights an actor packs on a CPU."""
    from weights_tool.pack import pack
    from weights_tool.synth import synthesize

    hf = synthesize("tiny", tmp_path_factory.mktemp("tiny-bf16-hf"), dtype="bfloat16", seed=3)
    return pack(hf, tmp_path_factory.mktemp("tiny-bf16-zqs") / "tiny-bf16.zqs")


def test_a_loaded_actor_packs_its_weights_and_serves_the_plain_runtimes_tokens(bf16_zqs):
    from actors.layers import Linear
    from actors.packed_weights import is_packable

    if not is_packable(torch.zeros(2, 2, dtype=torch.bfloat16)):
        pytest.skip("this torch has no oneDNN linear on this CPU")
    requests = [_request(bf16_zqs, max_tokens=24, seed=s, temperature=0.0, keep_hot=True) for s in (1, 2)]
    expected = [_in_process_tokens(bf16_zqs, r) for r in requests]  # load_zqs: plain weights

    async def scenario():
        actor = Actor(bf16_zqs, CONFIG)
        first, _ = await actor.consume(requests[0])  # computed while the weights were loading, plain
        linears = [m for m in actor.actor._model.modules() if isinstance(m, Linear)]
        for _ in range(600):  # packing follows the load on a thread of its own; the swap needs a step boundary
            if all(m.packed_weight is not None for m in linears):
                break
            await asyncio.sleep(0.05)
        assert all(m.packed_weight is not None for m in linears)
        second, _ = await actor.consume(requests[1])
        actor.close()
        return [_token_ids(first), _token_ids(second)]

    assert asyncio.run(scenario()) == expected


def test_a_warm_actor_holding_every_layer_is_packed_when_ready(bf16_zqs):
    """Its weights are whole before any request: packed before `ready()` returns, its first request computes with
    the packed kernels (the same tokens as the plain runtime's) and no packing thread runs beside it."""
    from actors.layers import Linear
    from actors.packed_weights import is_packable

    if not is_packable(torch.zeros(2, 2, dtype=torch.bfloat16)):
        pytest.skip("this torch has no oneDNN linear on this CPU")
    request = _request(bf16_zqs, max_tokens=24, seed=4, temperature=0.0)
    expected = _in_process_tokens(bf16_zqs, request)
    num_layers = open_zqs(bf16_zqs)[1].num_layers

    async def scenario():
        warm = Actor(bf16_zqs, CONFIG, warm_layers=num_layers)
        await warm.actor.ready(60.0)
        linears = [m for m in warm.actor._model.modules() if isinstance(m, Linear)]
        assert linears and all(m.packed_weight is not None for m in linears)
        chunks, done = await warm.consume(request)
        assert done.is_cold  # still its first request
        return _token_ids(chunks)

    assert asyncio.run(scenario()) == expected
