"""The load benchmark's arithmetic: per-request records in, percentiles, rates and goodput out.

Stdlib only (no gevent, no numpy), so the client, the driver and the unit tests share it.

Conventions:
- Latency percentiles (TTFT, end to end, TPOT) are over *completed* requests only: a
  status 200 whose stream reached `message_stop`. Refused, failed and abandoned requests
  are counted beside them, never inside them — which is why every tail figure travels
  with its rejection rate: a tail can look good because requests were refused.
- Rates (throughput, goodput) are per second of the offered-load window, the same
  denominator for every system, whatever happens after the window.
- A request is *good* when it completed within the SLO (`Slo`): TTFT and end to end.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# A fresh actor needs a Ray worker process before it computes: ~1.6 s from spawn to start
# on this 2-core machine (benchmarks/results/cold_start.md). A request joining a hot actor's
# batch waits only for the running step to end, which stays well under a second even when
# the step prefills a 256-token chunk of a long prompt on a busy core; so anything slower
# than this between dispatch and compute start was a cold start.
COLD_START_S = 1.0


@dataclass(frozen=True)
class Record:
    """One request as the client saw it; times are epoch seconds."""

    app: str
    scenario: str
    index: int
    cls: str
    t_sched: float  # its arrival time, seconds from the schedule's start
    lag: float  # how late the client sent it (its own scheduling delay)
    sent: float
    first_token: float | None  # the first content_block_delta arrived
    end: float
    status: str  # HTTP status, or timeout / connection / client_overflow
    error: str | None  # the API error type (body or SSE error event), or the exception's name
    output_tokens: int
    server_start: float | None  # X-Request-Start-Time: the server began computing it
    # X-Request-Dispatch-Time (zeroqueue only): the ingress decided and acted on it.
    server_dispatch: float | None = None
    tier: str | None = None  # X-Request-Tier (zeroqueue only): "hot", "warm" or "cold"

    @property
    def ok(self) -> bool:
        return self.status == "200" and self.error is None

    @property
    def rejected(self) -> bool:
        return self.status == "503"

    @property
    def e2e(self) -> float:
        return self.end - self.sent

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (decode speed as the client sees it)."""
        if not self.ok or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    @property
    def dispatch(self) -> float | None:
        """Arrival to zeroqueue's decision acted on: the proxy, the ingress and the registry."""
        return None if self.server_dispatch is None else self.server_dispatch - self.sent

    @property
    def wait(self) -> float | None:
        """Arrival to compute start, as the server stamps it (queueing, dispatch, cold start)."""
        return None if self.server_start is None else self.server_start - self.sent

    @property
    def placed(self) -> float | None:
        """zeroqueue's decision to compute start: a join's wait for the running step, or a cold start."""
        if self.server_dispatch is None or self.server_start is None:
            return None
        return self.server_start - self.server_dispatch

    @property
    def cold(self) -> bool:
        """Started on a fresh actor: as the server says (`tier`), or, in records without it, from
        zeroqueue's dispatch to compute start taking longer than a hot actor ever does (a Ray
        worker process start and the first layers' load)."""
        if self.tier is not None:
            return self.tier == "cold"
        placed = self.placed
        return placed is not None and placed > COLD_START_S

    @property
    def warm(self) -> bool:
        """Bound to a warm actor (zeroqueue): its process was up, its first layers in."""
        return self.tier == "warm"

    @property
    def outcome(self) -> str:
        """`ok`, or the status and error type a failure is counted under."""
        if self.ok:
            return "ok"
        return f"{self.status} {self.error}" if self.error else self.status


@dataclass(frozen=True)
class Slo:
    """Good = completed with TTFT <= ttft_s and end to end <= max(e2e_floor_s, e2e_factor × hot service time)."""

    ttft_s: float = 2.0
    e2e_factor: float = 3.0
    e2e_floor_s: float = 1.0

    def e2e_s(self, service_s: float) -> float:
        return max(self.e2e_floor_s, self.e2e_factor * service_s)

    def met(self, r: Record, service_s: float) -> bool:
        return r.ok and r.ttft is not None and r.ttft <= self.ttft_s and r.e2e <= self.e2e_s(service_s)

    def describe(self) -> str:
        return (f"completed with time to first token ≤ {self.ttft_s:g} s and end to end ≤ "
                f"max({self.e2e_floor_s:g} s, {self.e2e_factor:g} × the class's hot service time)")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between ranks (numpy's default); NaN if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(a: float, b: float) -> float:
    """a / b, NaN where either is missing or b is 0."""
    if math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


@dataclass(frozen=True)
class Tail:
    p50: float
    p99: float
    p999: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Tail:
        xs = [v for v in values if v is not None]
        return cls(percentile(xs, 50), percentile(xs, 99), percentile(xs, 99.9), len(xs))

    @property
    def spread(self) -> float:
        """P99 / P50: 1 is a flat tail."""
        return ratio(self.p99, self.p50)


@dataclass(frozen=True)
class Summary:
    offered: int
    completed: int
    rejected: int
    good: int
    cold: int = 0  # completed requests that started on a fresh actor (zeroqueue)
    warm: int = 0  # completed requests bound to a warm actor (zeroqueue)
    failures: dict[str, int] = field(default_factory=dict)  # outcome -> count, rejections included
    ttft: Tail = Tail(math.nan, math.nan, math.nan, 0)
    e2e: Tail = Tail(math.nan, math.nan, math.nan, 0)
    tpot: Tail = Tail(math.nan, math.nan, math.nan, 0)
    wait: Tail = Tail(math.nan, math.nan, math.nan, 0)
    dispatch: Tail = Tail(math.nan, math.nan, math.nan, 0)
    placed: Tail = Tail(math.nan, math.nan, math.nan, 0)
    reject_answer: Tail = Tail(math.nan, math.nan, math.nan, 0)  # how fast 503s came back
    reject_answer_max: float = math.nan
    reject_answers: tuple[float, ...] = ()  # every 503's answer time, sorted
    throughput_rps: float = math.nan
    goodput_rps: float = math.nan

    @property
    def rejection_rate(self) -> float:
        return ratio(self.rejected, self.offered)

    def reject_slower_than(self, bound_s: float) -> int:
        """How many 503s took longer than `bound_s` to come back."""
        return sum(t > bound_s for t in self.reject_answers)

    @property
    def failure_rate(self) -> float:
        """Neither completed nor refused with a 503: errors, timeouts, broken streams."""
        return ratio(self.offered - self.completed - self.rejected, self.offered)


def summarise(records: Sequence[Record], window_s: float, slo: Slo, service_s: Mapping[str, float]) -> Summary:
    """One group of requests (an app, a scenario, perhaps a class) over an offered window of `window_s`."""
    done = [r for r in records if r.ok]
    rejected = [r for r in records if r.rejected]
    failures: dict[str, int] = {}
    for r in records:
        if not r.ok:
            failures[r.outcome] = failures.get(r.outcome, 0) + 1
    good = sum(slo.met(r, service_s[r.cls]) for r in done)
    return Summary(
        offered=len(records),
        completed=len(done),
        rejected=len(rejected),
        good=good,
        cold=sum(r.cold for r in done),
        warm=sum(r.warm for r in done),
        failures=dict(sorted(failures.items())),
        ttft=Tail.of(r.ttft for r in done),
        e2e=Tail.of(r.e2e for r in done),
        tpot=Tail.of(r.tpot for r in done),
        wait=Tail.of(r.wait for r in done),
        dispatch=Tail.of(r.dispatch for r in done),
        placed=Tail.of(r.placed for r in done),
        reject_answer=Tail.of(r.e2e for r in rejected),
        reject_answer_max=max((r.e2e for r in rejected), default=math.nan),
        reject_answers=tuple(sorted(r.e2e for r in rejected)),
        throughput_rps=len(done) / window_s,
        goodput_rps=good / window_s,
    )


def by_class(records: Sequence[Record], classes: Sequence[str], window_s: float, slo: Slo,
             service_s: Mapping[str, float]) -> dict[str, Summary]:
    """A summary per request class present, then `all`."""
    out = {}
    for c in classes:
        group = [r for r in records if r.cls == c]
        if group:
            out[c] = summarise(group, window_s, slo, service_s)
    out["all"] = summarise(records, window_s, slo, service_s)
    return out


@dataclass(frozen=True)
class Bin:
    start: float  # seconds from the schedule's start
    offered: int
    rejected: int
    failed: int  # neither completed nor 503
    ttft_p50: float
    ttft_max: float
    e2e_p50: float


def timeline(records: Sequence[Record], duration_s: float, bin_s: float = 1.0) -> list[Bin]:
    """Requests binned by their arrival time: what each second of the schedule met."""
    n = max(1, math.ceil(duration_s / bin_s))
    groups: list[list[Record]] = [[] for _ in range(n)]
    for r in records:
        groups[min(n - 1, max(0, int(r.t_sched // bin_s)))].append(r)
    bins = []
    for i, g in enumerate(groups):
        ttfts = [r.ttft for r in g if r.ok and r.ttft is not None]
        bins.append(Bin(i * bin_s, len(g), sum(r.rejected for r in g),
                        sum(not r.ok and not r.rejected for r in g),
                        percentile(ttfts, 50), max(ttfts, default=math.nan),
                        percentile([r.e2e for r in g if r.ok], 50)))
    return bins


def closed_loop_rate(records: Sequence[Record], warmup_s: float, window_s: float) -> tuple[int, float]:
    """(completed requests, their rate) over a closed loop's measured window (`window_completions`)."""
    n = len(window_completions(records, warmup_s, window_s))
    return n, n / window_s


def output_tokens_per_s(done: Sequence[Record], window_s: float) -> float:
    """The output tokens of `done` (a window's completions) per second of the window."""
    return sum(r.output_tokens for r in done) / window_s


def window_completions(records: Sequence[Record], warmup_s: float, window_s: float) -> list[Record]:
    """The requests a closed loop completed in its measured window.

    A closed-loop record's `t_sched` is when it was sent, in seconds from the loop's start,
    so the loop's clock is `sent - lag - t_sched`. A request counts when it *ended* inside
    [warmup_s, warmup_s + window_s): completions per second while every client was busy,
    which is the saturation throughput. The warm-up (hot actors spawned, first batches,
    caches touched) is left out.
    """
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    return [r for r in records if r.ok and warmup_s <= r.end - (r.sent - r.lag - r.t_sched) < warmup_s + window_s]
