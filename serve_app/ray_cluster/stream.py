"""An actor's answer as Ray streams it, with Ray's errors turned into the port's endings (cluster.py).

`RequestActor.generate` is a Ray streaming generator: each `__anext__` gives an ObjectRef
whose value is the item. What Ray raises on the way maps to one ending:

    RayTaskError caused by ActorBusyError   StreamBusy       the actor turned the row away
    TaskCancelledError                      StreamCancelled  this replica cancelled the call
    RayActorError, its constructor failed   StreamFailed(is_load_failure=True)
    RayActorError, ActorUnschedulableError  StreamLost       the process or its node is gone
    any other RayError                      StreamFailed     the actor raised while serving
"""

from __future__ import annotations

import ray

from actors.messages import ActorBusyError
from serve_app.cluster import Item, StreamBusy, StreamCancelled, StreamEnded, StreamFailed, StreamLost


class RayStream:
    def __init__(self, generator: ray.ObjectRefGenerator) -> None:
        self._generator = generator

    async def next(self) -> Item:
        try:
            ref = await self._generator.__anext__()
            return await ref
        except ray.exceptions.RayError as e:
            raise ending(e) from e

    def cancel(self) -> None:
        ray.cancel(self._generator)

    async def drain(self) -> None:
        async for _ in self._generator:
            pass


def ending(e: ray.exceptions.RayError) -> StreamEnded:
    if isinstance(e, ray.exceptions.RayTaskError):
        if isinstance(e.cause, ActorBusyError):
            return StreamBusy(str(e.cause))
        return StreamFailed(f"{type(e.cause).__name__}: {e.cause}")
    if isinstance(e, ray.exceptions.TaskCancelledError):
        return StreamCancelled(str(e))
    if isinstance(e, ray.exceptions.RayActorError) and e.actor_init_failed:
        return StreamFailed(str(e), is_load_failure=True)
    if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError)):
        return StreamLost(f"{type(e).__name__}: {e}")
    return StreamFailed(f"{type(e).__name__}: {e}")
