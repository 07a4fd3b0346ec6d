"""Waiting in the serve tests: for a condition the system reaches by itself, with a deadline that says what."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "condition", *,
             detail: Callable[[], str] | None = None) -> None:
    """`detail`, if given, is asked at the deadline for what the failure should also show (what is left)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}" + (f"; {detail()}" if detail is not None else ""))
