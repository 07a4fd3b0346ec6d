"""What `decide()` answers (policy.py): where a request runs now, or why it is refused now.

Plain frozen dataclasses (stdlib only): the registry commits them, the ingress acts on them,
traces record them. Each placement carries the candidate it was chosen from and what the
scorer predicted for it (neither is part of its equality).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from serve_app.scorer import Candidate, Prediction
from serve_app.snapshot import Lane

# registry_restarted: the admitting replica has not yet handed its rows to a restarted registry.
RejectReason = Literal["no_capacity", "too_large", "latency_target", "registry_restarted"]


@dataclass(frozen=True)
class Dispatch:
    """Run alone on an idle hot actor."""

    actor_name: str
    slot_id: str
    lane: Lane  # the request's lane; the actor keeps its own
    keep_hot: bool  # the actor stays idle after this request
    reserve_bytes: int  # added to the slot while the request runs (= dispatch_bytes)
    candidate: Candidate | None = field(default=None, compare=False)
    prediction: Prediction | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Join:
    """Run as one more row of a busy hot actor's batch, from its next step boundary."""

    actor_name: str
    slot_id: str
    lane: Lane
    reserve_bytes: int  # added to the slot while the row runs (= dispatch_bytes)
    candidate: Candidate | None = field(default=None, compare=False)
    prediction: Prediction | None = field(default=None, compare=False)

    @property
    def keep_hot(self) -> bool:
        return True  # only hot actors are joined, and joining does not change that


@dataclass(frozen=True)
class Bind:
    """Run on a warm actor: its process is up and its first layers are in; it serves this request."""

    actor_name: str
    slot_id: str
    lane: Lane  # the request's lane, which the actor takes from now on
    keep_hot: bool  # the actor stays hot after this request
    reserve_bytes: int  # added to the slot while the request runs (= dispatch_bytes)
    candidate: Candidate | None = field(default=None, compare=False)
    prediction: Prediction | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Spawn:
    slot_id: str
    lane: Lane
    keep_hot: bool
    reserve_bytes: int  # reserved on the slot from now on (= spawn_bytes)
    resident_bytes: int  # the part that stays reserved while the actor idles hot
    candidate: Candidate | None = field(default=None, compare=False)
    prediction: Prediction | None = field(default=None, compare=False)
    evict: tuple[str, ...] = ()  # idle hot or warm actors on the slot retired to make room
    # The slot's node as the registry knows it, where the actor is pinned: any ingress replica can
    # place it, whichever replica discovered the slot.
    node_id: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.resident_bytes <= self.reserve_bytes:
            raise ValueError(f"Spawn needs 0 <= resident_bytes <= reserve_bytes, got "
                             f"{self.resident_bytes} and {self.reserve_bytes}")


@dataclass(frozen=True)
class Reject:
    reason: RejectReason
    retry_after_s: float | None  # None when retrying cannot help (too_large)
    message: str

    @property
    def http_status(self) -> int:
        """400 invalid_request_error for too_large; 503 overloaded_error otherwise."""
        return 400 if self.reason == "too_large" else 503


Decision = Dispatch | Join | Bind | Spawn | Reject
