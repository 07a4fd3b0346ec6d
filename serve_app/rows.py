"""A placed request's row, from its placement to its release, released exactly once.

Admission (admission.py) decides and places a request, then hands its `Admitted` record
here (`begin`); the relay (relay.py) tells this module what the actor's stream did — the
first token (`first_token`), the `Completion` (`completed`) — and how the request ended
(`end`). Nothing here calls back up: the relay and admission call down into it.

However a request ends, `end` runs its release once:

    "complete"   the Completion arrived (the actor has already let the row go)
    "cancelled"  the client left, or the actor turned the row away before it started
                 (its batch was full after all): only this row is given up, once the
                 actor's stream has ended (released earlier, a new row could be sent to a
                 batch the actor still sees full)
    "failed"     the actor died, failed, or missed a deadline: the registry forgets it and
                 kills it; it is not trusted again

A row leased to this replica (lease_book.py) goes back to the lease book, free for the next
request, with no registry call; only a failed actor is reported (the registry kills it).

It also keeps what a new registry incarnation is handed (`handed_over`): the rows still
running here, the leased rows, and the hot actors this replica last saw go idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from actors.messages import Completion, Started
from serve_app import traces
from serve_app.cluster import ActorStream, Cluster
from serve_app.decisions import Decision, Spawn
from serve_app.errors import ApiError
from serve_app.lease_book import LeaseBook
from serve_app.metrics import IngressMetrics
from serve_app.offload import within
from serve_app.policy import PolicyConfig
from serve_app.registry import AdoptedActor, AdoptedRow, Outcome
from serve_app.retry_line import RetryLines
from serve_app.snapshot import RequestFeatures
from serve_app.ttft_check import TtftCheck

log = logging.getLogger(__name__)

# Idle hot actors remembered for a new registry: more than a cluster's slots ever hold at once.
MAX_IDLE_KNOWN = 1024


@dataclass
class Admitted:
    """A request that holds a row on an actor, and the actor's stream of its answer.

    Admission creates it; the relay records the stream's progress (`started`, `num_chunks`,
    `completion`, `error`); `Rows.end` records the `outcome`, once.
    """

    request_id: str
    model_id: str
    actor_name: str
    keep_hot: bool
    tier: str  # "hot" (an idle or batching actor), "warm" (a bound warm actor) or "cold" (a fresh one)
    input_tokens: int
    stream: ActorStream
    arrival: float
    dispatch_time: float
    features: RequestFeatures | None = None
    decision: Decision | None = None
    resident_bytes: int = 0  # the actor's weights and process overhead, as the registry holds them
    # Epoch seconds at the ingress, for the Server-Timing header: parsed and tokenized, decided,
    # the actor's Started received, the whole answer received (a collected one).
    prepared_at: float = 0.0
    decided_at: float = 0.0
    started_at: float = 0.0
    answered_at: float = 0.0
    # Its first TextChunk received here: the actor sampled the token at `Completion.timings.first_token`, and
    # what lies between (the actor's event loop, Ray's stream, this replica's loop) the client waits for too.
    first_token_at: float = 0.0
    started: Started | None = None
    completion: Completion | None = None
    num_chunks: int = 0
    error: ApiError | None = None  # the error event a stream ended with, if it did
    outcome: Outcome | None = None  # set once, by `Rows.end`
    lease_row: str | None = None  # the leased row it runs in (lease_book.py): it goes back there, not to the registry
    is_turned_away: bool = False  # its actor refused the leased row (StreamBusy): the row is forgotten


class Rows:
    def __init__(self, cluster: Cluster, leases: LeaseBook, metrics: IngressMetrics, policy: PolicyConfig,
                 replica_id: str, ttft_check: TtftCheck | None, retry_lines: RetryLines, *,
                 drain_timeout_s: float, traces_writer: traces.TraceWriter | None) -> None:
        self._cluster, self._leases, self._metrics, self._policy = cluster, leases, metrics, policy
        self._ttft_check = ttft_check  # None: predictions are not corrected, nor their corrections learned
        self._retry_lines = retry_lines  # told each row's end: how fast places free here
        self._replica_id = replica_id
        self._drain_timeout_s = drain_timeout_s
        self._traces = traces_writer
        self._running: dict[str, Admitted] = {}  # request id -> the request, from placement to its end
        self._idle: dict[str, AdoptedActor] = {}  # hot actors this replica last saw go idle
        self._releasing: set[asyncio.Task] = set()  # rows given up, released once their stream has ended
        self._num_freed: dict[str, int] = {}  # model -> rows of it released so far (Admission.refuse_early)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def num_running_of(self, model_id: str) -> int:
        return sum(1 for a in self._running.values() if a.model_id == model_id)

    def num_freed(self, model_id: str) -> int:
        """How many rows of the model this replica has released: a place freed since a count was read."""
        return self._num_freed.get(model_id, 0)

    def begin(self, admitted: Admitted) -> None:
        self._running[admitted.request_id] = admitted

    def taken(self, actor_name: str) -> None:
        """An idle actor was dispatched to, or evicted: it is not idle any more (or not at all)."""
        self._idle.pop(actor_name, None)

    def started(self, admitted: Admitted, started: Started) -> None:
        """The actor began computing the request: its engine's step correction prices its next joins."""
        if self._ttft_check is not None:
            self._leases.note_step_correction(admitted.actor_name, started.step_correction, started.step_baseline)

    def first_token(self, admitted: Admitted) -> None:
        now = admitted.first_token_at = time.time()
        if admitted.lease_row is not None:  # its prompt is computed: a joiner's no longer waits behind it
            self._leases.prompt_done(admitted.lease_row)
        predicted = getattr(admitted.decision, "prediction", None)
        candidate = getattr(admitted.decision, "candidate", None)
        if self._ttft_check is not None and predicted is not None and candidate is not None:
            # Its kind's next predictions learn from it at once, not when it ends.
            self._ttft_check.observe(admitted.model_id, candidate.kind, now - admitted.arrival, predicted.ttft_s, now)
        if admitted.tier == "hot":
            return
        # Every weight is resident now: starting -> busy, and it may batch. On a start lease the registry
        # hears it with the next lease report instead of a call.
        if admitted.lease_row is not None:
            self._leases.started(admitted.lease_row)
        else:
            self._cluster.actor_started(admitted.actor_name)

    def completed(self, admitted: Admitted, done: Completion) -> None:
        admitted.completion = done
        t, model = done.timings, admitted.model_id
        if t.first_token is not None:
            ttft = t.first_token - admitted.arrival
            self._metrics.ttft.observe(ttft, tags={"model": model, "kind": admitted.tier})
            predicted = getattr(admitted.decision, "prediction", None)
            if predicted is not None and predicted.ttft_s > 0:
                self._metrics.observe_ttft_ratio(model, admitted.tier, ttft / predicted.ttft_s)
            if admitted.tier == "cold":
                self._metrics.cold_start.observe(t.first_token - t.actor_start, tags={"model": model})
            if admitted.first_token_at:
                self._metrics.first_token_delivery.observe(max(0.0, admitted.first_token_at - t.first_token),
                                                           tags={"model": model})
        if t.last_token is not None and done.output_tokens > 1:
            self._metrics.tpot.observe((t.last_token - t.first_token) / (done.output_tokens - 1),
                                       tags={"model": model})
        density = done.compute_density(admitted.arrival)
        if density is not None:
            self._metrics.observe_density(model, admitted.tier, density, done.mean_step_rows, done.mean_step_threads)
        if done.predicted_step_s > 0 and done.checked_step_s > 0:
            self._metrics.observe_step_ratio(model, done.checked_step_s / done.predicted_step_s)

    def end(self, admitted: Admitted, outcome: Outcome) -> None:
        """Release the request's row, the first time only (later calls are no-ops)."""
        if admitted.outcome is not None:
            return
        admitted.outcome = outcome
        self._running.pop(admitted.request_id, None)
        if admitted.error is not None:  # an error event ended its stream: counted as a response's error is
            self._metrics.errors.inc(tags={"type": admitted.error.type})
        if outcome == "complete":  # the actor let the row go before it sent the Completion
            self._finish(admitted, outcome)
        else:
            admitted.stream.cancel()  # the row leaves the batch at the actor's next step
            if admitted.lease_row is not None:  # so its prompt delays no joiner now, nor is it overdue
                self._leases.prompt_done(admitted.lease_row)
            if outcome == "failed":
                self._cluster.forget(admitted.actor_name)
                self._finish(admitted, outcome)  # the registry forgets the actor and kills it
            else:
                task = asyncio.get_running_loop().create_task(self._finish_when_gone(admitted, outcome))
                self._releasing.add(task)
                task.add_done_callback(self._releasing.discard)
        if admitted.decision is not None:
            ok = outcome == "complete"
            record = traces.outcome_record(admitted.arrival, admitted.dispatch_time,
                                           admitted.decision.reserve_bytes, admitted.completion if ok else None,
                                           None if ok else outcome, first_token_seen_at=admitted.first_token_at)
            self.trace(admitted.request_id, admitted.model_id, admitted.arrival, admitted.features,
                       admitted.decision, record)

    def trace(self, request_id: str, model: str, arrival: float, features, decision, outcome) -> None:
        """One trace line for the scorer's training (refusals too), if traces are on."""
        if self._traces is None:
            return
        try:  # a trace is never worth a request
            self._traces.write(traces.trace_record(request_id, model, arrival, features, decision, outcome))
        except Exception:
            log.exception("trace of request %s not recorded", request_id)

    def handed_over(self) -> tuple[list[AdoptedRow], list[AdoptedActor]]:
        """What a new registry incarnation is given: the rows running here, every leased row (running or
        free), and the idle hot actors."""
        rows = [self._adopted_row(a) for a in list(self._running.values())
                if a.decision is not None and a.lease_row is None]
        return rows + self._leases.handed_over(), list(self._idle.values())

    async def _finish_when_gone(self, admitted: Admitted, outcome: Outcome) -> None:
        try:
            await within(admitted.stream.drain(), self._drain_timeout_s)
        except Exception:  # cancelled, failed or timed out: the actor's row is gone or the actor is
            pass
        self._finish(admitted, outcome)

    def release_lease(self, row_id: str) -> None:
        """A leased row whose request ended is free again: ours, with no registry call — or, while its model is
        contended, given back at once, since another replica may need it."""
        if self._leases.release(row_id):
            self._cluster.give_back((row_id,))

    def _finish(self, admitted: Admitted, outcome: Outcome) -> None:
        self._num_freed[admitted.model_id] = self.num_freed(admitted.model_id) + 1
        self._retry_lines.row_ended(admitted.model_id, time.monotonic())
        if admitted.lease_row is not None:
            if outcome == "failed":  # the registry forgets the actor, every lease on it included, and kills it
                self._cluster.finish(admitted.actor_name, admitted.lease_row, outcome)
                self._leases.drop_actor(admitted.actor_name)
            elif admitted.is_turned_away:  # recalled by the registry, or a batch fuller than we knew
                self._leases.forget(admitted.lease_row)
            elif self._leases.is_unstarted_start(admitted.lease_row):  # bound or spawned, never started: it goes,
                self._cluster.finish(admitted.actor_name, admitted.lease_row, outcome)  # as a cold row's actor does
                self._leases.forget(admitted.lease_row)
            else:
                self.release_lease(admitted.lease_row)
        else:
            self._cluster.finish(admitted.actor_name, admitted.request_id, outcome)
        if outcome == "complete" and admitted.keep_hot and admitted.decision is not None:
            d = admitted.decision
            self._idle[admitted.actor_name] = AdoptedActor(admitted.actor_name, admitted.model_id, d.slot_id,
                                                           d.lane, admitted.resident_bytes)
            while len(self._idle) > MAX_IDLE_KNOWN:  # actors retired elsewhere leave their records
                del self._idle[next(iter(self._idle))]
        if outcome != "complete" or not admitted.keep_hot:
            self._idle.pop(admitted.actor_name, None)
            if outcome == "complete":  # it exits by itself after its last row
                self._cluster.forget(admitted.actor_name)
            self._cluster.wake_warm()  # a pool may refill on the slot freed

    def _adopted_row(self, a: Admitted) -> AdoptedRow:
        d, f = a.decision, a.features
        request = d.reserve_bytes - a.resident_bytes if isinstance(d, Spawn) else d.reserve_bytes
        is_started = a.tier == "hot" or a.num_chunks > 0
        return AdoptedRow(a.actor_name, a.model_id, d.slot_id, d.lane, d.keep_hot, is_started, a.resident_bytes,
                          a.request_id, request, f.num_tokens, f.tpot_target_s,
                          d.prediction.total_s + a.arrival if d.prediction is not None else a.arrival,
                          self._policy.busy_timeout_s(f, not is_started), self._replica_id)

