"""The port between admission and the world: the registry's books, and the actors that compute.

Admission (admission.py), the relay (relay.py) and the rows (rows.py) reach the cluster only
through a `Cluster`, in plain awaits and typed endings — never a Ray handle or a Ray error.
Two implementations:

    ray_cluster/      the shared registry actor, request actors as named Ray actors, Ray's
                      errors mapped to the endings below (the only Ray code under serve_app/)
    local_cluster.py  the same `RegistryState` and the same `RequestActor` engine in this
                      process: what the HTTP tests run against, with no Serve and no Ray

`Ingress.bind(config, cluster=spec)` chooses one: a spec is small and picklable, and builds
its cluster inside the replica (`ClusterSpec.build`).

What a request asks of the cluster, in order: `admit` (decide and reserve, one atomic
call; not made for a request placed on this replica's leased rows), `open` (the actor's stream of `Started`, `TextChunk`s and one `Completion`, on an
actor that exists or on a new one the decision named), then however it ends exactly one
of `finish` or `abandon` (a leased row's end is neither: `exchange_leases` reports it). An `ActorStream.next()` that does not return an item raises
`StopAsyncIteration` after the `Completion`, or one of the `StreamEnded` endings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from actors.messages import ActorRequest, Completion, Started, TextChunk
from serve_app.decisions import Decision
from serve_app.lease import LeaseGrant, LeaseReport, SlowPathLease
from serve_app.loaded_model import LoadedModel
from serve_app.registry import AdoptedActor, AdoptedRow, Outcome
from serve_app.snapshot import ClusterSnapshot, RequestFeatures
from serve_app.ttft_check import TtftCorrection

Item = Started | TextChunk | Completion
# What a new registry is handed: the rows this replica still relays, and the idle hot actors it knows.
HandOver = Callable[[], tuple[list[AdoptedRow], list[AdoptedActor]]]


class RegistryUnavailable(Exception):
    """The registry did not decide in time, or is known to be gone: the request is refused at once."""


class ActorGone(Exception):
    """The actor the decision named does not exist (it died, and the registry has not noticed yet)."""


class StreamEnded(Exception):
    """An actor's stream ended without its Completion. `outcome`: how its row is released."""

    outcome: Outcome = "failed"

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail


class StreamLost(StreamEnded):
    """The actor's process is gone (killed, out of memory, its node lost), or could never be placed."""


class StreamBusy(StreamEnded):
    """The actor turned the row away (its batch was full after all): nothing ran, the actor is fine."""

    outcome: Outcome = "cancelled"


class StreamCancelled(StreamEnded):
    """The stream was cancelled (by this replica, or the actor's call was cancelled)."""

    outcome: Outcome = "cancelled"


class StreamFailed(StreamEnded):
    """The actor raised. `is_load_failure`: its constructor did (the model cannot be loaded), which
    fails the same way on every placement — a server fault, not capacity to retry elsewhere."""

    def __init__(self, detail: str = "", *, is_load_failure: bool = False) -> None:
        super().__init__(detail)
        self.is_load_failure = is_load_failure


class ActorStream(Protocol):
    async def next(self) -> Item:
        """The next item; raises StopAsyncIteration after the Completion, or a StreamEnded. Cancelling a
        wait leaves the stream usable (a writer waiting with pings relies on that)."""

    def cancel(self) -> None:
        """Stop the actor's row (it leaves the batch at the actor's next step); idempotent."""

    async def drain(self) -> None:
        """Until the actor's side of the stream has ended (after `cancel`: the row has left the batch)."""


@dataclass(frozen=True)
class NewActor:
    """Where a Spawn decision puts its actor: the model's file, the slot's node, and the idle actors
    to kill first (forgotten by the registry already)."""

    zqs_path: str
    node_id: str
    evict: tuple[str, ...] = ()


class Cluster(Protocol):
    @property
    def is_available(self) -> bool:
        """False while the registry is known to be gone: admissions are refused without asking."""

    @property
    def num_slots(self) -> int: ...

    def start(self, hand_over: HandOver) -> None:
        """Register the slots, attach, start the background work (warm pools, heartbeats)."""

    async def close(self) -> None:
        """This replica stops: background work ends; the last replica takes every actor with it."""

    async def admit(self, features: RequestFeatures, spawn_name: str, request_id: str,
                    lease: SlowPathLease | None = None, correction: TtftCorrection | None = None) -> Decision:
        """Decide and reserve in one atomic step; raises RegistryUnavailable. With `lease`, the free rows it
        names return first, and a row placed on a hot actor is leased to this replica (its id: `request_id`).
        `correction`: this replica's measured ÷ predicted TTFT per placement kind (ttft_check.py)."""

    async def exchange_leases(self, report: LeaseReport, timeout_s: float) -> LeaseGrant:
        """This replica's lease heartbeat (lease.py); raises RegistryUnavailable."""

    def give_back(self, row_ids: tuple[str, ...]) -> None:
        """Return free leased rows now, not at the next heartbeat (their model is contended)."""

    def abandon(self, request_id: str) -> None:
        """Undo whatever `request_id`'s admission reserved (also one that has not arrived yet)."""

    def finish(self, actor_name: str, request_id: str, outcome: Outcome) -> None:
        """A row ended; a failed actor is forgotten and killed."""

    def actor_started(self, actor_name: str) -> None:
        """A cold or warm actor's first token: all its weights are resident, so it may batch."""

    async def snapshot(self, timeout_s: float) -> ClusterSnapshot:
        """The registry's books; raises RegistryUnavailable."""

    async def reconcile(self, timeout_s: float) -> None:
        """Check the books against the actors alive now (best effort: never raises)."""

    async def open(self, name: str, request: ActorRequest, new: NewActor | None = None) -> ActorStream:
        """Send the row to actor `name`, created first where `new` says; raises ActorGone, or ApiError 503
        when the placement misses its deadline."""

    def forget(self, name: str) -> None:
        """Actor `name` will not be called again from here (it failed, or it exits after its last row)."""

    def wake_warm(self) -> None:
        """A slot was freed or a warm actor bound: look at the warm pools now."""


class ClusterSpec(Protocol):
    """What `Ingress.bind(config, cluster=...)` carries: builds the cluster inside the replica."""

    def build(self, config: Any, models: dict[str, LoadedModel], scorer: Any, replica_id: str) -> Cluster: ...
