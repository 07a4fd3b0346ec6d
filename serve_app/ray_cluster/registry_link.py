"""An ingress replica's link to the shared registry, kept across the registry's restarts and deaths.

The registry (registry_actor.py) keeps its books in memory. Ray restarts it if it dies,
and if it was killed for good the next heartbeat here creates a new one (`get_registry`
returns the live one, or makes it). Either way it comes back empty, under a new
incarnation; the heartbeat sees that and calls its `on_new_incarnation`, which hands over
what this replica knows (its policy and scorer, its slots, the rows it is still relaying).

`link.handle` is the registry of the moment: callers reach whichever registry is current.
Heartbeats run on the slot refresher's thread (slots.py), every `heartbeat_s` or at once when an
admission asks for one.

A request's calls go through `call`, never `handle.<method>.remote` on the event loop: submitted
within a request, a call is the request's child, and Serve cancels the request when its client
leaves (actors/remote_call.py). A `finish` or `abandon` cancelled so left the request's row reserved
in the books, and after one cancelled before it reached the registry, this replica's later calls
went unanswered (seen twice under bench_warm: heartbeats and warm-pool fills, while the driver's own
calls were answered).

Late is not gone. An admission that Ray answers with the registry's death (or a restarted
registry's refusal) calls `lost()`: `is_available` is False until a heartbeat is answered,
so later admissions are refused at once rather than each waiting out its deadline on a
registry known to be gone, and one gone for good is replaced within a heartbeat. An
admission that only missed its deadline calls `missed()`: a registry that is alive but
slow (a busy 2-core machine) must not turn one late answer into a run of refusals, so the
link stays available and probes at once; only a probe that is not answered within
`probe_timeout_s` turns it unavailable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from actors.remote_call import call_unparented

log = logging.getLogger(__name__)


class RegistryLink:
    def __init__(self, make_registry: Callable[[], Any], replica_id: str, *, heartbeat_s: float = 1.0,
                 probe_timeout_s: float = 2.0, attach_timeout_s: float = 30.0) -> None:
        self._make_registry = make_registry
        self.replica_id = replica_id
        self.heartbeat_s = heartbeat_s
        # A heartbeat of a registry that answered before: within this, or the link is unavailable. The
        # first attach (and one to a registry re-created here) waits for its process to start instead.
        self._probe_timeout_s = probe_timeout_s
        self._attach_timeout_s = attach_timeout_s
        self.handle = make_registry()
        self.incarnation: str | None = None  # the registry's, as of the last heartbeat; None: not yet seen
        self._wake = threading.Event()
        self._is_closed = False
        self._heard_at = float("-inf")  # monotonic: the last answer of this incarnation to another call (`heard`)
        # False from a registry known to be gone (or a probe it did not answer) until a heartbeat is
        # answered: admissions meanwhile are refused at once instead of each waiting out its deadline.
        self._is_available = True

    def call(self, method: str, *args: Any) -> ray.ObjectRef:
        """`handle.<method>.remote(*args)` on the current registry, owned by no request (module docstring)."""
        return call_unparented(getattr(self.handle, method), *args)

    def heard(self) -> None:
        """The current incarnation answered another heartbeat-like call (the lease exchange, which also marks
        this replica alive there): the next heartbeat has nothing to learn and skips its own attach."""
        self._heard_at = time.monotonic()

    def lost(self) -> None:
        """Heartbeat now: the registry is dead or restarted; it is taken as unavailable until then."""
        self._is_available = False
        self._heard_at = float("-inf")
        self._wake.set()

    def missed(self) -> None:
        """Heartbeat now: an answer came late. Still available unless this probe goes unanswered."""
        self._wake.set()

    def unanswered(self, error: BaseException) -> None:
        """A call got no answer: `missed` if it was only late, else `lost` (Ray says the actor is gone)."""
        if isinstance(error, TimeoutError):  # asyncio.TimeoutError is TimeoutError
            self.missed()
        else:
            self.lost()

    @property
    def is_available(self) -> bool:
        return self._is_available

    def close(self) -> None:
        """No more heartbeats: the replica is stopping, and the registry may shut itself down for good."""
        self._is_closed = True
        self._wake.set()

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    def wait(self) -> bool:
        """Until the next heartbeat is due; True if woken early."""
        is_woken = self._wake.wait(self.heartbeat_s)
        self._wake.clear()
        return is_woken

    def heartbeat(self, on_new_incarnation: Callable[[], None]) -> None:
        """Attach this replica; on a registry new since the last heartbeat (restarted, or re-created
        here), run `on_new_incarnation` — again at the next heartbeat if it raises."""
        if self._is_closed:  # a registry that shut itself down with the app must stay down
            return
        if self._is_available and time.monotonic() - self._heard_at < self.heartbeat_s:
            return  # answered within a heartbeat: alive, and the incarnation this replica handed over to
        try:
            incarnation = self._attach()
        except BaseException:
            self._is_available = False  # until a heartbeat is answered
            raise
        if incarnation != self.incarnation:
            if self.incarnation is not None:
                log.warning("registry restarted (incarnation %s -> %s): handing over this replica's state",
                            self.incarnation, incarnation)
            on_new_incarnation()
            # Admissions carry this: the registry refuses them until it is the incarnation handed over to.
            self.incarnation = incarnation
        self._is_available = True

    def _attach(self) -> str:
        timeout_s = self._probe_timeout_s if self.incarnation is not None else self._attach_timeout_s
        try:
            return ray.get(self.handle.attach.remote(self.replica_id), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            # Dead for good, or restarting: `get_if_exists` gives the restarting one, or a new one.
            self._is_available = False
            self.handle = self._make_registry()
            return ray.get(self.handle.attach.remote(self.replica_id), timeout=self._attach_timeout_s)
