"""Was something else running when a benchmark started? One rule for every report.

The 1-minute load average lags by about a minute, so a one-core job that ended just
before a run still shows as ~1; only a figure above `MAX_QUIET_LOAD` says other work
shared the machine.
"""

from __future__ import annotations

MAX_QUIET_LOAD = 1.5


def was_busy(load_1min_at_start: float) -> bool:
    return load_1min_at_start > MAX_QUIET_LOAD
