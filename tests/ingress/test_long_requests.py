"""Requests of the long lane — an OpenAI request without max_tokens asks for the rest of the context — sent one
after another to an idle app with configs/serve.yaml's policy, targets and rule: every one is served, the first
on the warm actor, which stays hot in the short lane, the others on it. Before, each took the warm actor, which
exited after it, and the next one, a fresh actor's start predicted past the 1 s TTFT target, was refused on an
idle server (aiperf's default profile: 2 of 5 refused). Over HTTP on the in-process cluster, the tiny model in
place of SmolLM2."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from serve_app.local_cluster import LocalClusterSpec
from tests.ingress.local import BASE_ARGS, MODEL, LocalServer, assert_nothing_left
from tests.serve.waiting import wait_for

SERVE_YAML = Path(__file__).parents[2] / "configs/serve.yaml"


def _serve_yaml_app(tiny_zqs) -> LocalServer:
    args = yaml.safe_load(SERVE_YAML.read_text())["applications"][0]["args"]
    model = args["models"][0]
    return LocalServer(BASE_ARGS | {
        "models": [{"id": MODEL, "zqs_path": str(tiny_zqs), "ttft_target_s": model["ttft_target_s"],
                    "tpot_target_s": model["tpot_target_s"]}],
        "slots": args["slots"] | {"kind": "cpu"}, "policy": args["policy"], "rule_scorer": args["rule_scorer"],
        # The rule's predictions as configured: not corrected by what the tiny model's steps measure here.
        "is_prediction_corrected": False}, LocalClusterSpec())


def test_requests_without_max_tokens_one_after_another_are_all_served(tiny_zqs):
    server = _serve_yaml_app(tiny_zqs)
    try:
        wait_for(lambda: any(a.state == "warm" for a in server.books().actors), 60, "the warm actor")
        endings = []
        for i in range(3):
            r = httpx.post(f"{server.base}/v1/chat/completions", timeout=120, json={
                "model": MODEL, "seed": i, "messages": [{"role": "user", "content": f"Tell me a story, {i}."}]})
            endings.append((r.status_code, r.headers.get("x-request-tier"), r.text[:300]))
        assert [status for status, *_ in endings] == [200, 200, 200], endings
        # The first took the warm actor, which stays hot in the short lane: the others found it idle there.
        assert [tier for _, tier, _ in endings] == ["warm", "hot", "hot"], endings
        assert_nothing_left(server)
    finally:
        server.stop()
