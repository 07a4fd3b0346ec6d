"""OpenAI's Chat Completions on real HTTP over the in-process cluster, driven by the official `openai` SDK unmodified:
create, stream, the timing headers, errors in OpenAI's shape as the SDK's typed exceptions, a 503 when
capacity has really run out, and the one models page both SDKs read.

One slot and batches of one: a request held open (FaultyActor's `gate:`) is all the capacity there is.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.ingress.local import MODEL, serve_locally
from tests.reliability.faults import FaultyActor

KEY_ENV = "ZQ_OPENAI_TEST_KEY"
KEY = "zq-openai-key-3f7a2c"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def zq(tiny_zqs):
    os.environ[KEY_ENV] = KEY
    server = serve_locally(tiny_zqs, FaultyActor, api_key_env=KEY_ENV,
                           slots={"kind": "cpu", "num_cpu_slots": 1, "cpu_slot_bytes": 1 << 30},
                           policy={"max_batch": 1}, max_body_bytes=64 * 1024, ping_interval_s=0.2)
    yield server.base
    server.stop()


@pytest.fixture
def client(zq):
    with openai.OpenAI(base_url=f"{zq}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def test_create(client):
    completion = client.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=6, seed=3,
                                                temperature=0.7)
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    assert completion.model == MODEL
    [choice] = completion.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    usage = completion.usage
    assert usage.completion_tokens == 6 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The same seed, the same text; the deprecated max_tokens is the limit when max_completion_tokens is absent.
    again = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, seed=3, temperature=0.7)
    assert again.choices[0].message.content == choice.message.content


def test_stream_with_usage(client):
    kwargs = dict(model=MODEL, messages=HI, max_completion_tokens=6, seed=3, temperature=0.7)
    collected = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == collected
    assert [c.choices[0].finish_reason for c in with_choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert len({c.id for c in chunks}) == 1


def test_a_benchmark_clients_default_body_is_served_with_vllms_meaning(client):
    # What GuideLLM sends by default: ignore_eos and continuous usage, beside the SDK's own parameters.
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HI, max_completion_tokens=6, temperature=0.7, seed=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "min_tokens": 2, "top_k": 20}))
    assert all(c.usage is not None for c in chunks)  # the usage so far on every chunk
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6  # exactly the limit: ignore_eos
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_timing_and_request_id_headers(zq, client):
    # Seeded as test_create (which makes 6 tokens): unseeded, the random model may end its turn within 2.
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=HI, max_completion_tokens=2, seed=3,
                                                           temperature=0.7)
    assert raw.parse().choices[0].finish_reason == "length"
    dispatch, start = float(raw.headers["X-Request-Dispatch-Time"]), float(raw.headers["X-Request-Start-Time"])
    assert dispatch - 0.05 <= start and raw.headers["X-Request-Tier"] in ("hot", "warm", "cold")
    assert raw.headers["request-id"].startswith("req_")
    # The SDK's request id is Serve's proxy's `x-request-id`: the app sets none, which would join it into "id, id".
    assert not raw.headers.get_list("x-request-id")
    body = {"model": MODEL, "messages": HI, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{zq}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {KEY}", "x-stream-mode": "low-latency"}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        assert s.headers["X-Stream-Mode"] == "low-latency" and "X-Request-Start-Time" in s.headers
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"


def _error(e: openai.APIStatusError) -> dict:
    return e.response.json()["error"]


def test_an_unknown_model_is_the_sdks_not_found_error(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=HI, max_tokens=2)
    assert (info.value.code, info.value.param, info.value.type) == ("model_not_found", "model", "invalid_request_error")
    assert info.value.response.headers["request-id"].startswith("req_")


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 2}, "n"),
    ({"temperature": 3}, "temperature"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 5000}, "messages"),  # beyond the 2048-token window
])
def test_a_bad_parameter_is_the_sdks_bad_request_error_naming_it(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**({"model": MODEL, "messages": HI, "max_tokens": 2} | kwargs))
    assert info.value.param == param and _error(info.value)["param"] == param
    assert param in info.value.message


def test_a_missing_or_wrong_key_is_the_sdks_authentication_error(zq, client):
    with pytest.raises(openai.AuthenticationError) as info:
        client.with_options(api_key="wrong").chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    assert info.value.code == "invalid_api_key"
    r = httpx.post(f"{zq}/v1/chat/completions", json={"model": MODEL, "messages": HI}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_errors_before_parsing_and_unknown_chat_paths_are_in_openais_shape(zq):
    auth = {"authorization": f"Bearer {KEY}"}
    big = httpx.post(f"{zq}/v1/chat/completions", headers=auth, timeout=30,
                     json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 70_000}]})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    lost = httpx.get(f"{zq}/v1/chat/completions/nope", headers=auth, timeout=30)
    assert lost.status_code == 404 and set(lost.json()["error"]) == {"message", "type", "param", "code"}
    # The Messages API's errors keep their own shape.
    anthropic_shaped = httpx.post(f"{zq}/v1/messages", headers=auth, timeout=30, json={"model": "nope"})
    assert anthropic_shaped.status_code == 400 and anthropic_shaped.json()["type"] == "error"


def test_models_list_answers_both_sdks(zq, client):
    import anthropic

    assert [m.id for m in client.models.list()] == [MODEL]
    model = client.models.retrieve(MODEL)
    assert (model.object, model.owned_by) == ("model", "zeroqueue") and model.created > 0
    with anthropic.Anthropic(base_url=zq, api_key=KEY, max_retries=0) as claude:
        assert [(m.id, m.type) for m in claude.models.list()] == [(MODEL, "model")]


def test_no_capacity_is_a_503_with_retry_after_as_the_sdks_status_error(client, tmp_path):
    gate = tmp_path / "gate"  # the held request keeps its answer open until the gate opens: the only slot is taken
    computing, outcome = threading.Event(), {}

    def hold() -> None:
        stream = client.chat.completions.create(model=MODEL, max_tokens=4, stream=True, seed=3, temperature=0.7,
                                                messages=[{"role": "user", "content": f"hold gate:{gate} please"}])
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                computing.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                outcome["finish_reason"] = chunk.choices[0].finish_reason

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert computing.wait(120), "the held request never started computing"
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as info:
                client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, stream=stream)
            assert info.value.status_code == 503 and int(info.value.response.headers["retry-after"]) >= 1
            assert (info.value.type, info.value.code) == ("server_error", "overloaded")
    finally:
        gate.touch()
        holder.join(120)
    assert outcome == {"finish_reason": "length"}  # the held request was served in full


def test_an_actor_lost_mid_stream_is_the_sdks_api_error(client):
    # Last in the module: the actor dies, and the next request would start a fresh one.
    seen = []
    with pytest.raises(openai.APIError) as info:
        for chunk in client.chat.completions.create(model=MODEL, max_tokens=8, stream=True,
                                                    messages=[{"role": "user", "content": "x fault:die-mid-decode"}]):
            seen.append(chunk.choices[0].delta.content)
    assert seen == [""]  # the role chunk, then the error
    assert info.value.type == "server_error" and "request id req_" in info.value.message


GUIDELLM = Path(__file__).parents[2] / ".cache/peer/guidellm/bin/guidellm"


@pytest.mark.skipif(not GUIDELLM.exists(), reason="GuideLLM is not installed here (bash benchmarks/peer/setup.sh "
                                                   "installs it, with a torch of its own the suite does not need)")
def test_guidellm_with_its_default_body_and_health_check_gets_no_error(zq, tiny_checkpoint, tmp_path):
    from benchmarks.bench_peer import GUIDELLM_ENV, guidellm_command

    # One request at a time: the module's single row never refuses one (a 503 would count as an error).
    out = tmp_path / "guidellm.json"
    command = guidellm_command(GUIDELLM, zq, MODEL, tiny_checkpoint, "kind=synchronous", "kind=max_requests,count=5",
                               out, prompt_tokens=32, output_tokens=8, api_key=KEY)
    run = subprocess.run(command, cwd=tmp_path, env=os.environ | GUIDELLM_ENV, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    totals = json.loads(out.read_text())["benchmarks"][0]["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (5, 0, 0)


AIPERF = Path(__file__).parents[2] / ".cache/peer/aiperf/bin/aiperf"


@pytest.mark.skipif(not AIPERF.exists(), reason="AIPerf is not installed here (bash benchmarks/peer/setup.sh "
                                                 "installs it in a venv of its own, 1.2 GB the suite does not need)")
def test_aiperf_with_its_default_profile_and_readiness_probe_gets_no_error(zq, tiny_checkpoint, tmp_path):
    # Its default chat body: streamed, ~550 prompt tokens and no max_tokens (the rest of the context: a long
    # request). Waiting for the model is its own probe of the endpoint. One request at a time: the module's
    # single row never refuses one (a 503 would count as an error).
    out = tmp_path / "aiperf"
    # Hugging Face's offline switches off (a test before may have set them): with them on, AIPerf 0.13 resolves any
    # tokenizer name as a hub repo id and refuses a local directory; the directory it is given needs no hub.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    run = subprocess.run(
        [str(AIPERF), "profile", "-m", MODEL, "-u", zq, "--endpoint-type", "chat", "--streaming", "--api-key", KEY,
         "--tokenizer", str(tiny_checkpoint), "--request-count", "3", "--concurrency", "1",
         "--wait-for-model-timeout", "60", "--output-artifact-dir", str(out), "--ui-type", "none"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == 3 and [r.get("error") for r in records] == [None] * 3, records[:1]

