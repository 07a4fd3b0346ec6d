"""A request's latency targets: the model's defaults, or the request's own headers.

    x-zq-ttft-target-s: <seconds>   arrival at the ingress to the first token
    x-zq-total-target-s: <seconds>  arrival at the ingress to the last token
    x-zq-tpot-target-s: <seconds>   time per output token once decoding

Each is a decimal number of seconds, > 0 and <= MAX_TARGET_S; a header replaces the
model's default for that request (looser or stricter: the target is the client's own).
A malformed value is a 400 invalid_request_error before any work. `decide` refuses a
request (503 overloaded_error, reason `latency_target`) when no feasible placement is
predicted to meet its targets. A TPOT target also protects the request once it runs: no
later request joins its batch if that is predicted to slow its steps past the target.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from serve_app import errors

TTFT_HEADER = "x-zq-ttft-target-s"
TOTAL_HEADER = "x-zq-total-target-s"
TPOT_HEADER = "x-zq-tpot-target-s"
MAX_TARGET_S = 86_400.0
_MAX_CHARS = 32


def parse_target(name: str, value: str) -> float:
    """One header's value in seconds; raises ApiError (400) unless it is a number in (0, MAX_TARGET_S]."""
    text = value.strip()
    try:
        if len(text) > _MAX_CHARS:
            raise ValueError
        seconds = float(text)
    except ValueError:
        raise errors.invalid_request(f"{name}: expected a number of seconds, got {value[:_MAX_CHARS]!r}") from None
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_TARGET_S:
        raise errors.invalid_request(f"{name}: must be > 0 and <= {MAX_TARGET_S:g} seconds, got {text}")
    return seconds


def request_targets(headers: Mapping[str, str], ttft_default_s: float | None, total_default_s: float | None,
                    tpot_default_s: float | None = None) -> tuple[float | None, float | None, float | None]:
    """(ttft_target_s, total_target_s, tpot_target_s) for one request: its headers where given, else the defaults."""
    given = [headers.get(h) for h in (TTFT_HEADER, TOTAL_HEADER, TPOT_HEADER)]
    defaults = (ttft_default_s, total_default_s, tpot_default_s)
    return tuple(d if v is None else parse_target(h, v)  # type: ignore[return-value]
                 for h, v, d in zip((TTFT_HEADER, TOTAL_HEADER, TPOT_HEADER), given, defaults, strict=True))
