"""The one registry every ingress replica shares: a named, detached Ray actor around `RegistryState`.

Atomicity. Every method that reads or changes the state does so inside one critical
section under one lock (`SharedRegistry`, shared_registry.py, which this actor extends). Ray
runs the actor's calls one at a time (`max_concurrency=1`), and the only other thread — the
reconcile loop — takes the same lock, so each compare-and-set (`admit`, `finish`, `adopt`, ...)
is linearizable: of two replicas racing for the last free bytes of a slot, the second one's
re-check sees the first one's reservation. Replicas keep no state of their own.

Reconciling. A daemon thread runs `reconcile_now` every `reconcile_interval_s`: it lists
the alive request actors with `ray.util.list_named_actors(all_namespaces=True)` (the
state API needs the dashboard, which is not always running), reconciles under the lock,
and then — outside the lock, so that admissions are not held up — kills the actors the
report names (expired, retired and orphaned; see registry.py). The ingress may also call
`reconcile_now` itself.

Restarts. The actor restarts if it dies (`max_restarts=-1`), and an ingress re-creates it
if it was killed for good (registry_link.py); either way its state, in memory only, comes
back empty, under a new `incarnation`. Each replica sees the new incarnation in its next
heartbeat and hands over what it knows: its policy and scorer (`configure`), its slots,
the rows it is still relaying and the idle hot actors it knows of (`adopt`), so those actors
are not orphans. Orphans are therefore killed only `adopt_grace_s` after the registry
starts. Warm actors are not handed over: they are killed as orphans and the pools refill. Calls
are not retried (`max_task_retries=0`): a commit is not idempotent, so a call that fails
is answered as an error.

Ingress replicas attach. Each replica `attach`es when it starts and again every heartbeat,
and `detach`es from its `__del__` when Serve stops it. Rows carry the replica that relays
them: a replica silent for `replica_silence_s` (killed, or its node gone) relays nothing
any more, so its rows are released, and an actor that ran only such rows is killed. When
the last replica detaches — `serve shutdown`, or the app deleted — or the last one has not
been heard from for `replica_lease_s` (a crashed cluster's leftovers), the registry kills
every request actor (warm, hot or running) and telemetry agent in its actor namespace,
then itself: nothing it placed outlives the app.

Time. Callers pass durations (`busy_timeout_s`); the deadline is this actor's
`time.time()` plus the duration, so replicas' clocks never meet.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import uuid
from collections import Counter

import ray
import ray.autoscaler.sdk

from actors.actor_kill import kill_named
from actors.actor_names import is_request_actor_name
from actors.priority import control_plane_runtime_env
from serve_app.capacity import bundles
from serve_app.decisions import Decision, Reject
from serve_app.lease import LeaseGrant, LeaseReport, SlowPathLease
from serve_app.policy import PolicyConfig
from serve_app.ray_cluster.nodes import draining_node_ids
from serve_app.registry import (
    AdoptedActor,
    AdoptedRow,
    ReconcileReport,
    RegistryConfig,
)
from serve_app.scorer import Scorer
from serve_app.shared_registry import SharedRegistry
from serve_app.snapshot import RequestFeatures
from serve_app.ttft_check import TtftCorrection

log = logging.getLogger(__name__)


class RegistryActor(SharedRegistry):
    def __init__(self, config: RegistryConfig, policy: PolicyConfig, scorer: Scorer | None = None) -> None:
        super().__init__(policy, scorer, config.spawn_grace_s, kill=self._kill)
        self._calls: Counter[str] = Counter()  # calls through Ray, by method (`calls`)
        self._config = config
        self._replicas: dict[str, float] = {}  # attached ingress replica -> when last heard from
        self.incarnation = uuid.uuid4().hex[:12]  # new with every (re)start: replicas then hand their rows back
        self._adopt_until = time.time() + config.adopt_grace_s
        self._next_plan_at = 0.0  # epoch seconds: the capacity planner's next step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="zq-registry-reconcile", daemon=True)
        self._thread.start()

    # ---- commits (the rest are SharedRegistry's) ----------------------------------------

    def admit(self, features: RequestFeatures, spawn_name: str, request_id: str,
              slot_stats: dict[str, tuple[float, float]] | None = None, replica_id: str = "",
              incarnation: str | None = None, lease: SlowPathLease | None = None,
              correction: TtftCorrection | None = None) -> Decision:
        """Decide with this registry's policy and scorer, and commit, in one call.

        `incarnation` is the one the caller last handed its rows to. A restarted registry refuses
        a replica that has not handed over yet: decided on books that lack that replica's running
        rows and idle actors, the admission could double-book their slots or spawn beside them.

        `slot_stats` is the caller's latest telemetry, applied first: the ingress hands it
        over with each admission rather than from a thread of its own, because tasks one
        caller submits from several threads can reach an in-order actor out of sequence,
        and Ray then holds every later task of that caller for 30 s.
        """
        if incarnation is not None and incarnation != self.incarnation:
            return Reject("registry_restarted", None, "the admission registry restarted; retry shortly")
        return super().admit(features, spawn_name, request_id, slot_stats, replica_id, lease, correction)

    def exchange_leases(self, report: LeaseReport, incarnation: str | None = None) -> LeaseGrant | None:
        """A replica's lease heartbeat (it also counts as an attach); None from a registry the replica has not
        handed its rows and leases to yet (`admit` says why): it keeps using them until its lease ends."""
        if incarnation is not None and incarnation != self.incarnation:
            return None
        with self._lock:
            self._replicas[report.replica_id] = time.time()
        return super().exchange_leases(report)

    def adopt(self, rows: list[AdoptedRow], idle: list[AdoptedActor] = ()) -> list[str]:
        """A replica's running rows and idle hot actors, handed back after a restart; returns what was taken.

        Only idle actors Ray lists alive: a replica's memory of an idle actor outlives the actor when
        something else killed it (a retirement, an eviction by another replica, a crash).
        """
        alive = self._alive_request_actors() if idle else set()
        with self._lock:
            return self._state.adopt(rows, time.time(), [a for a in idle if a.actor_name in alive])

    # ---- ingress replicas --------------------------------------------------------------

    def attach(self, replica_id: str) -> str:
        """A replica's heartbeat; answers this registry's incarnation (a new one means it restarted empty)."""
        with self._lock:
            self._replicas[replica_id] = time.time()
        return self.incarnation

    def detach(self, replica_id: str) -> bool:
        """A replica stops; True if it was the last, and everything the registry placed is gone."""
        with self._lock:
            self._replicas.pop(replica_id, None)
            is_last = not self._replicas
        if is_last:
            self._shut_down()
        return is_last

    def _shut_down(self) -> None:
        """Kill every actor of this deployment's namespace, then this registry."""
        self._stop.set()
        c = self._config
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["namespace"] == c.actor_namespace and a["name"].startswith("zq-") and a["name"] != c.name:
                self._kill(a["name"])
        if self._state.capacity.bundles:
            try:  # the plan goes with the app: no node is kept for a deployment that is gone
                self.request_resources([])
            except Exception:
                log.exception("the capacity request was not cleared")
        log.info("registry %s: the last ingress replica is gone; every actor it placed was killed", c.name)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # ---- reconciling -----------------------------------------------------------------

    def reconcile_now(self) -> ReconcileReport:
        """A caller's reconcile (counted); the loop runs `_reconcile` itself."""
        return self._reconcile()

    def _reconcile(self) -> ReconcileReport:
        listed_at = time.time()
        alive = self._alive_request_actors()
        alive_nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        report = self.reconcile_books(alive, listed_at, alive_nodes, draining_node_ids())
        with self._lock:
            silent = {r for r, t in self._replicas.items() if listed_at - t > self._config.replica_silence_s}
            abandoned = self._state.release_rows_of(silent, listed_at) if silent else []
        if abandoned:
            log.warning("reconcile: replicas %s are silent; killed %s, which ran only their rows", silent, abandoned)
        for name in abandoned:
            self._kill(name)
        if listed_at < self._adopt_until:  # the replicas may still hand these rows back
            report = dataclasses.replace(report, orphans=())
        for name in report.to_kill:
            self._kill(name)
        if report.lost_slots:
            log.warning("reconcile: slots %s removed: their node is gone", report.lost_slots)
        if report.ghosts or report.to_kill:
            log.info("reconcile: ghosts %s, expired %s, retired %s, orphans %s, released %d bytes",
                     report.ghosts, report.expired, report.retired, report.orphans, report.released_bytes)
        return report

    def stop(self) -> None:
        """Stop the reconcile loop (tests; the actor itself is ended with ray.kill)."""
        self._stop.set()
        self._thread.join()

    def calls(self) -> dict[str, int]:
        """How many calls each method has had through Ray (this one's own excluded), as Ray's task summary
        would count them: what benchmarks read as registry calls per admitted request."""
        return dict(self._calls)

    # ---- capacity ----------------------------------------------------------------------

    def _plan_capacity(self, now: float) -> None:
        """Every capacity.interval_s: plan, and state a changed plan to Ray's autoscaler (one bundle a slot).

        A plan is marked stated only once Ray took it, so a failed call is made again next pass. Planning
        off (or turned off by a redeploy) states an empty request once, so none is left standing."""
        if now < self._next_plan_at:
            return
        plan = self.plan_capacity()
        with self._lock:
            capacity = self._state.capacity
            self._next_plan_at = now + capacity.config.interval_s
            wanted = bundles(plan.num_wanted, capacity.config) if plan is not None else ()
            if wanted == capacity.bundles or (plan is None and capacity.bundles is None):
                return
            present = capacity.num_present
        if plan is not None:
            log.info("capacity: %d slots wanted (%d needed, %d present)", plan.num_wanted, plan.num_needed, present)
        self.request_resources(list(wanted))
        with self._lock:
            capacity.bundles = wanted

    @staticmethod
    def request_resources(wanted: list[dict[str, float]]) -> None:
        """The plan to Ray's autoscaler: these bundles in all, replacing the last request (the seam tests
        replace to see the plan without an autoscaler)."""
        ray.autoscaler.sdk.request_resources(bundles=wanted)

    def _loop(self) -> None:
        # Each step on its own: a failed reconcile (a GCS hiccup) neither skips the plan nor the lease check.
        while not self._stop.wait(self._config.reconcile_interval_s):
            for step in (self._reconcile, lambda: self._plan_capacity(time.time())):
                try:
                    step()
                except Exception:  # the loop must not end; the next pass tries again
                    log.exception("registry loop step failed")
            try:
                if self._is_lease_over(time.time()):
                    self._shut_down()
            except Exception:
                log.exception("registry lease check failed")

    def _is_lease_over(self, now: float) -> bool:
        """True once every replica that ever attached has been silent for `replica_lease_s`."""
        with self._lock:
            if not self._replicas:
                return False  # none attached yet (tests drive the registry directly), or already shut down
            lease = self._config.replica_lease_s
            self._replicas = {r: t for r, t in self._replicas.items() if now - t <= lease}
            return not self._replicas

    def _alive_request_actors(self) -> set[str]:
        c = self._config
        return {
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == c.actor_namespace and is_request_actor_name(a["name"])
        }

    def _kill(self, name: str) -> None:
        kill_named(name, self._config.actor_namespace)


# The methods callers reach through Ray; each call is counted in `_calls`.
CALLED = ("admit", "exchange_leases", "give_back", "adopt", "attach", "detach", "reconcile_now", "register_slots",
          "snapshot", "counters", "fill_warm", "warm_created", "warm_ready", "drop_warming", "actor_started", "finish", "abandon",
          "remove", "configure", "check_invariants", "capacity_status")


def _counted(name: str, method):
    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        self._calls[name] += 1
        return method(self, *args, **kwargs)

    return counted


for _name in CALLED:
    setattr(RegistryActor, _name, _counted(_name, getattr(RegistryActor, _name)))


def get_registry(config: RegistryConfig, policy: PolicyConfig,
                 registry_cls: type[RegistryActor] = RegistryActor) -> ray.actor.ActorHandle:
    """The registry named `config.name` in `config.namespace`, created if it does not exist yet.

    It decides with the rule scorer until a replica `configure`s it with the deployment's scorer, which
    every replica does on a new registry before its first admission (its link is unavailable until then).
    The scorer is not a constructor argument on purpose: a trained one is too large to travel inline, so
    Ray would keep it in the object store, owned by the replica that created the registry, and a restart
    after that replica is gone would fail for want of its arguments (Ray warns of exactly this).
    `registry_cls` is the fault seam: tests pass a subclass that stalls or dies on cue.
    """
    return ray.remote(registry_cls).options(
        name=config.name,
        namespace=config.namespace,
        lifetime="detached",
        get_if_exists=True,
        max_concurrency=1,
        num_cpus=0,
        max_restarts=-1,
        max_task_retries=0,
        runtime_env=control_plane_runtime_env(),  # ahead of the request actors for the CPU (priority.py)
    ).remote(config, policy)
