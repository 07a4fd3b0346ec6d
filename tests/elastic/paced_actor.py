"""A request actor whose rows take device time, not host CPU: the accelerator this machine lacks.

Ray's fake autoscaling provider adds nodes that are processes on the same 2 cores: a real model's
decode, being host compute, gets no faster for the nodes it adds, so a step load would measure the
shared CPU, not the capacity a node brings. `PacedActor` runs the real engine on the real (tiny)
model, then holds the request's end until `PACE_S_PER_TOKEN` x max_tokens after its start, as a GPU
step's time holds a row without taking the host's CPU. Everything else — admission, the registry's
books, the stream — is the real thing. Injected at the cluster's seam (`RayClusterSpec(actor_cls=...)`).
"""

from __future__ import annotations

import asyncio
import time

from actors.messages import Completion
from actors.request_actor import RequestActor

PACE_S_PER_TOKEN = 0.05


class PacedActor(RequestActor):
    async def generate(self, request):
        held_until = time.monotonic() + PACE_S_PER_TOKEN * request.sampling.max_tokens
        async for item in super().generate(request):
            if isinstance(item, Completion):
                await asyncio.sleep(max(0.0, held_until - time.monotonic()))
            yield item
