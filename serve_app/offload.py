"""Waiting with a deadline that holds (`within`), and blocking work off the ingress's event loop:
a small thread pool with a deadline and a cap (`BoundedExecutor`).

asyncio's default executor queues without bound; here at most `max_pending` calls are in
flight, and one more is refused at once (503 overloaded_error) rather than queued, as is
a call that misses its deadline. A call the caller stopped waiting for (its deadline, or
its client left) still finishes in its thread; `on_abandoned` then receives its result,
so whatever it made (an actor) can be undone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from serve_app import errors

log = logging.getLogger(__name__)

# The client is told to retry after this when the work itself (GCS, parsing) was too slow.
RETRY_AFTER_S = 1.0


async def within(awaitable: Awaitable[Any], timeout_s: float) -> Any:
    """`awaitable`'s result, or asyncio.TimeoutError after `timeout_s` — then at once.

    `asyncio.wait_for` on its deadline cancels what it waits on and then waits for the
    cancellation to finish; a Ray call to an actor that neither answers nor dies (a
    registry restarting) only finishes when it does, so that deadline held for seconds.
    Here the deadline is the deadline: what was waited on is cancelled and left behind.
    """
    future = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except BaseException:
        if not future.done():
            future.cancel()
        # Also one that finished as we stopped waiting (a client leaving as the item arrives): nobody reads
        # its exception now, and one left unread is logged by a finalizer, at whatever moment GC runs.
        future.add_done_callback(_retrieve)
        raise


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # nobody waits for it any more: not an "exception was never retrieved"


class BoundedExecutor:
    def __init__(self, name: str, *, max_threads: int, max_pending: int, timeout_s: float) -> None:
        self._name = name
        self._executor = ThreadPoolExecutor(max_threads, thread_name_prefix=f"zq-{name}")
        self._max_pending, self._timeout_s = max_pending, timeout_s
        self._num_pending = 0
        self._lock = threading.Lock()

    async def run(self, call: Callable[[], Any], on_abandoned: Callable[[Any], None] | None = None) -> Any:
        with self._lock:
            if self._num_pending >= self._max_pending:
                raise errors.overloaded(f"too much {self._name} work in progress; retry shortly", RETRY_AFTER_S)
            self._num_pending += 1
        future: Future = self._executor.submit(call)
        future.add_done_callback(self._done)
        try:
            return await within(asyncio.wrap_future(future), self._timeout_s)
        except BaseException as e:
            if on_abandoned is not None:  # what the call still makes is nobody's: undone once it is made
                future.add_done_callback(lambda f: f.exception() is None and on_abandoned(f.result()))
            if isinstance(e, asyncio.TimeoutError):
                log.warning("%s work took longer than %.1f s", self._name, self._timeout_s)
                raise errors.overloaded(f"{self._name} took too long; retry shortly", RETRY_AFTER_S) from None
            raise

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _done(self, _: Future) -> None:  # on the thread that finished the call
        with self._lock:
            self._num_pending -= 1
