"""How far each row of a running batch advances in the next step. Pure: no torch, no threads.

A step is one forward pass over every row of the batch (`Transformer.forward_rows`). A
row that is decoding advances by its one sampled token; a row still in its prompt
advances by a chunk of it. The rule:

- Every row advances every step: a decoding row by 1 token, a prefilling row by at
  least 1 prompt token. No row is ever skipped, so none can starve.
- While some row is decoding, the prefill tokens of one step are bounded by
  `prefill_budget` (shared out in join order; each prefilling row gets at least one
  token, so a step holds at most max(prefill_budget, rows) prompt tokens). A decoding
  row therefore waits at most one step of that size for a newcomer's prompt: a long
  prompt is chunked over several steps instead of stalling the rows already running.
- While no row is decoding, nothing is waiting on the step: each prefilling row runs
  its whole remaining prompt at once (one pass reads every weight once, which is also
  what lets a cold actor compute layer i as soon as layer i is resident).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RowProgress:
    """What the scheduler needs of one row, in join order."""

    row_id: int
    num_prompt_tokens: int
    num_prefilled: int  # prompt tokens already in the row's cache

    @property
    def num_remaining(self) -> int:
        return self.num_prompt_tokens - self.num_prefilled

    @property
    def is_prefilling(self) -> bool:
        return self.num_remaining > 0


def plan_step(rows: Sequence[RowProgress], prefill_budget: int) -> list[tuple[int, int]]:
    """(row_id, num_tokens) for every row, in the rows' order; see the module docstring."""
    if prefill_budget < 1:
        raise ValueError(f"prefill_budget must be >= 1, got {prefill_budget}")
    prefilling = [r for r in rows if r.is_prefilling]
    if len(prefilling) == len(rows):  # nobody decoding: nothing waits on this step
        return [(r.row_id, r.num_remaining) for r in rows]
    chunk: dict[int, int] = {}
    if prefilling:
        share = max(1, prefill_budget // len(prefilling))
        for r in prefilling:
            chunk[r.row_id] = min(r.num_remaining, share)
        left = prefill_budget - sum(chunk.values())
        for r in prefilling:  # what the short prompts left over goes to the earliest joiners
            if left <= 0:
                break
            extra = min(left, r.num_remaining - chunk[r.row_id])
            chunk[r.row_id] += extra
            left -= extra
    return [(r.row_id, chunk.get(r.row_id, 1)) for r in rows]
