"""Faults injected at the cluster's seam (`RayClusterSpec(actor_cls=..., registry_cls=...)`, or
`LocalClusterSpec(actor_cls=...)` in-process).

`FaultyActor` is the real request actor on a real (tiny) model; it misbehaves only when
the request's prompt says so, so one deployment serves healthy and faulty requests side
by side. A prompt names its fault as `fault:<kind>`, optionally with `once:<path>` (the
fault happens only for the first request to create `path`: a retry then runs clean) and
`gate:<path>` (the request holds its last item until `path` exists).

A death is the process's exit on Ray; in-process, the actor ends itself as a dead process would end
(its cluster ends every stream it had open: `StreamLost`).

  die-before-start  the process exits before the request's `Started`
  die-mid-load      after `Started`, before the first token (a cold actor's load); with `after:<path>`,
                    once `path` exists (the test saw the stream's first event: the Started was delivered)
  die-mid-decode    after the first text chunk
  stall             after `Started`, nothing more, ever
  slow-load         after `Started`, `SLOW_LOAD_S` before anything more (a load slower than a token's deadline)
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

from actors.messages import Started, TextChunk
from actors.request_actor import RequestActor
from serve_app.ray_cluster.registry_actor import RegistryActor

_FAULT = re.compile(r"fault:([a-z-]+)")
_ONCE = re.compile(r"once:(\S+)")
_GATE = re.compile(r"gate:(\S+)")
_AFTER = re.compile(r"after:(\S+)")


def _is_armed(text: str) -> bool:
    """True unless a `once:` path says this fault already happened (claimed atomically, across processes)."""
    once = _ONCE.search(text)
    if once is None:
        return True
    try:
        os.close(os.open(once.group(1), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


class FaultyActor(RequestActor):
    SLOW_LOAD_S = 5.0

    async def generate(self, request):
        text = self._streamed.tokenizer.decode(request.prompt_ids)
        fault = _FAULT.search(text)
        kind = fault.group(1) if fault is not None and _is_armed(text) else None
        gate = _GATE.search(text)
        if kind == "die-before-start":
            await self._die()
        async for item in super().generate(request):
            if kind == "die-mid-decode" and isinstance(item, TextChunk):
                await self._die()
            if gate is not None and not isinstance(item, (Started, TextChunk)):
                while not Path(gate.group(1)).exists():  # the Completion waits for the test's go
                    await asyncio.sleep(0.02)
            yield item
            if isinstance(item, Started) and kind == "die-mid-load":
                after = _AFTER.search(text)
                while after is not None and not Path(after.group(1)).exists():
                    await asyncio.sleep(0.02)
                await self._die()
            if isinstance(item, Started) and kind == "stall":
                await asyncio.sleep(3600)
            if isinstance(item, Started) and kind == "slow-load":
                await asyncio.sleep(self.SLOW_LOAD_S)


    async def _die(self) -> None:
        if self._on_exit is None:  # a Ray worker: the process ends
            os._exit(1)
        self._exit()  # in-process: the cluster ends this actor's streams, this one's task included
        await asyncio.sleep(3600)


class SlowRegistry(RegistryActor):
    """A registry whose admissions take `ADMIT_DELAY_S` first: a client can leave while one is in flight."""

    ADMIT_DELAY_S = 2.0

    def admit(self, *args, **kwargs):
        time.sleep(self.ADMIT_DELAY_S)
        return super().admit(*args, **kwargs)


class LateRegistry(RegistryActor):
    """A registry that answers an admission for `CUE_MAX_TOKENS` tokens `LATE_S` late: busy, not gone.

    It stays single-threaded while it sleeps, as a registry held up by a starved CPU would: the
    calls behind it (the replica's heartbeat, the next admissions) wait too, and are answered after.
    """

    CUE_MAX_TOKENS = 7
    LATE_S = 3.0

    def admit(self, features, *args, **kwargs):
        if features.max_tokens == self.CUE_MAX_TOKENS:
            time.sleep(self.LATE_S)
        return super().admit(features, *args, **kwargs)
