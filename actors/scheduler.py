"""How far each row of a running batch advances in the next step. Pure: no torch, no threads.

A step is one forward pass over every row of the batch (`Transformer.forward_rows`). A
row that is decoding advances by its one sampled token; a row still in its prompt
advances by a chunk of it. The rule:

- Every row advances every step: a decoding row by 1 token, a prefilling row by at
  least 1 prompt token. No row is ever skipped, so none can starve.
- While some row is decoding (and while none is, last bullet), the prefill tokens of one
  step are bounded by `prefill_budget` and shared among the prompts (so a step holds at most
  max(prefill_budget, rows) prompt tokens): each prefilling row gets one token, and the
  rest is water-filled, the prompt with the fewest tokens left served first, none given
  more than a prompt with more left (a tie goes to the earlier joiner). A short prompt is
  thus not stuck behind a long one: it takes its share from its first step, and a prompt
  of n tokens is done once the batch has computed at most n tokens of each other prompt
  (fewer of a shorter one) besides its own, which is what the router predicts its TTFT
  from (`ActorView.prompt_tokens_ahead`, serve_app/scorer.py). A later joiner delays an
  earlier one's first token by at most its own prompt. (First come, first served, which
  this replaced, held a 24-token prompt behind a 600-token one for a dozen steps: short
  requests' TTFT P99 was 3.8x their P50 at 0.7x load in benchmarks/results/load.md as of
  commit 51c3c5d, another host's run; the next run, shared, on an AVX512-BF16 host, had the
  short P99 within 0.1 s of the queues' at 0.7x.) A
  decoding row therefore waits at most one step of that size for a newcomer's prompt: a
  long prompt is chunked over several steps instead of stalling the rows already running.
- The budget is derived (`prefill_budget`): the most prompt tokens for which the step's
  predicted time (actors/step_cost.py) stays within what every decoding row with a TPOT
  target accepts, the chunks' attention to the positions before them included (so a long
  prompt's later chunks are smaller than its first: by SmolLM2's constants in configs/serve.yaml,
  the ~260 tokens a flat per-token price buys in a 0.2 s step cost ~0.5 s more of attention
  after 3,000 cached positions), at most the configured cap (`prefill_chunk_tokens`); the cap alone where
  no decoding row states a target. A step can never be shorter than its decode work and
  one token per prefilling row: a target that this breaks was broken at admission.
- What a decoding row accepts (`max_step_s`): its TPOT target is the mean time per output
  token once decoding, as a client measures it ((last token - first token) / (tokens - 1)),
  not a bound on each step. A row whose steps so far ran faster than its target has slack
  (target * intervals so far - time since its first token), and the next step may take the
  target plus `SLACK_SHARE` of it, so its mean stays within the target once the step is
  done. The time is the engine's step clock: the host's few ms between steps (sampling,
  streaming) are not in it, which is what the share left unspent is for. Never more than
  `MAX_STEP_STRETCH` times the target: one long step is a visible stall in a stream. A
  joiner's prompt thus goes in a few large chunks rather than many small ones, and every
  chunk's step reads the weights once for many more prompt tokens.
- While no row is decoding yet, the step is what a joiner arriving now would wait for, so
  it is bounded as a decoding row with all the slack it may spend would bound it: predicted
  within `MAX_STEP_STRETCH` times the tightest TPOT target of the prompts it carries, at most
  the cap, shared as above. A 4,000-token prompt on an idle actor is then a few steps a
  joiner can join between, not seconds of a step that holds every later request back; each
  further chunk costs one more pass over the weights. Two cases run the prompts whole, as
  one pass: no row states a target (no one says how long a step may be), and a cold actor's
  steps (the caller passes no budget), which compute layer i as soon as layer i is resident.
- A prompt whose first token is due by a time (its request's TTFT target, `first_token_in_s`)
  gets at least the tokens that keep it due at this step's pace (`tokens_due`), whatever the
  decoding rows accept: the prompts due first, each with those due before it, spread evenly
  over the steps that fit before it is due, and all of it in this step where not two do. Its
  due is planned, once, `PACE_SHARE` of the way from its joining to its target's end
  (`paced_due`): replanned at each step, a share of the time left would recede with it. The
  TPOT bound alone starves a joiner once the decoding rows have no slack left (steps slower
  than the router priced them: a busy host): one token a step, so its first token waited for
  the whole batch to end: benchmarks/results/peer_margin_again.md lists joins at 8 req/s
  predicted at 0.28 and 0.76 s whose first tokens came 5.2 and 4.9 s after their arrival (their
  traces: each as the rows before it on that actor finished), and paced_prefill.md puts an
  engine in that state on purpose (3.7 s unpaced, 0.5 s paced). A row past its TPOT
  target loses a little more of its mean to a larger chunk; the joiner kept waiting would lose
  its whole TTFT target, which the ingress promised when it admitted it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from actors.step_cost import prompt_pairs

# (rows, prompt tokens beyond each row's first, KV positions read, prompt attention pairs) -> predicted seconds of
# the step: StepCost.step_s's terms (`step_terms`)
PredictStep = Callable[[int, int, int, int], float]

MAX_STEP_STRETCH = 2.0  # no step planned past twice a row's TPOT target, whatever slack it has
SLACK_SHARE = 0.9  # of a row's slack, what one step may spend (the rest covers the host's time between steps)
# Of the time from a prompt's joining to its first token's due, what its pace plans to use (`paced_due`): the rest is
# for what the plan cannot see: the token's way to the client, steps slower than priced, joiners due sooner. Paced to
# the due itself, a first token would come at the due by construction, and a client would see it past the target.
PACE_SHARE = 0.5


def max_step_s(tpot_target_s: float | None, num_out: int, decode_elapsed_s: float) -> float | None:
    """The longest next step that keeps a decoding row's mean time per output token within its target.

    After `num_out` >= 1 tokens, the first `decode_elapsed_s` ago, its slack is what its
    `num_out - 1` intervals left under the target; the next step may take the target and
    SLACK_SHARE of the slack (all of a deficit comes off), at most MAX_STEP_STRETCH times the
    target. So (decode_elapsed_s + step) / num_out <= target. None: no target.
    """
    if tpot_target_s is None:
        return None
    slack = tpot_target_s * (max(1, num_out) - 1) - decode_elapsed_s
    return min(MAX_STEP_STRETCH * tpot_target_s, tpot_target_s + (SLACK_SHARE * slack if slack > 0 else slack))


def idle_step_limit_s(tpot_target_s: float) -> float:
    """The longest step while no row decodes yet, for prompts whose tightest TPOT target is `tpot_target_s`: what
    a decoding row with all the slack it may spend accepts (`max_step_s`). The router bounds a joiner's wait for
    such a step by it too (serve_app/scorer.py)."""
    return MAX_STEP_STRETCH * tpot_target_s


@dataclass(frozen=True)
class RowProgress:
    """What the scheduler needs of one row, in join order."""

    row_id: int
    num_prompt_tokens: int
    num_prefilled: int  # prompt tokens already in the row's cache
    num_cached: int = 0  # KV positions in the row's cache (the prompt's prefilled part, then its output)
    tpot_target_s: float | None = None  # its mean time per output token once decoding, at most
    # The longest next step it accepts (`max_step_s`: its target and the slack its steps left); None: the target.
    max_step_s: float | None = None
    # A prompt's: seconds left until its first token is due (<= 0: overdue); None: no TTFT target.
    first_token_in_s: float | None = None

    @property
    def step_limit_s(self) -> float | None:
        return self.max_step_s if self.max_step_s is not None else self.tpot_target_s

    @property
    def num_remaining(self) -> int:
        return self.num_prompt_tokens - self.num_prefilled

    @property
    def is_prefilling(self) -> bool:
        return self.num_remaining > 0


def plan_step(rows: Sequence[RowProgress], prefill_budget: int | None) -> list[tuple[int, int]]:
    """(row_id, num_tokens) for every row, in the rows' order; see the module docstring.

    `prefill_budget`: the most prompt tokens the step carries (at least one per prefilling row);
    None: every prompt whole (no row is decoding, and nothing bounds the step)."""
    if prefill_budget is None:
        if any(not r.is_prefilling for r in rows):
            raise ValueError("a batch with a decoding row needs a prefill budget")
        return [(r.row_id, r.num_remaining) for r in rows]
    if prefill_budget < 1:
        raise ValueError(f"prefill_budget must be >= 1, got {prefill_budget}")
    prefilling = [r for r in rows if r.is_prefilling]
    chunk = {r.row_id: 1 for r in prefilling}  # every row advances
    left = prefill_budget - len(prefilling)
    # Water-filling: the prompts by tokens left, fewest first (join order among equals); each takes an even
    # share of what is still to give out, at most what it needs, so none gets more than a longer one.
    # (Shortest first outright, tried by hand on bench_load's closed loop, one 60 s run each and no committed
    # command: short prompts' TTFT P50 0.29 s against 0.37 s shared, but 600-token prompts, passed over by every
    # shorter joiner, took P50 2.0 s against 1.9 s, past their 2 s target half the time.)
    by_need = sorted(prefilling, key=lambda r: r.num_remaining)  # stable: join order among equals
    for i, r in enumerate(by_need):
        if left <= 0:
            break
        share = -(-left // (len(by_need) - i))  # rounded up: the remainder goes to the shorter prompts
        extra = min(share, r.num_remaining - 1)
        chunk[r.row_id] += extra
        left -= extra
    return [(r.row_id, chunk.get(r.row_id, 1)) for r in rows]


def prefill_budget(rows: Sequence[RowProgress], max_chunk_tokens: int, predict_step_s: PredictStep,
                   prefill_token_s: float, pair_s: float = 0.0) -> int | None:
    """Prompt tokens the next step may carry (module docstring); None: the prompts whole (no row decodes
    and none states a target).

    `predict_step_s` prices a step, `prefill_token_s` what one more prompt token adds to it besides its
    attention, `pair_s` each of its attention's (query, key) pairs (0: unpriced, as the rule's default).
    Never below one token per prefilling row (every row advances), never above the cap.
    """
    if max_chunk_tokens < 1 or not prefill_token_s > 0:
        raise ValueError(f"max_chunk_tokens must be >= 1 and prefill_token_s > 0, got {max_chunk_tokens}, "
                         f"{prefill_token_s}")
    decoding = [r for r in rows if not r.is_prefilling]
    if decoding:
        targets = [r.step_limit_s for r in decoding if r.step_limit_s is not None]
        if not targets:
            return max_chunk_tokens
    else:  # the step a joiner would wait for: no longer than any of these rows will accept once it decodes
        targets = [idle_step_limit_s(r.tpot_target_s) for r in rows if r.tpot_target_s is not None]
        if not targets:
            return None
    num_prefilling = len(rows) - len(decoding)
    # The shortest step: every row one token (a decoding row's, a prefilling row's next prompt token),
    # each reading its cache and that position; what is left of the target buys further prompt tokens.
    base_s = predict_step_s(*step_terms(rows, [(r.row_id, 1) for r in rows]))
    fits = num_prefilling + int((min(targets) - base_s) / prefill_token_s)
    floor = max(num_prefilling, 1, min(max_chunk_tokens, tokens_due(rows, base_s, prefill_token_s, pair_s)))
    return _largest_within(rows, floor, max(floor, min(max_chunk_tokens, fits)), min(targets), predict_step_s)


def _largest_within(rows: Sequence[RowProgress], floor: int, budget: int, limit_s: float,
                    predict_step_s: PredictStep) -> int:
    """The largest budget from `floor` to `budget` whose planned step is predicted within `limit_s`; `floor` where
    none is (it is owed: one token a prompt, and the tokens due). `budget` came from the flat price per token,
    which leaves out what each chunk's tokens attend to: the (query, key) pairs grow with the prompt's cached part
    (module docstring). A larger budget never gives a prompt fewer tokens (`plan_step`), so the predicted step grows
    with it: bisected."""
    def is_within(budget: int) -> bool:
        return predict_step_s(*step_terms(rows, plan_step(rows, budget))) <= limit_s

    if budget <= floor or is_within(budget):
        return budget
    lo, hi = floor, budget  # lo is owed or within; hi is not within
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if is_within(mid) else (lo, mid)
    return lo


def step_terms(rows: Sequence[RowProgress], plan: Sequence[tuple[int, int]]) -> tuple[int, int, int, int]:
    """A planned step as `PredictStep` prices it: rows, prompt tokens beyond each prefilling row's first, KV
    positions read (every row reads its cache once this step's positions are written), and the prompt chunks'
    attention pairs."""
    num_extra = num_kv = num_pairs = 0
    for r, (_, n) in zip(rows, plan, strict=True):
        num_kv += r.num_cached + n
        if r.is_prefilling:
            num_extra += n - 1
            num_pairs += prompt_pairs(r.num_cached, n)
    return len(rows), num_extra, num_kv, num_pairs


def paced_due(joined_at: float, first_token_due: float) -> float:
    """When a prompt that joined at `joined_at` plans its first token (`RowProgress.first_token_in_s`): PACE_SHARE
    of the way to `first_token_due`, its TTFT target's end (at once where that has passed)."""
    return joined_at + PACE_SHARE * max(0.0, first_token_due - joined_at)


def tokens_due(rows: Sequence[RowProgress], base_s: float, prefill_token_s: float, pair_s: float = 0.0) -> int:
    """The fewest prompt tokens this step must carry for every prompt with a due first token to stay on time, at
    this step's pace: `base_s` a step (every row one token), `prefill_token_s` each further prompt token, `pair_s`
    each (query, key) pair of their attention (a prompt's pairs are the same however it is chunked).

    Earliest due first, each prompt's remaining tokens and those of prompts due before it (`ahead`) spread evenly
    over the steps that fit in its time left once they are paid for; all of them now where fewer than two steps fit
    (so an overdue prompt runs whole). Each step planned so leaves the next one at least one step fewer to
    fit, so a prompt that could be done on time when it was planned stays so (tests/unit/test_scheduler.py).
    Prompts share a step shortest first (`plan_step`): a shorter prompt due later may take its share before a
    longer one due sooner, and is done the sooner for it."""
    due = sorted((r for r in rows if r.is_prefilling and r.first_token_in_s is not None),
                 key=lambda r: r.first_token_in_s)
    needed = ahead = 0
    ahead_s = 0.0
    for r in due:
        ahead += r.num_remaining
        ahead_s += r.num_remaining * prefill_token_s + prompt_pairs(r.num_cached, r.num_remaining) * pair_s
        num_steps = int((r.first_token_in_s - ahead_s) / base_s) if base_s > 0 else 1
        needed = max(needed, ahead if num_steps < 2 else -(-ahead // num_steps))
    return needed
