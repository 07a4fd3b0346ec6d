"""Deadlines that hold, and the bounded pool that refuses rather than queues."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from serve_app.errors import ApiError
from serve_app.offload import BoundedExecutor, within

IGNORES_CANCEL_S = 3.0


async def _ignores_cancellation() -> str:
    """Like a Ray call to an actor that neither answers nor dies: a cancel does not end it early."""
    deadline = time.monotonic() + IGNORES_CANCEL_S
    while time.monotonic() < deadline:
        try:
            await asyncio.sleep(deadline - time.monotonic())
        except asyncio.CancelledError:
            continue
    return "late"


def test_within_raises_at_its_deadline_even_when_what_it_waits_on_ignores_cancellation():
    async def main() -> float:
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await within(_ignores_cancellation(), 0.05)
        return time.monotonic() - t0

    # asyncio.wait_for would return only after IGNORES_CANCEL_S: the bound is far below that, far above 0.05 s.
    assert asyncio.run(main()) < IGNORES_CANCEL_S / 2


def test_within_returns_the_result_in_time():
    async def quick() -> int:
        await asyncio.sleep(0)
        return 7

    assert asyncio.run(within(quick(), 5.0)) == 7


def test_the_bounded_pool_refuses_past_its_cap_instead_of_queueing():
    gate = threading.Event()
    pool = BoundedExecutor("test", max_threads=1, max_pending=2, timeout_s=30)

    async def main() -> None:
        held = [asyncio.ensure_future(pool.run(gate.wait)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as refused:
            await pool.run(gate.wait)
        assert refused.value.status == 503 and "retry-after" in refused.value.headers
        gate.set()
        assert await asyncio.gather(*held) == [True, True]
        assert await pool.run(lambda: 1) == 1  # the slots came back

    asyncio.run(main())
    pool.close()
