"""Per-request actors on a real local Ray cluster: parity, exit, hot reuse, cancel, kill, overlap."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from actors.actor_config import ActorConfig
from actors.actor_names import new_actor_name
from actors.engine import Engine, GenerationRequest, Message, build_prompt
from actors.layer_loader import load_zqs, open_zqs
from actors.messages import ActorRequest, Completion, Phase, Started, TextChunk
from actors.request_actor import spawn
from actors.sampling import SamplingParams

CONFIG = ActorConfig(namespace="zeroqueue-tests", num_cpus=1, load_threads=1, compute_threads=1)


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


def _consume(ray, gen) -> tuple[list[TextChunk], Completion]:
    items = [ray.get(ref) for ref in gen]
    assert isinstance(items[0], Started) and isinstance(items[-1], Completion)
    assert all(isinstance(i, TextChunk) for i in items[1:-1])
    return items[1:-1], items[-1]


def _token_ids(chunks: list[TextChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def _wait_gone(ray, name: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=CONFIG.namespace)
        except ValueError:
            return
        time.sleep(0.05)
    raise AssertionError(f"actor {name} still in Ray's actor table after {timeout}s")


def _wait_rows(ray, actor, expected: int, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (status := ray.get(actor.status.remote())).num_rows != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert status.num_rows == expected
    return status


def _wait_cpus(ray, expected: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ray.available_resources().get("CPU", 0) >= expected


@pytest.mark.parametrize("table", ["raw", "compressed"])
def test_actor_generates_what_the_in_process_runtime_generates_then_exits(
    ray_cluster, tiny_zqs, tiny_zqs_compressed_embeddings, table
):
    # A raw table: layer 0 runs on the prompt's rows read alone; compressed: on the whole table.
    tiny_zqs = tiny_zqs if table == "raw" else tiny_zqs_compressed_embeddings
    ray = ray_cluster
    free_before = ray.available_resources()["CPU"]
    request = _request(tiny_zqs)
    name = new_actor_name("tiny")
    actor = spawn(str(tiny_zqs), CONFIG, name)
    chunks, done = _consume(ray, actor.generate.remote(request))
    assert _token_ids(chunks) == _in_process_tokens(tiny_zqs, request)
    assert done.output_tokens == len(_token_ids(chunks)) == chunks[-1].num_output_tokens == 16 and done.stop_reason == "max_tokens"
    assert done.is_cold and 0 <= done.first_layers <= 2
    t = done.timings
    assert t.actor_start <= t.compute_start <= t.first_token <= t.last_token
    _wait_gone(ray, name)
    _wait_cpus(ray, free_before)


def test_hot_actor_serves_a_second_request_as_a_fresh_actor_would(ray_cluster, tiny_zqs):
    ray = ray_cluster
    first, second = _request(tiny_zqs, seed=1, keep_hot=True), _request(tiny_zqs, seed=2, keep_hot=True)
    name = new_actor_name("tiny")
    actor = spawn(str(tiny_zqs), CONFIG, name)
    _consume(ray, actor.generate.remote(first))
    status = ray.get(actor.status.remote())
    assert status.phase == Phase.IDLE and status.num_layers_resident == status.num_layers
    assert status.num_requests_served == 1
    hot_chunks, hot_done = _consume(ray, actor.generate.remote(second))
    assert not hot_done.is_cold
    fresh_name = new_actor_name("tiny")
    fresh = spawn(str(tiny_zqs), CONFIG, fresh_name)
    fresh_chunks, _ = _consume(ray, fresh.generate.remote(ActorRequest("fresh", second.prompt_ids, second.sampling)))
    assert _token_ids(hot_chunks) == _token_ids(fresh_chunks)
    phases = [p for p, _ in ray.get(actor.status.remote()).transitions]
    # The second request joins a loaded actor: no cold prefill phase of its own.
    assert phases == ["STARTING", "LOADING", "PREFILL", "DECODE", "IDLE", "DECODE", "IDLE"]
    ray.kill(actor, no_restart=True)  # a hot actor is retired as the registry retires it
    _wait_gone(ray, name)
    _wait_gone(ray, fresh_name)


def test_cancel_mid_decode_stops_the_row_within_a_step_and_a_hot_actor_stays(ray_cluster, tiny_zqs):
    ray = ray_cluster
    request = _request(tiny_zqs, max_tokens=1500, temperature=0.0, keep_hot=True)
    name = new_actor_name("tiny")
    actor = spawn(str(tiny_zqs), CONFIG, name)
    gen = actor.generate.remote(request)
    received = 0
    for ref in gen:
        ray.get(ref)
        received += 1
        if received == 3:  # Started and two chunks of tokens
            ray.cancel(gen)
            break
    status = _wait_rows(ray, actor, 0)
    # The row left (far fewer than 1500 tokens were made); the loaded actor stays hot for the next one.
    assert status.phase == Phase.IDLE
    _, done = _consume(ray, actor.generate.remote(_request(tiny_zqs, max_tokens=3, keep_hot=True)))
    assert done.output_tokens == 3 and not done.is_cold
    ray.kill(actor, no_restart=True)  # a hot actor is retired as the registry retires it
    _wait_gone(ray, name)


def test_killing_an_actor_mid_load_or_mid_decode_surfaces_an_error(ray_cluster, layered_zqs, tiny_zqs):
    ray = ray_cluster
    from ray.exceptions import ActorDiedError, RayActorError

    for zqs, kill_after in ((layered_zqs, 0), (tiny_zqs, 2)):
        name = new_actor_name("kill")
        actor = spawn(str(zqs), CONFIG, name)
        gen = actor.generate.remote(_request(zqs, max_tokens=1500, temperature=0.0))
        with pytest.raises((ActorDiedError, RayActorError)):
            for k, ref in enumerate(gen):
                if k == kill_after:
                    ray.kill(actor)
                ray.get(ref)
        _wait_gone(ray, name)


def test_prefill_overlaps_loading(ray_cluster, layered_zqs):
    ray = ray_cluster
    config = ActorConfig(namespace=CONFIG.namespace, num_cpus=1, load_threads=1, compute_threads=1, first_layers=1)
    request = _request(layered_zqs, max_tokens=4)
    name = new_actor_name("layered")
    actor = spawn(str(layered_zqs), config, name)
    _, done = _consume(ray, actor.generate.remote(request))
    t = done.timings
    assert done.first_layers == 1
    assert t.first_layer_resident is not None and t.all_layers_resident is not None
    assert t.first_layer_compute_start < t.all_layers_resident, t
    # Layer 0 ran on the prompt's embedding rows; the table itself came after the layers.
    assert t.embeddings_resident is not None and t.first_layer_compute_start < t.embeddings_resident, t
    _wait_gone(ray, name)
    # The benchmark's baseline: nothing computes before every group is resident.
    config = ActorConfig(namespace=CONFIG.namespace, num_cpus=1, load_threads=1, compute_threads=1,
                         is_load_then_compute=True)
    name = new_actor_name("layered")
    _, done = _consume(ray, spawn(str(layered_zqs), config, name).generate.remote(request))
    t = done.timings
    assert done.first_layers == 8 and t.all_layers_resident is not None
    assert t.first_layer_compute_start >= t.all_layers_resident >= t.embeddings_resident, t
    _wait_gone(ray, name)


def test_actor_reports_its_memory_to_the_node_agent_and_its_peak(ray_cluster, tiny_zqs):
    ray = ray_cluster
    from actors.telemetry import TelemetryConfig
    from actors.telemetry_agent import ensure_agents

    (agent,) = ensure_agents(TelemetryConfig(poll_interval_s=0.1), namespace=CONFIG.namespace).values()

    def accounted() -> int:
        (device,) = ray.get(agent.snapshot.remote()).devices
        return device.accounted_bytes

    def wait_accounted(expected: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while accounted() != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert accounted() == expected

    try:
        name = new_actor_name("tiny")
        actor = spawn(str(tiny_zqs), CONFIG, name)
        weights = ray.get(actor.status.remote()).accounted_bytes
        assert weights > 0
        wait_accounted(weights)  # reported as soon as the model is allocated
        _, done = _consume(ray, actor.generate.remote(_request(tiny_zqs)))
        # The process's peak resident set over the request: Python and torch besides the weights.
        assert done.peak_bytes is not None and done.peak_bytes > weights
        _wait_gone(ray, name)
        wait_accounted(0)  # withdrawn on exit
        # Killed from outside, an actor cannot withdraw its report: the agent sees its process gone.
        name = new_actor_name("tiny")
        actor = spawn(str(tiny_zqs), CONFIG, name)
        wait_accounted(ray.get(actor.status.remote()).accounted_bytes)
        ray.kill(actor)
        _wait_gone(ray, name)
        wait_accounted(0)
    finally:
        ray.kill(agent)


def test_a_corrupt_embedding_row_fails_the_request_before_any_token(ray_cluster, tiny_zqs, tmp_path):
    # The prompt's rows are read unchecked ahead of the table; the table's checksum must
    # still stop the request before a token computed from them leaves the actor.
    ray = ray_cluster
    from ray.exceptions import RayTaskError

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
    name = new_actor_name("bad-row")
    actor = spawn(str(bad), CONFIG, name)
    items = []
    with pytest.raises(RayTaskError, match="CRC|checksum|crc"):
        for ref in actor.generate.remote(request):
            items.append(ray.get(ref))
    assert [type(i) for i in items] == [Started]
    _wait_gone(ray, name)  # it exits on its own, as after any failed request


def _loaded_hot_actor(ray, zqs, config=CONFIG):
    """A spawned actor that has served one request and stays hot (every weight resident)."""
    name = new_actor_name("batch")
    actor = spawn(str(zqs), config, name)
    _consume(ray, actor.generate.remote(_request(zqs, max_tokens=2, keep_hot=True)))
    return name, actor


def test_a_hot_actor_runs_several_requests_at_once_each_as_it_would_alone(ray_cluster, tiny_zqs):
    ray = ray_cluster
    requests = [_request(tiny_zqs, max_tokens=n, seed=s, temperature=t, keep_hot=True)
                for n, s, t in ((40, 1, 0.0), (24, 2, 1.0), (33, 3, 0.7))]
    expected = [_in_process_tokens(tiny_zqs, r) for r in requests]
    name, actor = _loaded_hot_actor(ray, tiny_zqs)
    weights = ray.get(actor.status.remote()).accounted_bytes
    gens = [actor.generate.remote(r) for r in requests]  # all three in flight together
    results = [_consume(ray, g) for g in gens]
    assert [_token_ids(chunks) for chunks, _ in results] == expected
    assert [done.request_id for _, done in results] == [r.request_id for r in requests]
    status = ray.get(actor.status.remote())
    assert status.num_rows == 0 and status.phase == Phase.IDLE
    assert status.accounted_bytes == weights  # every row's KV cache was freed
    ray.kill(actor, no_restart=True)  # a hot actor is retired as the registry retires it
    _wait_gone(ray, name)


def test_cancelling_one_row_leaves_the_others_untouched(ray_cluster, tiny_zqs):
    ray = ray_cluster
    keep = _request(tiny_zqs, max_tokens=64, seed=4, temperature=0.0, keep_hot=True)
    drop = _request(tiny_zqs, max_tokens=1500, seed=5, temperature=0.0, keep_hot=True)
    name, actor = _loaded_hot_actor(ray, tiny_zqs)
    dropped = actor.generate.remote(drop)
    ray.get(next(dropped))  # Started: the row is in the batch
    kept = actor.generate.remote(keep)
    ray.cancel(dropped)
    chunks, done = _consume(ray, kept)
    assert _token_ids(chunks) == _in_process_tokens(tiny_zqs, keep) and done.stop_reason == "max_tokens"
    ray.kill(actor, no_restart=True)  # a hot actor is retired as the registry retires it
    _wait_gone(ray, name)


def test_back_to_back_requests_never_find_a_hot_actor_busy(ray_cluster, tiny_zqs):
    """The row leaves before its Completion is sent: the next request may follow at once."""
    ray = ray_cluster
    name, actor = _loaded_hot_actor(ray, tiny_zqs, replace(CONFIG, max_batch=1))
    for i in range(40):
        _, done = _consume(ray, actor.generate.remote(_request(tiny_zqs, max_tokens=2, seed=i, keep_hot=True)))
        assert done.output_tokens == 2
    ray.kill(actor, no_restart=True)  # a hot actor is retired as the registry retires it
    _wait_gone(ray, name)


def test_a_full_batch_refuses_the_extra_request_at_once(ray_cluster, tiny_zqs):
    from ray.exceptions import RayTaskError

    ray = ray_cluster
    name, actor = _loaded_hot_actor(ray, tiny_zqs, replace(CONFIG, max_batch=2))
    running = [actor.generate.remote(_request(tiny_zqs, max_tokens=1500, seed=s, keep_hot=True)) for s in (1, 2)]
    for g in running:
        ray.get(next(g))  # both rows started
    with pytest.raises(RayTaskError, match="already runs 2"):
        ray.get(next(actor.generate.remote(_request(tiny_zqs, max_tokens=4, keep_hot=True))))
    for g in running:
        ray.cancel(g)
    _wait_rows(ray, actor, 0)
    ray.kill(actor, no_restart=True)  # a hot actor is retired as the registry retires it
    _wait_gone(ray, name)


@pytest.mark.parametrize("warm_layers", [1, 8])
def test_warm_actor_holds_its_first_layers_then_serves_as_a_fresh_actor(ray_cluster, layered_zqs, warm_layers):
    ray = ray_cluster
    request = _request(layered_zqs, seed=11)
    name = new_actor_name("layered")
    warm = spawn(str(layered_zqs), CONFIG, name, warm_layers=warm_layers)
    status = ray.get(warm.ready.remote(60.0), timeout=60)
    assert status.phase == Phase.WARM and status.num_layers == 8
    time.sleep(0.3)  # held: nothing more streams in until a request is bound
    assert ray.get(warm.status.remote()).num_layers_resident == warm_layers
    chunks, done = _consume(ray, warm.generate.remote(request))
    assert done.is_cold  # its first request: the rest of the weights streamed in for it
    fresh_name = new_actor_name("layered")
    fresh = spawn(str(layered_zqs), CONFIG, fresh_name)
    fresh_chunks, _ = _consume(ray, fresh.generate.remote(ActorRequest("fresh", request.prompt_ids, request.sampling)))
    assert _token_ids(chunks) == _token_ids(fresh_chunks) and len(_token_ids(chunks)) == 16
    _wait_gone(ray, name)  # bound without keep_hot: it exits after its request, as a cold actor does
    _wait_gone(ray, fresh_name)


def test_a_low_latency_request_gets_every_token_alone_and_a_default_one_gets_them_coalesced(ray_cluster, tiny_zqs):
    ray = ray_cluster
    interval = 0.5
    actor = spawn(str(tiny_zqs), replace(CONFIG, stream_interval_s=interval), new_actor_name("ll"))
    try:
        default = _request(tiny_zqs, max_tokens=16, keep_hot=True, temperature=0)
        coalesced, done = _consume(ray, actor.generate.remote(default))
        # Coalesced: the first token alone, then at most one chunk per interval of the decode, and the last.
        decode_s = done.timings.last_token - done.timings.first_token
        assert len(coalesced) <= 3 + decode_s / interval, (len(coalesced), decode_s)
        fast = replace(_request(tiny_zqs, max_tokens=16, temperature=0), is_low_latency=True)
        chunks, done = _consume(ray, actor.generate.remote(fast))
        assert [len(c.token_ids) for c in chunks] == [1] * done.output_tokens  # each token its own chunk
        assert _token_ids(chunks) == _token_ids(coalesced)  # the same tokens either way
    finally:
        ray.kill(actor)
