"""An `Engine` stepped on its own thread while it has rows; each request reads its own events in asyncio.

The request actor and the queued baseline's replica both serve a batch this way: an
async method per request calls `submit()` on the event loop, then reads its `RowStream`;
the stepping thread runs `engine.step()` back to back while any row is running or joining
and sleeps otherwise. Only the stepping thread touches the model, so a request joins at
the next step boundary and never interrupts a step. A step that raises ends every row of
the batch with that error (they share the model that failed).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from actors.engine import Engine
from actors.events import Event, FinishEvent
from actors.model import WaitLayer
from actors.sampling import SamplingParams
from actors.thread_governor import ThreadGovernor

log = logging.getLogger(__name__)


class RowStream:
    """One request's events (`StartEvent`, `TokenEvent`s, one `FinishEvent`, or an exception), in asyncio."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.row = None
        self.is_done = False  # a FinishEvent or an exception was read
        # A FinishEvent or an exception was delivered: nothing follows it. A reader holding tokens back to
        # send them together waits on this too, so that a row's last tokens leave as soon as it ends.
        self.has_ended = asyncio.Event()

    def _emit(self, event: Event | BaseException) -> None:  # on the stepping thread
        try:
            self._loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the loop has closed: nobody is reading any more
            pass

    def _deliver(self, event: Event | BaseException) -> None:  # on the loop
        self._queue.put_nowait(event)
        if isinstance(event, (FinishEvent, BaseException)):
            self.has_ended.set()

    async def get(self) -> Event:
        """The next event; raises the row's error."""
        return self._check(await self._queue.get())

    def get_ready(self) -> list[Event]:
        """The events already delivered, without waiting, up to an error (which the next `get` raises)."""
        out = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                self._queue.put_nowait(item)  # nothing follows an error: it is the queue's last item
                break
            out.append(self._check(item))
        return out

    def cancel(self) -> None:
        """End the row at the next step boundary, unless it has ended already."""
        if not self.is_done and self.row is not None:
            self._engine.cancel(self.row)

    def _check(self, item):
        if isinstance(item, BaseException):
            self.is_done = True
            raise item
        if isinstance(item, FinishEvent):
            self.is_done = True
        return item


class BatchRunner:
    def __init__(self, engine: Engine, *, wait_layer: Callable[[], WaitLayer | None] | None = None,
                 name: str = "zq-batch", threads: ThreadGovernor | None = None) -> None:
        """`wait_layer()` is asked before each step for the weight gate to pass to it (None: all resident).
        `threads`: sets the stepping thread's own count of torch threads (actors/threads.py), fewer while other
        processes use the node's cores (actors/thread_governor.py); None: torch's count, as it is."""
        self.engine = engine
        self.threads = threads
        self._wait_layer = wait_layer
        self._wake = threading.Event()
        self._between_steps: list[Callable[[], object]] = []  # run by the stepping thread, then dropped
        self._is_closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams, tpot_target_s: float | None = None,
               first_token_due: float | None = None) -> RowStream:
        """Add a row (call on the event loop that reads it); raises BatchFullError when the batch is full.
        The targets as `Engine.add` takes them."""
        stream = RowStream(self.engine, asyncio.get_running_loop())
        stream.row = self.engine.add(prompt, params, stream._emit, tpot_target_s, first_token_due)
        self._wake.set()
        return stream

    def call_between_steps(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the stepping thread before its next step (at once if idle): where it may change the model."""
        self._between_steps.append(fn)
        self._wake.set()

    def close(self) -> None:
        """Stop stepping once the current step ends; rows still running get no further events."""
        self._is_closed = True
        self._wake.set()

    def _loop(self) -> None:
        if self.threads is not None:
            self.threads.start()
        # While idle, the governor still samples the node, so that a first step after a pause computes on
        # the threads the node has free now.
        idle_wait_s = self.threads.interval_s if self.threads is not None and self.threads.is_active else None
        while not self._is_closed:
            while self._between_steps:
                fn = self._between_steps.pop(0)
                try:
                    fn()
                except Exception:  # the model is as it was: the batch goes on
                    log.exception("a call between steps failed")
            if self.threads is not None:
                self.threads.adjust()
            if not self.engine.has_work:
                self._wake.wait(idle_wait_s)
                self._wake.clear()
                continue
            try:
                self.engine.step(self._wait_layer() if self._wait_layer is not None else None)
            except BaseException as e:  # every row of the batch hears it
                log.exception("a batch step failed; its %d rows end with the error", self.engine.num_rows)
                self.engine.fail_all(e)
