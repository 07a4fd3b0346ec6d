"""`serve run configs/serve.yaml` then one request: the README's main command, end to end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_serve_run_then_one_request(tmp_path):
    serve = Path(sys.executable).with_name("serve")
    # A Ray cluster of its own (`-a local`), so the test does not depend on, or disturb,
    # the session's cluster; the demo model is made in .cache/demo on first use.
    proc = subprocess.Popen(
        [str(serve), "run", "-a", "local", "configs/serve.yaml"],
        cwd=ROOT, stdout=open(tmp_path / "serve.log", "wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "serve run did not come up in 300 s"
            try:
                if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        r = httpx.post("http://127.0.0.1:8000/v1/messages", timeout=120, json={
            "model": "zq-demo", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["output_tokens"] == 8 and r.json()["content"][0]["type"] == "text"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
