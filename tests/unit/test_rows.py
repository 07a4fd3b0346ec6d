"""A placed request's row at its end (serve_app/rows.py): what the replica's leases hear of it."""

from __future__ import annotations

import asyncio
from unittest.mock import MagicMock

from serve_app.policy import PolicyConfig
from serve_app.rows import Admitted, Rows


class _Stream:
    def __init__(self) -> None:
        self.is_cancelled = False

    def cancel(self) -> None:
        self.is_cancelled = True

    async def drain(self) -> None:
        return None


def test_a_leased_row_cancelled_before_its_first_token_no_longer_counts_as_a_prompt_ahead_of_joiners():
    leases = MagicMock()
    rows = Rows(MagicMock(), leases, MagicMock(), PolicyConfig(), "A", None, MagicMock(), drain_timeout_s=1.0,
                traces_writer=None)
    admitted = Admitted("req-0", "m", "actor-0", True, "hot", 10, _Stream(), 0.0, 0.0, lease_row="row-0")

    async def run() -> None:
        rows.begin(admitted)
        rows.end(admitted, "cancelled")  # the client left while its prompt was computing
        await asyncio.sleep(0)

    asyncio.run(run())
    assert admitted.stream.is_cancelled
    # Its prompt leaves the batch at the next step: a joiner is priced without it, and it is never overdue.
    leases.prompt_done.assert_called_once_with("row-0")
