"""The physical floor of refusals without a queue: Erlang's loss formula B(c, A).

A system that never queues, with `c` requests able to run at once and offered traffic
A = arrival rate x mean service time (in Erlangs), refuses at least the share B(c, A) of
arrivals: the probability that all c places are taken when a request arrives (Poisson
arrivals; the formula holds for any service-time distribution). No scheduler without a
queue can do better, so every load report prints it beside the measured refusal rate:
what lies between the two is the system's own doing.

    B(0, A) = 1;   B(c, A) = A B(c-1, A) / (c + A B(c-1, A))

The recurrence is stable for any c and A (no factorials).
"""

from __future__ import annotations

import math


def erlang_b(num_servers: int, offered_erlangs: float) -> float:
    """The blocking probability B(c, A): the least share of arrivals a zero-queue system must refuse."""
    if num_servers < 0 or not offered_erlangs >= 0 or math.isinf(offered_erlangs):
        raise ValueError(f"erlang_b needs c >= 0 and a finite A >= 0, got c={num_servers}, A={offered_erlangs}")
    b = 1.0
    for k in range(1, num_servers + 1):
        b = offered_erlangs * b / (k + offered_erlangs * b)
    return b


def refusal_floor(num_places: int, arrival_rate_per_s: float, mean_service_s: float) -> float:
    """B(c, lambda x S): the refusal floor at an arrival rate, for c places and a mean service time."""
    return erlang_b(num_places, arrival_rate_per_s * mean_service_s)
