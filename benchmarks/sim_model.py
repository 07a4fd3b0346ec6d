"""The two simulated engines: zero-queue (the real `decide()`) and the queued baseline, both batching.

Both are discrete-event simulations in simulated seconds: arrivals are generated up front
(sorted); first tokens and row ends sit in a heapq, and at equal times they are handled
before an arrival (so a row freed at t can take a request arriving at t), in the order
they were scheduled.

Batching (the same model in both engines). An actor or replica runs up to `max_batch`
requests at once, one row each. A row's life:

- prefill: until its first token. Alone on an idle actor or replica it takes the request's
  hot TTFT (cold TTFT on a fresh actor); joining a batch that is already running it first
  waits for that batch's next step boundary, charged as one whole step of the batch with
  the row in it (`step_s * slowdown(rows)`, as the rule scorer predicts a join), then takes
  its hot TTFT. Prefill is not slowed by the batch, and does not slow the batch beyond
  counting as one of its rows (the engine's chunked prefill, which adds a joiner's prompt
  tokens to the running rows' steps, is not modelled).
- decode: its `decode_s` (output tokens - 1 one-row steps) stretched by the batch: while
  the batch holds b rows (prefilling or decoding), every step takes `slowdown(b)` one-row
  steps (sim_calibration: `1 + batch_row_cost * (b - 1)`). So every decoding row of a batch
  advances on one clock, in one-row seconds, at rate 1 / slowdown(b); a row ends when that
  clock has advanced by its `decode_s` since its first token, and each change of b (a row
  admitted or ended) re-predicts the batch's next end. A fluid model: progress is
  continuous, not counted in whole steps.

Zero-queue. Every arrival builds its `RequestFeatures` (serve_app.memory.request_features),
asks the cluster (sim_clusters.py: the real `RegistryState`, or the same books kept
incrementally) to decide with `serve_app.policy.decide` and commit, and runs the request as
decided: Dispatch -> alone on the idle hot actor; Join -> one more row of that actor's batch;
Spawn -> alone on a fresh actor, which may be joined from its first token on (`started`);
Reject -> answered at once. Each row's end releases just that row (`finish`). Where every
request states a TPOT target (`tpot_target_s`), `decide` admits a join only where its scorer
predicts the batch's step with the newcomer within every row's target: with the scorer priced
by the calibration (sim_scorer.py) that is the step this model then runs.

Queued baseline. One long-lived replica per slot, weights always resident (every request
prefills at its hot TTFT), a FIFO queue in front (unbounded unless `max_queued`), and Ray
Serve's routing: a request goes to a replica with fewer than `max_ongoing` requests (power
of two choices among those with room, the one with fewer); a replica runs up to `max_batch`
of its requests as one batch and keeps the rest in its own FIFO; when every replica is full
the rest wait in the central FIFO. `max_ongoing = max_batch` is a central FIFO queue in front
of batches that take a request only when they can run it (the best case for a queue);
`max_ongoing = None` sends every request to a replica at once, as Ray Serve LLM does by
default (max_ongoing_requests 1e9): beyond its batch it waits in that replica's own queue,
however busy that replica is.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from actors.sampling_params import SamplingParams
from benchmarks.sim_calibration import ServiceTimes, Workload
from benchmarks.sim_clusters import MODEL
from serve_app.decisions import Decision, Join, Reject, Spawn
from serve_app.memory import ModelNumbers, request_features
from serve_app.policy import PolicyConfig
from serve_app.snapshot import RequestFeatures

REJECT_REASONS = ("no_capacity", "too_large", "latency_target")


@dataclass(eq=False)
class Outcome:
    """Per request, in arrival order. Rejected requests have NaN latencies."""

    ttft_s: np.ndarray
    e2e_s: np.ndarray
    is_rejected: np.ndarray
    is_cold: np.ndarray  # zero-queue: served by an actor spawned for it
    is_joined: np.ndarray  # it joined a batch that was already running
    slot: np.ndarray  # the slot (replica) index that served it, -1 if rejected
    reject_reason: np.ndarray  # index into REJECT_REASONS, -1 if admitted
    # Over the workload's measured window, summed over every actor or replica: seconds it held at least one row,
    # and rows x seconds. Their ratio is the mean rows per busy actor.
    busy_s: float = 0.0
    row_s: float = 0.0

    @classmethod
    def empty(cls, n: int) -> Outcome:
        return cls(np.full(n, np.nan), np.full(n, np.nan), np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool),
                   np.full(n, -1, np.int32), np.full(n, -1, np.int8))

    @property
    def rows_per_busy_actor(self) -> float:
        return self.row_s / self.busy_s if self.busy_s > 0 else math.nan


class Cluster(Protocol):
    policy: PolicyConfig

    def admit(self, features: RequestFeatures, now: float, request: int) -> tuple[Decision, str | None]: ...

    def started(self, name: str) -> None: ...

    def first_token(self, request: int) -> None: ...

    def finish(self, name: str, request: int, now: float) -> None: ...


# ---------------------------------------------------------------- batches in time

_FIRST, _END = 0, 1


class _Batch:
    __slots__ = ("clock", "at", "num_rows", "ends", "version")

    def __init__(self) -> None:
        self.clock = 0.0  # one-row decode seconds every decoding row has advanced, since the batch began
        self.at = 0.0  # when `clock` was last brought up to date
        self.num_rows = 0  # prefilling and decoding
        self.ends: list[tuple[float, int]] = []  # (clock at which the row's decode is done, request)
        self.version = -1  # the order of its one live end event; any other end event of it is stale


class _Rows:
    """Every running row, by batch key (an actor name or a replica index), and their events in time order."""

    def __init__(self, service: ServiceTimes, arrivals: list[float], out: Outcome,
                 on_first: Callable[[object, int, float], None], on_end: Callable[[object, int, float], None],
                 window: tuple[float, float] = (0.0, math.inf)) -> None:
        self.decode = service.decode_s.tolist()
        self.window = window  # where out.busy_s and out.row_s are counted
        self.step_s, self.row_cost = service.step_s, service.batch_row_cost
        self.arrivals, self.out = arrivals, out
        self.on_first, self.on_end = on_first, on_end
        self.batches: dict[object, _Batch] = {}
        self.events: list[tuple[float, int, int, object, int]] = []  # (time, order, kind, key, request/version)
        self._order = 0

    def num_rows(self, key: object) -> int:
        batch = self.batches.get(key)
        return batch.num_rows if batch is not None else 0

    def join_wait_s(self, key: object) -> float:
        """Until the next step boundary of a running batch, with the joining row in it; 0 for an idle one."""
        rows = self.num_rows(key)
        return self.step_s * (1.0 + self.row_cost * rows) if rows else 0.0

    def add(self, key: object, i: int, now: float, first_s: float) -> None:
        """Request i becomes a row of batch `key` at `now`; its first token comes `first_s` later."""
        batch = self.batches.get(key)
        if batch is None:
            batch = self.batches[key] = _Batch()
        self._advance(batch, now)
        batch.num_rows += 1
        self._push(now + first_s, _FIRST, key, i)
        self._reschedule(key, batch, now)

    def run_until(self, now: float) -> None:
        """Handle every event at or before `now`, in time order."""
        events = self.events
        while events and events[0][0] <= now:
            t, _, kind, key, payload = heapq.heappop(events)
            batch = self.batches.get(key)
            if kind == _FIRST:
                self.out.ttft_s[payload] = t - self.arrivals[payload]
                self._advance(batch, t)
                heapq.heappush(batch.ends, (batch.clock + self.decode[payload], payload))
                self._reschedule(key, batch, t)
                self.on_first(key, payload, t)
            elif batch is not None and payload == batch.version:
                self._advance(batch, t)
                _, i = heapq.heappop(batch.ends)
                batch.num_rows -= 1
                if batch.num_rows:
                    self._reschedule(key, batch, t)
                else:
                    del self.batches[key]
                self.out.e2e_s[i] = t - self.arrivals[i]
                self.on_end(key, i, t)

    def _advance(self, batch: _Batch, now: float) -> None:
        if batch.num_rows:
            batch.clock += (now - batch.at) / (1.0 + self.row_cost * (batch.num_rows - 1))
            # The batch held num_rows rows since `at` (every change of it comes through here): count the
            # part of that inside the measured window.
            inside = min(now, self.window[1]) - max(batch.at, self.window[0])
            if inside > 0:
                self.out.busy_s += inside
                self.out.row_s += inside * batch.num_rows
        batch.at = now

    def _reschedule(self, key: object, batch: _Batch, now: float) -> None:
        # Versions are unique over the run, not per batch: a batch that drains and starts again under
        # the same key must not take a stale end of its earlier life for its own.
        batch.version = self._order
        if batch.ends:
            left = max(0.0, batch.ends[0][0] - batch.clock)
            self._push(now + left * (1.0 + self.row_cost * (batch.num_rows - 1)), _END, key, batch.version)
        else:
            self._order += 1

    def _push(self, t: float, kind: int, key: object, payload: int) -> None:
        heapq.heappush(self.events, (t, self._order, kind, key, payload))
        self._order += 1


# ---------------------------------------------------------------- the engines


def run_zero_queue(workload: Workload, service: ServiceTimes, cluster: Cluster, numbers: ModelNumbers,
                   tpot_target_s: float | None = None) -> Outcome:
    """Every arrival decided by `cluster` and run as decided (module doc). `tpot_target_s`: the TPOT every request
    states; `decide` then admits a join only where the scorer predicts the batch within every row's target."""
    arrivals, ins, outs = workload.arrival_s.tolist(), workload.input_tokens.tolist(), workload.output_tokens.tolist()
    hot, cold = service.hot_ttft_s.tolist(), service.cold_ttft_s.tolist()
    out = Outcome.empty(len(arrivals))
    is_cold = out.is_cold

    def on_first(name: object, i: int, now: float) -> None:
        if is_cold[i]:  # every weight is resident now: the actor may batch
            cluster.started(name)  # type: ignore[arg-type]
        cluster.first_token(i)

    def on_end(name: object, i: int, now: float) -> None:
        cluster.finish(name, i, now)  # type: ignore[arg-type]

    rows = _Rows(service, arrivals, out, on_first, on_end, (workload.warmup_s, workload.horizon_s))
    policy = cluster.policy
    for i, now in enumerate(arrivals):
        rows.run_until(now)
        # The simulated requests ask for a length, and a TPOT where given: the API's default sampling otherwise.
        features = request_features(MODEL, numbers, ins[i], SamplingParams(max_tokens=outs[i]), policy,
                                    tpot_target_s=tpot_target_s)
        decision, name = cluster.admit(features, now, i)
        if isinstance(decision, Reject):
            out.is_rejected[i] = True
            out.reject_reason[i] = REJECT_REASONS.index(decision.reason)
            continue
        if isinstance(decision, Spawn):
            first = cold[i]
            is_cold[i] = True
        else:
            first = rows.join_wait_s(name) + hot[i]
            out.is_joined[i] = isinstance(decision, Join)
        out.slot[i] = int(decision.slot_id[1:])
        rows.add(name, i, now, first)
    rows.run_until(math.inf)  # every admitted request ends, so every row is released
    return out


def run_queued(workload: Workload, service: ServiceTimes, num_replicas: int, max_ongoing: int | None = 1,
               max_queued: int | None = None, seed: int = 0, max_batch: int = 1) -> Outcome:
    """The queued baseline (module doc). `max_queued=None`: an unbounded central FIFO, Ray Serve's default;
    `max_ongoing=None`: no limit per replica."""
    if (num_replicas < 1 or max_batch < 1 or (max_ongoing is not None and max_ongoing < 1)
            or (max_queued is not None and max_queued < 0)):
        raise ValueError(f"need num_replicas, max_batch, max_ongoing >= 1 and max_queued >= 0; got "
                         f"{num_replicas}, {max_batch}, {max_ongoing}, {max_queued}")
    rng = random.Random(seed)
    arrivals = workload.arrival_s.tolist()
    hot = service.hot_ttft_s.tolist()
    out = Outcome.empty(len(arrivals))
    cap = max_ongoing if max_ongoing is not None else len(arrivals) + 1
    ongoing = [0] * num_replicas  # running and waiting in the replica's own queue
    local: list[deque[int]] = [deque() for _ in range(num_replicas)]  # assigned, waiting for a free row
    room, where = list(range(num_replicas)), list(range(num_replicas))  # replicas with room; index in `room`
    central: deque[int] = deque()

    def start(i: int, r: int, now: float) -> None:
        out.slot[i], out.is_joined[i] = r, rows.num_rows(r) > 0
        rows.add(r, i, now, rows.join_wait_s(r) + hot[i])

    def assign(i: int, now: float) -> None:
        if len(room) >= 2:  # power of two choices among the replicas with room
            a, b = rng.sample(room, 2)
            r = a if ongoing[a] <= ongoing[b] else b
        else:
            r = room[0]
        ongoing[r] += 1
        if ongoing[r] == cap:  # swap-remove from `room`
            last = room.pop()
            if last != r:
                room[where[r]], where[last] = last, where[r]
        if rows.num_rows(r) < max_batch:
            start(i, r, now)
        else:
            local[r].append(i)

    def on_end(r: object, i: int, now: float) -> None:
        ongoing[r] -= 1  # type: ignore[index]
        if ongoing[r] == cap - 1:  # type: ignore[index]
            where[r] = len(room)  # type: ignore[index]
            room.append(r)  # type: ignore[arg-type]
        if local[r]:  # type: ignore[index]
            start(local[r].popleft(), r, now)  # type: ignore[index, arg-type]
        while central and room:
            assign(central.popleft(), now)

    rows = _Rows(service, arrivals, out, lambda r, i, now: None, on_end, (workload.warmup_s, workload.horizon_s))
    for i, now in enumerate(arrivals):
        rows.run_until(now)
        if room and not central:
            assign(i, now)
        elif max_queued is None or len(central) < max_queued:
            central.append(i)
        else:
            out.is_rejected[i] = True
            out.reject_reason[i] = 0  # Serve's own 503 when its queue is full
    rows.run_until(math.inf)
    return out
