"""Admission: decide and place one request, and hand its row to the relay and to rows.py.

The ingress (app.py) validates a request and hands it here; everything it asks of the
world goes through the cluster port (cluster.py: Ray's, or the in-process one):
  1. decide: first on this replica's leases (lease_book.py) — rows of hot actors it holds, and
     its start leases (a warm actor to bind, slot bytes to spawn into), placed with the same pure
     `decide()` and no registry call; where they cannot place the request, the slow path: `cluster.admit(features)`, the registry's `decide()` and the
     reservation it implies in one atomic step (no replica can over-commit a slot or a batch),
     which leases a row it places on a hot actor to this replica — or a 503 at once when the
     registry does not answer within its deadline;
  2. act: open the actor's stream — on the idle hot actor, as one more row of a hot
     actor's batch, on a bound warm actor, or on an actor created on the reserved slot
     (after killing the idle actors the decision evicts) — or refuse with 503
     `overloaded_error` and the registry's predicted `retry-after`;
  3. wait for the actor's `Started` (relay.py); from then on the row is the relay's, and
     rows.py releases it once however it ends (a leased row back to the lease book).

Once a heartbeat, `_exchange_leases` sends the lease book's report and applies the grant (the
registry's counts come with it, for the gauges).

What a request reserved is given back on every path: a refusal commits nothing; a client
that leaves (or a deadline) while the decision or the placement is in flight abandons it
(the registry undoes an admission it sees after its abandonment too); once the relay owns
the row, `Rows.end` runs exactly once. An actor lost before the client saw anything of
its answer costs one attempt, and the request is decided again (`run`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from actors.actor_names import new_actor_name
from actors.messages import ActorRequest, Completion
from serve_app import errors, traces
from serve_app.cluster import ActorGone, Cluster, NewActor, RegistryUnavailable
from serve_app.config import IngressConfig
from serve_app.decisions import Bind, Decision, Reject, Spawn
from serve_app.demand import DemandCounter, refused_hold_s
from serve_app.lease import LeasedRow, SlowPathLease
from serve_app.lease_book import LeaseBook
from serve_app.loaded_model import LoadedModel
from serve_app.metrics import IngressMetrics
from serve_app.registry import is_leased_row
from serve_app.relay import LOST_RETRY_AFTER_S, ActorLost, Relay
from serve_app.retry_line import RetryLines
from serve_app.rows import Admitted, Rows
from serve_app.scorer import Scorer
from serve_app.snapshot import ClusterSnapshot, ClusterSummary, summarize
from serve_app.ttft_check import TtftCheck, TtftCorrection, corrected
from serve_app.warm_pool import models_without_a_ready_actor

log = logging.getLogger(__name__)

# A request whose actor is lost before the client saw its answer is decided again, up to this many
# tries in all (a warm pool lost at once, its node gone, costs one try per dead actor still listed).
MAX_ATTEMPTS = 3


class Admission:
    def __init__(self, config: IngressConfig, models: dict[str, LoadedModel], cluster: Cluster,
                 metrics: IngressMetrics, replica_id: str, scorer: Scorer) -> None:
        self.config, self.models, self.cluster, self.metrics = config, models, cluster, metrics
        self.scorer = scorer
        # Measured ÷ predicted TTFT per placement kind, learned from this replica's requests: the scorer's
        # predictions are corrected by it, here and in the registry's slow path (ttft_check.py).
        self.ttft_check = TtftCheck(config.ttft_check)
        self.leases = LeaseBook(config.leases, replica_id, config.policy.max_batch, config.registry_heartbeat_s,
                                config.rule_scorer.node_cpus)
        # Per model: the places this replica's refusals were told, and how fast its rows end (retry_line.py).
        self.retry_lines = RetryLines(config.policy)
        self.rows = Rows(cluster, self.leases, metrics, config.policy, replica_id,
                         self.ttft_check if config.is_prediction_corrected else None, self.retry_lines,
                         drain_timeout_s=config.token_timeout_s,
                         traces_writer=traces.TraceWriter(config.traces) if config.traces is not None else None)
        self.relay = Relay(config.start_timeout_s, config.token_timeout_s, self.rows)
        # model -> its early-refusal window, set by a slow-path refusal for want of capacity (`refuse_early`).
        self._refused: dict[str, _EarlyRefusal] = {}
        # Refusals and admissions since the last lease exchange, for the registry's capacity planner.
        self.demand = DemandCounter()
        self.last_summary: ClusterSummary | None = None  # the registry's counts from the last exchange
        cluster.start(self.rows.handed_over)
        try:
            self._gauges: asyncio.Task | None = asyncio.get_running_loop().create_task(self._exchange_leases())
        except RuntimeError:  # no event loop: constructed outside a Serve replica (tests of the class itself)
            self._gauges = None

    async def wait_for_ready_actors(self, timeout_s: float, poll_s: float = 0.2) -> set[str]:
        """Until every served model that keeps a warm pool has an actor that can take a request now, or
        `timeout_s`: a fresh deployment then answers its first requests instead of refusing them while its
        first warm actors start. The models still without one when it gives up (then refused, as starting)."""
        deadline = time.monotonic() + timeout_s
        waiting = set(self.models)
        while True:
            try:  # the probe's deadline: a registry still starting up answers late without being gone
                snap = await self.cluster.snapshot(self.config.registry_probe_timeout_s)
                waiting = models_without_a_ready_actor(snap, waiting, self.config.policy)
            except Exception as e:  # the registry still starting, or slow: asked again
                log.info("waiting for the first warm actors: no snapshot yet (%s)", e)
            if not waiting or time.monotonic() >= deadline:
                return waiting
            await asyncio.sleep(poll_s)

    @property
    def num_running(self) -> int:
        return self.rows.num_running

    async def close(self) -> None:
        """The replica stops: stop refilling, and detach (the last replica takes every actor with it)."""
        if self._gauges is not None:
            self._gauges.cancel()
        await self.cluster.close()

    def summary(self, snap: ClusterSnapshot) -> ClusterSummary:
        """The registry's view in counts; the gauges follow it (also set each heartbeat, below)."""
        summary = summarize(snap, self.config.policy.max_batch)
        self.metrics.set_cluster(summary)
        return summary

    async def _exchange_leases(self) -> None:
        """Each heartbeat: the lease book's report out, its grant in, and the gauges set from the registry's
        counts that come with it (dashboards see them whether or not /health is polled). On the event loop,
        as admissions are: calls one caller makes to the registry from two threads can reach it out of
        order, and Ray then holds that caller's later calls (registry_actor.admit)."""
        while True:
            await asyncio.sleep(self.config.registry_heartbeat_s)
            await self._exchange_once()

    async def _exchange_once(self) -> None:
        """One exchange; never raises (leases not renewed run on until they expire)."""
        if not self.cluster.is_available:
            return
        sent_at = time.monotonic()
        report = dataclasses.replace(self.leases.report(sent_at), demand=self.demand.take())
        try:
            grant = await self.cluster.exchange_leases(report, self.config.registry_timeout_s * 4)
        except Exception:  # the registry is restarting or busy: the leases run on until they expire
            log.debug("leases not exchanged this round", exc_info=True)
            self.demand.put_back(report.demand)
            return
        self.leases.apply(report, grant, sent_at)
        spare = self.leases.give_back_contended()
        if spare:  # the registry lacks rows for these models: not held idle here until the next heartbeat
            self.cluster.give_back(spare)
        self.metrics.leased_rows.set(self.leases.num_rows)
        if grant.summary is not None:
            self.metrics.set_cluster(grant.summary)
            self.last_summary = grant.summary

    def refuse_early(self, model_id: str) -> None:
        """Raise the 503 at once — before the request is tokenized, and with no registry call — when the
        registry refused this model for want of capacity within the last `early_refusal_s`. A burst over
        capacity is refused at the cost of parsing its JSON; a place freed on another replica meanwhile is
        missed for at most `early_refusal_s`.

        When the window ends, or a row of the model ends here (a place for one request), the first request
        goes on to look again (the probe) and the others are still refused early until it has its decision:
        a steady overload then costs the registry one call per window or freed row, not one per request in
        flight at that moment. No request arriving within another `early_refusal_s` of the window's end
        means the burst is over: the window is forgotten, so requests after a lull are never refused on an
        old answer."""
        window = self._refused.get(model_id)
        if window is None:
            return
        now = time.monotonic()
        is_freed = self.leases.has_free(model_id) or self.rows.num_freed(model_id) != window.num_freed
        if window.probe_until is not None and now < window.probe_until:
            pass  # a probe is in flight: the others wait for its decision, refused
        elif now < window.until and not is_freed:
            pass  # within the window, and no place of the model freed here since
        elif now >= max(window.until, window.probe_until or 0.0) + self.config.early_refusal_s:
            del self._refused[model_id]  # a lull: nobody came as the window (or a lost probe) ended
            return
        else:  # this request is the probe; one that never reaches a decision is replaced after a deadline
            window.probe_until = now + self.config.registry_timeout_s
            return
        self.metrics.rejections.inc(tags={"reason": "no_capacity_early"})
        self.demand.refused(model_id, window.lane, window.hold_s)
        raise errors.overloaded(f"{model_id}: no idle actor, batch row or free slot now",
                                self._retry_after_s(model_id, window.retry_at - now, window.hold_s, now))

    def _retry_after_s(self, model_id: str, earliest_s: float, hold_s: float, now: float) -> float:
        """A refusal's retry-after: the place after the last one this replica told (retry_line.py)."""
        gap_s = hold_s / max(1, self.rows.num_running_of(model_id))
        return self.retry_lines.tell(model_id, earliest_s, gap_s, now)

    async def run(self, model: LoadedModel, features, actor_request: ActorRequest, arrival: float, *,
                   is_collected: bool, prepared_at: float = 0.0) -> tuple[Admitted, tuple[str, Completion] | None]:
        """Place the request; with `is_collected`, also its whole answer. Raises ApiError.

        An actor lost before the client saw anything of its answer — dead before it started
        (a warm or idle one that died unseen), or, for an answer collected whole, at any
        point — costs an attempt: its row was released as failed, which forgot and killed
        it, and the request is decided again on what is left, up to MAX_ATTEMPTS in all;
        then it is a 503 with retry-after, never a 500.
        """
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                admitted = await self._place(model, features, actor_request, arrival, prepared_at)
                return admitted, (await self.relay.collect(admitted) if is_collected else None)
            except ActorLost as lost:
                log.warning("request %s: its actor was lost (attempt %d of %d)", actor_request.request_id,
                            attempt, MAX_ATTEMPTS)
                if attempt == MAX_ATTEMPTS:
                    raise errors.overloaded(lost.message, LOST_RETRY_AFTER_S) from None
                # A lost node's slots are gone before the next decision.
                await self.cluster.reconcile(self.config.registry_timeout_s * 4)
        raise AssertionError("unreachable")

    async def _place(self, model: LoadedModel, features, actor_request: ActorRequest, arrival: float,
                     prepared_at: float) -> Admitted:
        """One decision and the action it names; returns once the actor has started computing.

        Raises ActorLost if the actor was dead before it started. Whatever the admission
        reserved is given back if this ends any other way before the relay owns the row
        (a deadline, or the client leaving).
        """
        request_id = actor_request.request_id
        spawn_name = new_actor_name(model.id)
        hot_resident = model.numbers.weight_bytes + self.config.policy.actor_overhead_bytes  # its weights and process
        correction = self.ttft_check.correction(model.id, time.time()) if self.config.is_prediction_corrected else None
        placed = self.leases.place(features, self.config.policy, corrected(self.scorer, correction), time.time())
        decision, lease = placed if placed is not None else (None, None)
        if decision is None:
            decision = await self._admit(features, spawn_name, request_id, correction)
            if self.config.leases.is_enabled and is_leased_row(decision):
                lease = LeasedRow(request_id, decision.actor_name, model.id, decision.slot_id, decision.lane,
                                  decision.reserve_bytes, hot_resident)
                self.leases.add(lease, features, _predicted_end(decision), decision=decision)
        if isinstance(decision, (Bind, Spawn)):  # rows ran out: this replica wants a start lease for the next
            policy = self.config.policy
            self.leases.note_start(model.id, decision.lane, features.dispatch_bytes, hot_resident,
                                   policy.max_hot(model.id, decision.lane), policy.num_warm(model.id, decision.lane))
        if isinstance(decision, Spawn) and lease is not None:
            spawn_name = lease.actor_name  # the actor its spawn lease committed
        decided_at = time.time()
        self._refused.pop(model.id, None)  # the probe has its answer (a refusal opens a new window below)
        path = "registry" if lease is None or lease.row_id == request_id else "lease"
        self.metrics.admission_paths.inc(tags={"path": path})
        self.metrics.decisions.inc(tags={"model": model.id, "kind": type(decision).__name__.lower()})
        if isinstance(decision, Reject):
            self.metrics.rejections.inc(tags={"reason": decision.reason})
            hold_s = refused_hold_s(features, self.config.rule_scorer)
            if decision.reason == "no_capacity":
                lane = self.config.policy.lane(features.input_tokens, features.max_tokens)
                self.demand.refused(model.id, lane, hold_s)
                if decision.retry_after_s is not None:
                    now = time.monotonic()
                    self._refused[model.id] = _EarlyRefusal(
                        now + self.config.early_refusal_s, now + decision.retry_after_s,
                        self.rows.num_freed(model.id), lane, hold_s)
            self.metrics.observe_dispatch(model.id, time.time() - arrival)
            self.rows.trace(request_id, model.id, arrival, features, decision, None)
            if decision.http_status == 400:
                raise errors.invalid_request(decision.message)
            retry_after_s = decision.retry_after_s or self.config.policy.retry_after_s
            raise errors.overloaded(decision.message,
                                    self._retry_after_s(model.id, retry_after_s, hold_s, time.monotonic()))
        rows = decision.candidate.batch_rows + 1 if decision.candidate is not None else 1
        self.metrics.batch_rows.observe(rows, tags={"model": model.id})
        self.metrics.admissions.inc(tags={"model": model.id, "tier": _tier(decision)})
        # The TTFT target goes with it: the engine feeds its prompt no slower than keeps its first token due.
        due = None if features.ttft_target_s is None else arrival + features.ttft_target_s
        actor_request = dataclasses.replace(actor_request, keep_hot=decision.keep_hot, first_token_due=due)
        name = spawn_name if isinstance(decision, Spawn) else decision.actor_name
        new = NewActor(model.zqs_path, decision.node_id, decision.evict) if isinstance(decision, Spawn) else None
        for taken in (decision.evict if new is not None else (name,)):
            self.rows.taken(taken)  # an idle actor is busy now, evicted, or lost
        try:
            stream = await self.cluster.open(name, actor_request, new)
        except ActorGone:  # it died and the registry has not noticed yet
            self.cluster.finish(name, request_id if lease is None else lease.row_id, "failed")  # forget it
            self.leases.drop_actor(name)
            raise ActorLost(503, "overloaded_error", "the model's process was lost; retry") from None
        except BaseException:  # a deadline, or the client left: nothing was sent, give the row back
            if lease is not None and self.leases.is_unstarted_start(lease.row_id):
                # A bind or spawn on a start lease: the actor may be starting for it, so it goes (and is killed).
                self.cluster.finish(name, lease.row_id, "cancelled")
                self.leases.forget(lease.row_id)
            elif lease is not None and lease.row_id != request_id:
                self.rows.release_lease(lease.row_id)  # ours: nobody else was told
            else:
                self.leases.forget(request_id)  # the registry takes the row back, leased or not
                self.cluster.abandon(request_id)
            raise
        if new is not None and new.evict:
            self.metrics.evictions.inc(len(new.evict), tags={"model": model.id})
        if isinstance(decision, Bind):
            self.cluster.wake_warm()  # its pool is one short now
        dispatch_time = time.time()
        self.metrics.observe_dispatch(model.id, dispatch_time - arrival)
        resident = decision.resident_bytes if isinstance(decision, Spawn) else hot_resident
        admitted = Admitted(request_id, model.id, name, decision.keep_hot, _tier(decision),
                            len(actor_request.prompt_ids), stream, arrival=arrival, dispatch_time=dispatch_time,
                            features=features, decision=decision, resident_bytes=resident,
                            prepared_at=prepared_at or arrival, decided_at=decided_at,
                            lease_row=lease.row_id if lease is not None else None)
        self.rows.begin(admitted)
        await self.relay.first(admitted)
        return admitted

    async def _admit(self, features, spawn_name: str, request_id: str, correction: TtftCorrection | None = None):
        """The registry's decision, or a 503 at once when it does not answer in time (or is known not to
        answer: until the cluster's next heartbeat is answered, nothing is asked)."""
        if not self.cluster.is_available:
            raise self._registry_unavailable()
        try:
            lease = None
            if self.config.leases.is_enabled:  # its free rows of the model could not take it: they go back
                lease = SlowPathLease(self.leases.ttl_s, self.leases.give_back_free(features.model),
                                      self.leases.in_use(features.model), self.leases.step_corrections())
            return await self.cluster.admit(features, spawn_name, request_id, lease, correction)
        except asyncio.CancelledError:  # the client left: whatever the admission commits is undone
            self.cluster.abandon(request_id)
            raise
        except RegistryUnavailable as e:
            self.cluster.abandon(request_id)  # an answer that comes late commits nothing
            log.warning("request %s: the registry did not decide in time (%s)", request_id, e)
            raise self._registry_unavailable() from None

    def _registry_unavailable(self) -> errors.ApiError:
        self.metrics.rejections.inc(tags={"reason": "registry_unavailable"})
        # Back within a heartbeat or two (a restart, or a new registry) when it comes back at all.
        return errors.overloaded("the admission registry is unavailable; retry shortly",
                                 max(self.config.policy.retry_after_s, self.config.registry_heartbeat_s))


@dataclasses.dataclass(slots=True)
class _EarlyRefusal:
    """A model's early-refusal window (Admission.refuse_early)."""

    until: float  # monotonic: refused early until then
    retry_at: float  # monotonic: the place the slow path's refusal was told
    num_freed: int  # Rows.num_freed(model) at the refusal: a row ended since sends a probe
    lane: str  # the refused request's: early refusals count as its lane's demand,
    hold_s: float  # each as long a hold as its own (demand.refused_hold_s)
    probe_until: float | None = None  # a probe is in flight until its decision, or this deadline


def _predicted_end(decision: Decision) -> float:
    """Epoch seconds its prediction ends the request at (retry-after reads it from the registry's view)."""
    return time.time() + (decision.prediction.total_s if decision.prediction is not None else 0.0)


def _tier(decision) -> str:
    """Where a placed request runs, as X-Request-Tier says: the kind of candidate it was scored as.

    A bound actor still warming was scored as a fresh one (it pays the rest of its process start): cold.
    """
    if decision.candidate is None:  # decided outside `decide` (tests)
        return "cold" if isinstance(decision, Spawn) else "hot"
    kind = decision.candidate.kind
    return "hot" if kind == "join" else kind
