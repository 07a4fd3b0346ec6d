"""What the engine tells each row, one row at a time: one `StartEvent` (its prefill begins), `TokenEvent`s as
tokens are sampled, then exactly one `FinishEvent` (actors/engine.py). Plain data with no torch, so that the
request actor's class can be imported (by the ingress that creates it) without the engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class BatchFullError(RuntimeError):
    """The batch already holds `max_batch` rows."""


@dataclass(frozen=True)
class StartEvent:
    time: float  # epoch seconds; the row's prefill began
    # The engine's measured ÷ rule-predicted step time (actors/step_cost.py, StepCheck) at the join: how much
    # slower than the rule's constants this actor's steps run now (a busy host, another machine).
    step_correction: float = 1.0
    step_baseline: float = 1.0  # the same ratio over many steps (StepCheck.baseline): what the router falls back to


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # text released by this token; "" while held back (split UTF-8, stop-sequence prefix)
    num_output_tokens: int
    time: float  # epoch seconds when the token was sampled


@dataclass(frozen=True)
class FinishEvent:
    stop_reason: str  # "end_turn" | "max_tokens" | "stop_sequence" | "cancelled"
    stop_sequence: str | None
    input_tokens: int
    output_tokens: int
    compute_start: float  # epoch seconds; prefill began (arrival time if cancelled before)
    first_token_time: float | None
    last_token_time: float | None
    # The step clock: seconds of the steps the row took part in (the engine computing it), and
    # the rows those steps ran in all, summed over them (÷ num_steps: its mean batch), and the
    # threads torch computed them on, summed likewise (÷ num_steps: its mean threads).
    engine_s: float = 0.0
    num_steps: int = 0
    num_step_rows: int = 0
    num_step_threads: int = 0
    # The steps the engine checked (not those waiting on a cold actor's weights): their predicted
    # seconds summed (actors/step_cost.py), and their measured ones.
    predicted_step_s: float = 0.0
    checked_step_s: float = 0.0


Event = StartEvent | TokenEvent | FinishEvent
Emit = Callable[[Event | BaseException], None]  # an exception: the row failed
