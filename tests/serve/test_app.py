"""The zeroqueue app on real Ray Serve and real HTTP: what only Serve and Ray show — the SDKs through Serve's
proxy, an actor's process killed mid-stream, a client leaving through the proxy, the registry forgetting a dead
actor, a handle from another driver, metrics export, telemetry agents. Validation, refusals, placement and
streaming formats are tested in-process (tests/ingress/test_app.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import SERVE_PORT, metrics_export_port, request_actors
from tests.serve.waiting import wait_for

KEY = "zq-test-key-5d1c"
NAMESPACE = "zq-serve-tests"
MODEL = "zq-tiny"
SLOW_MODEL = "zq-layered"
MAX_BATCH = 3


@pytest.fixture(scope="module")
def zq(deploy_app, tiny_zqs, layered_zqs):
    from serve_app.app import build_app

    os.environ["ZQ_TEST_API_KEY"] = KEY
    return deploy_app(SERVE_PORT, "zeroqueue", build_app({
        # The layered model decodes slowly enough here to hold a slot for seconds.
        "models": [{"id": MODEL, "zqs_path": str(tiny_zqs)}, {"id": SLOW_MODEL, "zqs_path": str(layered_zqs)}],
        "slots": {"kind": "cpu", "num_cpu_slots": 2, "cpu_slot_bytes": 1 << 30},
        "policy": {"short_max_input_tokens": 512, "short_max_output_tokens": 256,
                   "max_hot_short_actors": 1, "max_hot_long_actors": 1, "max_batch": MAX_BATCH},
        "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
        "api_key_env": "ZQ_TEST_API_KEY",
        "max_body_bytes": 64 * 1024,
        "namespace": NAMESPACE,
        "ping_interval_s": 0.2,
    }), NAMESPACE)


def _actors(ray) -> set[str]:
    return request_actors(ray, NAMESPACE)


def _body(max_tokens=8, stream=False, text="Why do queues hurt tail latency?", **extra) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": text}], **extra}


def _post(base, body, headers=None, **kw) -> httpx.Response:
    return httpx.post(f"{base}/v1/messages", json=body, headers={"x-api-key": KEY, **(headers or {})},
                      timeout=60, **kw)


def test_sdk_create_and_stream_work_unmodified(zq):
    import anthropic

    client = anthropic.Anthropic(base_url=zq, api_key=KEY, max_retries=0)
    msg = client.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "hi"}],
                                 extra_body={"seed": 3, "temperature": 0.7})
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 12 and msg.usage.input_tokens > 0
    again = client.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "hi"}],
                                   extra_body={"seed": 3, "temperature": 0.7})
    assert again.content[0].text == msg.content[0].text  # same seed, same output (cold, then hot)
    with client.messages.stream(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}],
                                extra_body={"seed": 3, "temperature": 0.7}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.usage.output_tokens == 10 and final.stop_reason == "max_tokens"
    assert text == final.content[0].text and msg.content[0].text.startswith(text[:5])
    assert [m.id for m in client.models.list()] == [MODEL, SLOW_MODEL]
    # Serve's proxy gives every response its `x-request-id`; the app's own is `request-id`, not a second one.
    r = _post(zq, _body(max_tokens=1, seed=3, temperature=0.7))
    assert len(r.headers.get_list("x-request-id")) == 1 and r.headers["request-id"].startswith("req_")
    assert client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}]).input_tokens > 0


def test_openai_sdk_create_and_stream_work_through_serve(zq):
    """Chat Completions' one happy path on Serve (the API itself is tested in-process: tests/ingress)."""
    import openai

    with openai.OpenAI(base_url=f"{zq}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        hi = [{"role": "user", "content": "hi"}]
        done = client.chat.completions.create(model=MODEL, messages=hi, max_completion_tokens=6, seed=3,
                                              temperature=0.7)
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 6
        chunks = list(client.chat.completions.create(model=MODEL, messages=hi, max_completion_tokens=6, seed=3,
                                                     temperature=0.7, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == done.choices[0].message.content  # the same seed, streamed


def test_health_reports_jitter_actors_and_slots(zq):
    _post(zq, _body(max_tokens=2))
    h = httpx.get(f"{zq}/health", headers={"x-api-key": KEY}).json()
    assert h["status"] == "ok" and h["slots"]["total"] == 2
    assert h["dispatch_latency_us"]["count"] >= 1 and h["dispatch_latency_us"]["p50"] > 0
    # Seed 001's operators read the jitter at the top level.
    assert h["dispatch_jitter_us"] == h["dispatch_latency_us"]["jitter"] >= 0
    assert h["replica"]["nice"] == 0  # ahead of the request actors for the CPU, not at Ray's default 15
    assert h["compute_dtype"] == {MODEL: "float32", SLOW_MODEL: "float32"}  # the tests' models are stored fp32
    assert h["kv_dtype"] == h["compute_dtype"]  # caches in the compute dtype (actor.kv_dtype: auto)
    # Engine time over time in the system, of the request above (and any before it).
    density = h["compute_density"]
    assert density["count"] >= 1 and 0 < density["p10"] <= density["p50"] <= 1 and density["mean_step_rows"] >= 1
    assert density["mean_step_threads"] >= 1  # the threads its steps computed on, as its actor counted them


def _health(base) -> dict:
    return httpx.get(f"{base}/health", headers={"x-api-key": KEY}, timeout=10).json()


def _wait_free_slot(base) -> None:
    """Earlier tests' actors release their slots asynchronously after their streams end."""
    wait_for(lambda: _health(base)["slots"]["free"] >= 1, what="a free slot")


def test_actor_killed_mid_stream_ends_the_stream_with_an_error_event(zq, ray_cluster):
    ray = ray_cluster
    _wait_free_slot(zq)
    before = _actors(ray)
    events = []
    with httpx.stream("POST", f"{zq}/v1/messages", json=_body(max_tokens=1900, stream=True, temperature=0),
                      headers={"x-api-key": KEY}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("event: "):
                events.append(line.removeprefix("event: "))
            if events.count("content_block_delta") == 2:
                for name in _actors(ray) - before:
                    try:
                        ray.kill(ray.get_actor(name, namespace=NAMESPACE))
                    except ValueError:  # another new actor that exited meanwhile (one not kept hot, say)
                        pass
    assert events[-1] == "error", events[-5:]
    assert "message_stop" not in events


def test_client_disconnect_frees_its_row_and_reservation_and_a_hot_actor_stays(zq, ray_cluster):
    ray = ray_cluster
    _wait_free_slot(zq)
    long_body = _body(max_tokens=1900, stream=True, temperature=0)  # the long lane, whose quota keeps one hot
    with httpx.stream("POST", f"{zq}/v1/messages", json=long_body, headers={"x-api-key": KEY}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("event: content_block_delta"):
                break

    def nothing_running():
        h = _health(zq)
        return h["rows"] == 0 and h["actors"].get("busy", 0) == 0 and h["actors"].get("starting", 0) == 0

    wait_for(nothing_running, what="the row and its reservation to be released")
    actors = _actors(ray)
    statuses = [ray.get(ray.get_actor(n, namespace=NAMESPACE).status.remote()) for n in actors]
    assert all(st.num_rows == 0 for st in statuses)  # the batch let the row go within a step
    # The actor it ran on stayed hot: the next long request runs there, no new process.
    assert _post(zq, {**long_body, "stream": False, "max_tokens": 300}).status_code == 200
    assert _actors(ray) == actors


def test_registry_forgets_a_crashed_hot_actor(zq, ray_cluster):
    ray = ray_cluster
    assert _post(zq, _body(max_tokens=2)).status_code == 200  # leaves a hot idle actor
    for name in _actors(ray):
        ray.kill(ray.get_actor(name, namespace=NAMESPACE))

    def registry_empty():
        h = httpx.get(f"{zq}/health", headers={"x-api-key": KEY}).json()
        return not h["actors"] and h["slots"]["free"] == 2

    wait_for(registry_empty, what="reconcile to drop the dead actor")
    assert _post(zq, _body(max_tokens=2)).status_code == 200


def test_python_handle_from_another_driver(zq, ray_cluster, tmp_path):
    script = tmp_path / "driver.py"
    address = ray_cluster.get_runtime_context().gcs_address  # this session's cluster, whatever else runs here
    script.write_text(
        "import json, ray\n"
        "from ray import serve\n"
        "from serve_app.api import MessagesRequest\n"
        f"ray.init(address='{address}', logging_level='ERROR')\n"
        "h = serve.get_app_handle('zeroqueue')\n"
        f"req = MessagesRequest(model='{MODEL}', max_tokens=6, seed=3, temperature=0.7,\n"
        "                      messages=[{'role': 'user', 'content': 'hi'}])\n"
        "msg = h.create.remote(req).result(timeout_s=60)\n"
        "items = [type(i).__name__ for i in h.options(stream=True).stream.remote(req)]\n"
        "print(json.dumps({'usage': msg['usage'], 'items': items}))\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["usage"]["output_tokens"] == 6
    # Typed items, not SSE bytes decoded back: text chunks, then the Completion.
    assert set(result["items"][:-1]) == {"TextChunk"} and result["items"][-1] == "Completion"


def test_metrics_are_exported_for_prometheus(zq, ray_cluster):
    assert _post(zq, _body(max_tokens=2)).status_code == 200
    # A refusal of its own (a TTFT target nothing can meet), so the test does not lean on earlier ones.
    assert _post(zq, _body(max_tokens=2), headers={"x-zq-ttft-target-s": "0.000001"}).status_code == 503
    port = metrics_export_port(ray_cluster)
    wanted = ("ray_zq_decisions_total", "ray_zq_rejections_total", "ray_zq_dispatch_latency_seconds_bucket",
              "ray_zq_ttft_seconds_bucket", "ray_zq_first_token_delivery_seconds_bucket",
              "ray_zq_time_per_output_token_seconds_bucket", "ray_zq_cold_start_seconds_bucket",
              "ray_zq_batch_rows_bucket")
    seen: set[str] = set()

    def exported() -> bool:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        seen.update(line.split("{")[0] for line in text.splitlines() if line.startswith("ray_zq_"))
        return all(name in seen for name in wanted)

    try:
        wait_for(exported, timeout=30, what="every metric exported")
    except AssertionError:
        raise AssertionError(f"not exported: {sorted(set(wanted) - seen)}") from None


def test_slot_telemetry_reaches_the_registry(zq, ray_cluster):
    # The ingress starts a telemetry agent per node, polls it every telemetry_refresh_s, and
    # hands the slots' device figures to the registry with its next admission.
    ray = ray_cluster
    from actors.actor_names import agent_name

    registry = ray.get_actor("zq-registry", namespace=NAMESPACE)
    agent = ray.get_actor(agent_name(ray.get_runtime_context().get_node_id()), namespace=NAMESPACE)

    def slots_follow_the_agent():
        assert _post(zq, _body(max_tokens=1)).status_code == 200
        (device,) = ray.get(agent.snapshot.remote()).devices
        slots = ray.get(registry.snapshot.remote()).slots
        # A CPU node's slots share its one device; the EWMA moves between the two reads.
        return len(slots) == 2 and all(s.utilization > 0 for s in slots) and abs(
            slots[0].utilization - device.utilization_ewma) < 0.5

    wait_for(slots_follow_the_agent, what="slot utilisation from the telemetry agent")
