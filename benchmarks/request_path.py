"""Which of the project's files one request crosses: HTTP to its first token, then back to the client.

The ingress runs in this process over the in-process cluster (serve_app/local_cluster.py: the same
admission, registry state and engine as on Ray, no Ray), served by uvicorn on a free port, with the
`tiny` model. A first request spawns the model's actor and leaves it hot; the traced request is the
second, streamed (`POST /v1/messages`, `stream: true`): the hot path. Every Python call in every thread
is watched (`sys.setprofile` / `threading.setprofile`, set before any thread starts); a project file
counts when one of its functions is called

    to first token   first called between the client's send and the client reading the first text delta;
    back             called after that, until the stream's end has been read (a file may be in both).

Work that does not belong to the request runs in the same process (the cluster's heartbeat, the slot
refresher, the actor's idle loop): the files called during an idle window of 2 s just before the request
are listed as `background`, and the files on the path that are also among them counted apart. The Ray implementation crosses the files
of serve_app/ray_cluster/ in place of serve_app/local_cluster.py (the port's two sides); its actors run in
other processes, where this trace does not reach.

    .venv/bin/python -m benchmarks.request_path     # ~20 s; writes benchmarks/results/request_path.md
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from benchmarks.run_files import measure_and_report

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = tuple(str(ROOT / p) + "/" for p in ("serve_app", "actors", "weights_tool"))
MODEL = "zq-tiny"
IDLE_S = 2.0  # two of the cluster's heartbeats


class CallLog:
    """The first and last call into each project file within a window; cheap when no window is open."""

    def __init__(self) -> None:
        self.window: dict[str, list[float]] | None = None

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        window = self.window
        if window is None or event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(PACKAGES):
            now = time.perf_counter()
            times = window.get(path)
            if times is None:
                window[path] = [now, now]
            else:
                times[1] = now

    def open(self) -> dict[str, list[float]]:
        self.window = {}
        return self.window

    def close(self) -> None:
        self.window = None


def _rel(path: str) -> str:
    return str(Path(path).relative_to(ROOT))


def _serve(zqs: Path) -> tuple[uvicorn.Server, str]:
    from serve_app.asgi import IngressApp
    from serve_app.config import AppArgs, ingress_config
    from serve_app.local_cluster import LocalClusterSpec

    args = AppArgs.model_validate({
        "models": [{"id": MODEL, "zqs_path": str(zqs)}],
        "slots": {"kind": "cpu", "num_cpu_slots": 2, "cpu_slot_bytes": 1 << 30},
        "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
    })
    app = IngressApp(ingress_config(args), LocalClusterSpec())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", access_log=False,
                                           log_level="warning", log_config=None))
    threading.Thread(target=server.run, name="uvicorn", daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the ingress did not start in 60 s")
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def _stream(client: httpx.Client, base: str) -> tuple[float, float, float]:
    """One streamed request: (send, first text delta read, end read), perf_counter seconds."""
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0.0, "stream": True,
            "messages": [{"role": "user", "content": "Say something."}]}
    sent = time.perf_counter()
    first = None
    with client.stream("POST", f"{base}/v1/messages", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data:") and '"text_delta"' in line:
                first = time.perf_counter()
    end = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream carried no text")
    return sent, first, end


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from weights_tool.pack import pack
    from weights_tool.synth import synthesize

    calls = CallLog()
    sys.setprofile(calls.profile)
    threading.setprofile(calls.profile)  # every thread started from here on: uvicorn, the actors' steppers
    with tempfile.TemporaryDirectory() as tmp:
        zqs = pack(synthesize("tiny", Path(tmp) / "hf", dtype="float32", seed=0), Path(tmp) / "tiny.zqs")
        server, base = _serve(zqs)
        try:
            with httpx.Client(timeout=60) as client:
                _stream(client, base)  # spawns the actor; it stays hot
                _stream(client, base)  # and once more, hot, untraced
                idle = calls.open()
                time.sleep(IDLE_S)
                calls.close()
                window = calls.open()
                sent, first, end = _stream(client, base)
                calls.close()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            server.should_exit = True
    to_first = sorted(_rel(p) for p, (t, _) in window.items() if t <= first)
    back = sorted(_rel(p) for p, (_, t) in window.items() if t > first)
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.request_path", *args.argv])
    return {"command": command, "to_first_token": to_first, "back": back,
            "background": sorted(_rel(p) for p in idle),
            "ttft_ms": round((first - sent) * 1e3, 1), "total_ms": round((end - sent) * 1e3, 1)}


def report(data: dict[str, Any]) -> str:
    background = set(data["background"])

    def listing(files: list[str]) -> list[str]:
        return [f"- `{f}`" + (" (also called while idle)" if f in background else "") for f in files]

    on_path = [f for f in data["to_first_token"] if f not in background]
    back_only = [f for f in data["back"] if f not in background]
    either = set(data["to_first_token"]) | set(data["back"])
    lines = [
        "# The files one request crosses", "", f"Command: `{data['command']}`", "",
        "A hot streamed request over the in-process cluster (benchmarks/request_path.py says how it is traced). "
        f"It took {data['ttft_ms']} ms to its first text delta and {data['total_ms']} ms in all, traced.", "",
        "| | files | of them, not also called while idle |", "|---|--:|--:|",
        f"| HTTP to first token | {len(data['to_first_token'])} | {len(on_path)} |",
        f"| first token to the stream's end | {len(data['back'])} | {len(back_only)} |",
        f"| either | {len(either)} | {len(either - background)} |",
        "", "## HTTP to first token", "", *listing(data["to_first_token"]),
        "", "## After the first token", "", *listing(data["back"]),
        "", f"## Called during {IDLE_S:.0f} s of idleness just before the request", "", *[f"- `{f}`" for f in data["background"]],
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/request_path.md")
    parser.add_argument("--report-only", default=None, help="rewrite the report from a saved run's JSON")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    return measure_and_report(args, measure, report)


if __name__ == "__main__":
    raise SystemExit(main())
