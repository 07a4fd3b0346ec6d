"""Ray calls that no request owns as its child.

Ray counts a call submitted while an actor task runs as that task's child, and cancelling the task cancels
every child not yet run: Serve cancels a request's task when its client leaves, and the ingress cancels the
actor's stream. The bookkeeping a request leaves behind must outlive it: the registry's `finish` or
`abandon` (cancelled, the row stayed reserved in its books; and after such a cancel, seen twice under
bench_warm, the replica's later calls to the registry went unanswered), an actor's memory report to its node's telemetry agent.

In an async actor Ray reads the running task from a contextvar, so a call submitted from an empty
`contextvars.Context` has no parent task. (A sync actor's task is its thread's: its own threads' calls are
nobody's children anyway.)
"""

from __future__ import annotations

import contextvars
from typing import Any


def call_unparented(method: Any, *args: Any) -> Any:
    """`method.remote(*args)` (an actor method), submitted as no running task's child; its ObjectRef."""
    return contextvars.Context().run(method.remote, *args)
