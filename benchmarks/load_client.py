"""The load client: replays one open-loop arrival schedule, or runs one closed loop, against one app; records every request.

Run by `bench_load` in a process of its own (locust's gevent monkey-patching must not
reach the Ray driver), on loopback or, for the lossy scenario, inside a network namespace:

    python -m benchmarks.load_client --host http://127.0.0.1:8790 --schedule S.json --records R.jsonl

Locust is used as a library, with one `User` (a bounded population of one) driving
greenlets. Two modes, chosen by the schedule file:

- open loop (`arrivals`): each request starts in its own greenlet at its arrival time, so
  a slow answer never delays the next arrival. Bounded in concurrency (`--max-in-flight`;
  an arrival beyond it is recorded as `client_overflow` and not sent).
- closed loop (`closed_loop`: clients, duration, mix, seed): that many clients, each
  sending its next request as soon as its last one ended, for the duration; the class of
  each is drawn from the mix. A 503 is retried (the same request) after its
  `retry-after-ms`, as the SDKs do, capped at `max_retry_wait_s` (a 503 without the header
  is retried after 50 ms): this measures the most a system completes with every place busy
  (bench_load's capacity).

Both are bounded in time (the schedule plus one request deadline). Every request streams
(SSE) so that the time to first token is measured at the first `content_block_delta`. One
JSON line per request (each retry is a request) goes to the records file as it ends.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import gevent
from gevent.pool import Group
from locust import User, task
from locust.env import Environment
from locust.exception import StopUser
from requests import Session
from requests.adapters import HTTPAdapter

from benchmarks.load_stats import Record

log = logging.getLogger("load_client")

NO_RETRY_AFTER_WAIT_S = 0.05  # a closed-loop client's wait after a 503 that names no retry-after


@dataclass(frozen=True)
class ClientConfig:
    app: str
    scenario: str
    schedule: dict[str, Any]
    records_path: str
    timeout_s: float  # a request not finished by then is abandoned (the connection closed)
    max_in_flight: int


CONFIG: ClientConfig | None = None  # set by main() before the runner starts


class LoadClient(User):
    fixed_count = 1

    def on_start(self) -> None:
        assert CONFIG is not None
        self.config = CONFIG
        self.session = Session()
        # One connection per request in flight: a pool that blocks would be a client-side queue.
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=CONFIG.max_in_flight, pool_block=False)
        self.session.mount("http://", adapter)
        self.out = open(CONFIG.records_path, "a", buffering=1)

    def on_stop(self) -> None:
        self.out.close()

    @task
    def drive(self) -> None:
        if "closed_loop" in self.config.schedule:
            self._closed_loop()
        else:
            self._open_loop()
        # Quit from another greenlet: the runner's quit kills this one.
        gevent.spawn(self.environment.runner.quit)
        raise StopUser()

    def _open_loop(self) -> None:
        cfg, sched = self.config, self.config.schedule
        group = Group()
        t0 = time.time() + 0.2
        for a in sched["arrivals"]:
            gevent.sleep(max(0.0, t0 + a["t"] - time.time()))
            if len(group) >= cfg.max_in_flight:
                now = time.time()
                self._write(Record(cfg.app, cfg.scenario, a["i"], a["cls"], a["t"], now - t0 - a["t"], now, None,
                                   now, "client_overflow", None, 0, None))
                continue
            group.spawn(self._one, a, t0)
        group.join(timeout=cfg.timeout_s + 5)  # every request has met its deadline by then
        group.kill()

    def _one(self, a: dict, t0: float) -> None:
        self._send(a["i"], a["cls"], a["seed"], a["t"], t0)

    def _closed_loop(self) -> None:
        loop = self.config.schedule["closed_loop"]
        names = [c for c, _ in loop["mix"]]
        weights = [w for _, w in loop["mix"]]
        t0 = time.time()
        end = t0 + loop["duration_s"]
        counter = iter(range(10**9))

        def client(k: int) -> None:
            rng = random.Random(f"{loop['seed']}/{k}")
            while time.time() < end:
                cls, seed = rng.choices(names, weights)[0], rng.getrandbits(63)
                while time.time() < end:  # the same request until it is admitted
                    record, retry_after_s = self._send(next(counter), cls, seed, time.time() - t0, t0)
                    if not record.rejected:
                        break
                    wait = NO_RETRY_AFTER_WAIT_S if retry_after_s is None else retry_after_s
                    gevent.sleep(min(wait, loop["max_retry_wait_s"]))

        group = Group()
        for k in range(loop["clients"]):
            group.spawn(client, k)
        group.join(timeout=loop["duration_s"] + self.config.timeout_s + 5)
        group.kill()

    def _send(self, index: int, cls: str, seed: int, t_sched: float, t0: float) -> tuple[Record, float | None]:
        """One request, streamed to its end; its record is written. Returns it and a 503's retry-after (s)."""
        cfg, sched = self.config, self.config.schedule
        body = {"model": sched["model"], "max_tokens": sched["max_tokens"][cls], "stream": True,
                "seed": seed, "messages": [{"role": "user", "content": sched["prompts"][cls]}]}
        target = sched.get("ttft_target_s")
        headers = {"x-zq-ttft-target-s": f"{target:g}"} if target else None
        sent = time.time()
        first = server_start = server_dispatch = retry_after_s = tier = None
        status, error, tokens = "connection", None, 0
        response = None
        deadline = gevent.Timeout(cfg.timeout_s)
        deadline.start()
        try:
            response = self.session.post(f"{self.environment.host}/v1/messages", json=body, headers=headers,
                                         stream=True)
            status = str(response.status_code)
            server_start = _header_time(response, "X-Request-Start-Time")
            server_dispatch = _header_time(response, "X-Request-Dispatch-Time")
            tier = response.headers.get("X-Request-Tier")
            if response.status_code != 200:
                error = _error_type(response.content)
                retry_after_s = _retry_after_s(response)
            else:
                first, tokens, error = _read_stream(response)
        except gevent.Timeout as t:
            if t is not deadline:
                raise
            status, error = "timeout", "client_timeout"
        except Exception as e:  # refused or reset connections: recorded, never retried
            error = type(e).__name__
        finally:
            deadline.close()
            if response is not None:
                response.close()  # on a timeout this disconnects, and the server cancels the request
        end = time.time()
        record = Record(cfg.app, cfg.scenario, index, cls, t_sched, max(0.0, sent - t0 - t_sched), sent, first,
                        end, status, error, tokens, server_start, server_dispatch, tier)
        self._write(record)
        self.environment.events.request.fire(
            request_type="POST", name=cls, response_time=(end - sent) * 1000, response_length=tokens,
            exception=None if status == "200" and error is None else RuntimeError(f"{status} {error}"),
            context={},
        )
        return record, retry_after_s

    def _write(self, record: Record) -> None:
        self.out.write(json.dumps(asdict(record)) + "\n")


def _read_stream(response) -> tuple[float | None, int, str | None]:
    """(first delta's arrival, output tokens, error type) of an SSE body, read as it arrives."""
    first, tokens, error, done = None, 0, None, False
    buffer = b""
    for chunk in response.iter_content(chunk_size=None):
        buffer += chunk
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            kind = event.split(b"\n", 1)[0].removeprefix(b"event: ")
            if kind == b"content_block_delta" and first is None:
                first = time.time()
            elif kind == b"message_delta":
                tokens = _data(event)["usage"]["output_tokens"]
            elif kind == b"message_stop":
                done = True
            elif kind == b"error":
                error = _data(event)["error"]["type"]
    if error is None and not done:
        error = "stream_ended_early"
    return first, tokens, error


def _retry_after_s(response) -> float | None:
    """A refusal's precise delay (`retry-after-ms`), else its `retry-after` seconds; None if neither parses."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            return float(response.headers[name]) * scale
        except (KeyError, ValueError):
            continue
    return None


def _header_time(response, name: str) -> float | None:
    value = response.headers.get(name)
    return float(value) if value else None


def _data(event: bytes) -> dict:
    for line in event.split(b"\n"):
        if line.startswith(b"data: "):
            return json.loads(line[6:])
    return {}


def _error_type(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return "unparsed_error_body"


def main(argv: list[str] | None = None) -> int:
    global CONFIG
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", required=True)
    p.add_argument("--app", required=True)
    p.add_argument("--scenario", required=True)
    p.add_argument("--schedule", required=True,
                   help="JSON: model, prompts, max_tokens, and arrivals (open loop) or closed_loop")
    p.add_argument("--records", required=True, help="JSON lines, appended")
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--max-in-flight", type=int, default=1000)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with open(args.schedule) as f:
        sched = json.load(f)
    CONFIG = ClientConfig(args.app, args.scenario, sched, args.records, args.timeout_s, args.max_in_flight)
    env = Environment(user_classes=[LoadClient], host=args.host.rstrip("/"), stop_timeout=args.timeout_s + 10)
    runner = env.create_local_runner()
    duration = sched["closed_loop"]["duration_s"] if "closed_loop" in sched else sched["duration_s"]
    run_time = duration + args.timeout_s + 15  # the schedule, its last deadline, a margin
    runner.start(1, spawn_rate=1)
    gevent.spawn_later(run_time, runner.quit)
    runner.greenlet.join()
    total = env.stats.total
    log.info("%s/%s: %d requests, %d not 200-and-complete, median %.0f ms", args.app, args.scenario,
             total.num_requests, total.num_failures, total.median_response_time or 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
