"""`call_unparented` submits from an empty context: whatever the caller's context holds (in an async Ray actor,
the running task, which would make the call its child) is not there when `.remote` runs. Ray's side of it is
tested on real Ray in tests/serve/test_registry_link.py."""

from __future__ import annotations

import contextvars

from actors.remote_call import call_unparented

RUNNING_TASK: contextvars.ContextVar[str | None] = contextvars.ContextVar("running_task", default=None)


class _Method:
    def __init__(self) -> None:
        self.seen: list[tuple[str | None, tuple]] = []

    def remote(self, *args):
        self.seen.append((RUNNING_TASK.get(), args))
        return "ref"


def test_the_call_is_submitted_outside_the_callers_context_with_its_arguments():
    method = _Method()
    RUNNING_TASK.set("request-1")
    assert call_unparented(method, "row-1", 3) == "ref"
    assert method.seen == [(None, ("row-1", 3))]
    assert RUNNING_TASK.get() == "request-1"  # the caller's own context is untouched
