"""A request's sampling settings, checked at construction: the one object the API layer builds and
the actor runs with.

Torch-free, so that what only reads the settings (the admission features in serve_app/memory.py,
the simulator) does not import torch; the sampler itself is sampling.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.stop_sequences import MAX_STOP_SEQUENCE_CHARS, MAX_STOP_SEQUENCES


class SamplingError(ValueError):
    """Sampling parameters out of range; raised before any compute."""


MAX_TEMPERATURE = 2.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_sequences: tuple[str, ...] = ()
    min_tokens: int = 0  # no end-of-turn token is sampled before this many tokens
    ignore_eos: bool = False  # an end-of-turn token does not end the row: exactly max_tokens are made

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], "
                                f"got {self.min_tokens!r}")
        # The APIs bound it further: Anthropic's to [0, 1], OpenAI's to [0, 2].
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise SamplingError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if len(self.stop_sequences) > MAX_STOP_SEQUENCES:
            raise SamplingError(f"at most {MAX_STOP_SEQUENCES} stop_sequences are allowed")
        for s in self.stop_sequences:
            if not s or len(s) > MAX_STOP_SEQUENCE_CHARS:
                raise SamplingError(
                    f"each stop sequence must have 1 to {MAX_STOP_SEQUENCE_CHARS} characters, got {s!r}"
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
