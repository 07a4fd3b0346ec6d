"""How fast each feasible placement would serve a request: the scorer interface and its rule.

`decide` (policy.py) first works out which placements are feasible — an idle hot actor
whose slot has room for the request's KV cache and workspace, a free row in a hot
actor's batch, or a cold spawn onto a slot where a fresh actor fits — and only then asks
a `Scorer` to predict, per candidate, the time to first token, the total time and the
time per output token. The scorer ranks; it never decides feasibility, so no
prediction, however wrong, can place a request where it does not fit.

`RuleScorer` is the documented rule, used when no XGBoost model is configured or the
configured one cannot be used (`xgb_scorer.load_scorer`), and for any decision whose
model predictions are malformed:

    step_s(rows, tokens) = decode_s_per_token * (1 + batch_row_cost * (rows - 1))
                         + tokens * kv_bytes_per_token / kv_read_bytes_per_s
                         (actors/step_cost.py: the engine plans its steps with the same rule)
    prefill_s = decode_s_per_token + (input_tokens - 1) / prefill_tokens_per_s
                + input_tokens * (input_tokens - 1) / 2 / attention_pairs_per_s
                (the weights' pass, then each further prompt token, then each token's attention to the ones
                before it: actors/step_cost.py)
    hot:  tpot = step_s(1, request tokens);                 ttft = prefill_s + chunk passes
          (a request with a TPOT target has its prompt run in chunks whose steps stay within twice
          the target, actors/scheduler.py: each chunk past the first one more pass over the weights,
          decode_s_per_token; a warm actor holding every layer too)
    join: tpot = step_s(rows + 1, batch tokens + request's);
          ttft = tpot + prefill_s + pending / prefill_tokens_per_s
          (the next step boundary, then the prompt tokens computed before its own are done and its
          own; the batch keeps decoding beside it). A batch whose every row is still in its prompt runs
          them in one step: the join waits for that step's prompt tokens too, + step_prompt /
          prefill_tokens_per_s (ActorView.prompt_tokens_in_step), a wait at most twice the rows'
          tightest TPOT target where they state one (the engine chunks the prompts so). Where the
          batch's rows state a TPOT target, the engine feeds the prompts in chunks that keep the
          rows' mean time per token within it (actors/scheduler.py),
          predicted as no more than the target each step: chunk = (target - tpot) / prefill token's cost,
          at least 1, and ttft = overhead + tpot * (1 + prompt steps) + (input - 1) / prefill_tokens_per_s
          with prompt steps = ceil((pending + input - 1) / chunk), or where more, the prompt's work with its
          attention over what a step leaves for it, (target - tpot). `pending`: of the prompt tokens the
          batch's rows have still to compute (where the replica knows), at most `input` of each row's:
          the engine shares each step's prompt tokens among the prompts, the shortest first
          (actors/scheduler.py), so a joiner waits for none of a longer prompt beyond its own length. A
          batch near its target takes a prompt a few tokens a step: that join is predicted slow
          (slower than the engine, which may spend rows' slack on a larger chunk, and feeds a prompt no
          slower than keeps its first token within the request's TTFT target, whatever the rows accept:
          the join's measured ÷ predicted TTFT corrects it, serve_app/ttft_check.py).
    hot and join, on an actor whose engine said its steps run `step_correction` times the rule's
    (its StartEvent: a busy host, another machine): every step and prompt term above times it,
    as the engine's own planner does (actors/step_cost.py, StepCheck).
    warm: tpot = step_s(1, request tokens);  ttft = (1 - resident_fraction) * weight_bytes / load_bytes_per_s
                                                   + prefill_s  (the process is up; the rest streams in)
    cold: tpot = step_s(1, request tokens);  ttft = actor_start_s + weight_bytes / load_bytes_per_s + prefill_s
    A start on a busy node is slower: with `node_cpus` set, the cold start (and a warm actor's
    remaining load) is scaled by max(1, (others + 1) / node_cpus), `others` being the node's
    actors computing or starting besides it — the start's share of the host's cores
    (benchmarks/results/busy_start.md: on 2 cores, no slower beside one busy actor, 1.84x beside two,
    where the share says 1.5x: memory and caches are shared too, so this is a lower bound).
    Steps are slower there too: the constants were fitted on `step_threads` threads (the app's
    actor.compute_threads), and an actor's thread governor keeps only the cores the others leave
    it (actors/thread_governor.py), so with `node_cpus` set every step and prompt term is scaled by
    max(1, step_threads * (others + 1) / node_cpus): on 2 cores and two threads, 2x beside one
    computing actor (one thread: a 128-token prompt in 191 ms against two threads' 107,
    benchmarks/results/engine_avx512bf16.md, section 1). A hot or join candidate's own correction measured
    that slowdown already where it ran beside them: it takes the larger of the two, not both.
    What the others use is the node's computing actors (a core each), or, where more, its CPU as the
    telemetry measured it (`slot_utilization` × node_cpus, on a CPU node: every process, a load
    generator beside the server too), for any candidate but a join, whose own steps are in that
    figure. In cores, `others`: the governor keeps k = threads_for(node_cpus, others) threads
    (actors/thread_governor.py), and the step takes (threads / k) * max(1, (others + k) / node_cpus)
    of its time alone; with whole actors that is the share above. GuideLLM beside the server took
    47-54% of the 2 cores sending 1,000-token prompts, and idle actors, predicted as on an idle node,
    served them in 3.0-3.7x their prediction at one thread (benchmarks/results/peer_long_prompt.md).
    total_s = ttft + max_tokens * tpot
    (every ttft also counts `overhead_s`: arrival at the ingress to the actor's first step — parsing,
    the decision, the hops — measured per deployment; 0 by default)

A decode step reads every weight once for the whole batch, so a row more costs a little
compute (`batch_row_cost`) and its KV reads, not another pass over the weights. The
constants are placeholders of the right order for a small model, not measurements. Beyond
its node's busy actors (`node_cpus`) and an actor's own step correction, the rule does not look at the
slot, so every cold candidate on an idle node gets the same prediction and, with no correction,
every hot one is faster than any join, and any join than any cold one; with ties kept in
candidate order, `decide` reduces to "the first idle hot actor, else the batch with the
fewest rows and KV positions, else the first slot that fits" (first fit). A warm actor
is faster than a cold one, and faster than a join when most of its weights are in.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Literal, Protocol

from actors.scheduler import idle_step_limit_s
from actors.step_cost import StepCost
from actors.thread_governor import threads_for

if TYPE_CHECKING:
    from serve_app.snapshot import RequestFeatures

CandidateKind = Literal["hot", "join", "warm", "cold"]


@dataclass(frozen=True)
class Candidate:
    """One feasible placement. `actor_name` is set for hot and join candidates, None for cold ones."""

    kind: CandidateKind
    slot_id: str
    actor_name: str | None
    slot_free_bytes: int
    slot_num_actors: int
    slot_fragmentation: float  # 0..1, from telemetry
    slot_utilization: float  # 0..1 EWMA, from telemetry
    node_num_busy: int = 0  # actors computing or starting on the slot's node (num_computing_on_node): they share its host
    batch_rows: int = 0  # rows the actor runs now (join); 0 for an idle or a fresh actor
    batch_tokens: int = 0  # KV positions those rows read per step, at most
    resident_fraction: float = 0.0  # share of the weights already loaded: 1 hot or join, a warm actor's N/L-ish
    batch_tpot_target_s: float | None = None  # join: the tightest TPOT target of the rows the batch runs
    # join: its rows' prompt tokens the engine computes before this request's prompt is done, where known
    # (ActorView.prompt_tokens_ahead: at most the request's prompt length of each)
    batch_pending_prompt_tokens: int = 0
    step_correction: float = 1.0  # hot or join: the actor's steps measured ÷ the rule's (ActorView)
    # join: prompt tokens of the step in progress, which it waits for (whole prompts while no row decodes)
    batch_step_prompt_tokens: int = 0


@dataclass(frozen=True)
class Prediction:
    ttft_s: float  # the request's arrival at the ingress to its first token
    total_s: float  # the request's arrival at the ingress to its last token
    tpot_s: float  # seconds per output token once decoding: the batch's step time, this row in it
    # The TTFT that nine in ten such requests stay within, where measurements say how far past `ttft_s` they
    # go (ttft_check.py); None: `ttft_s`. A TTFT target is checked against it (policy.meets_targets).
    ttft_high_s: float | None = None

    @property
    def ttft_bound_s(self) -> float:
        return self.ttft_s if self.ttft_high_s is None else max(self.ttft_s, self.ttft_high_s)


class Scorer(Protocol):
    def predict(self, features: RequestFeatures, candidates: Sequence[Candidate]) -> Sequence[Prediction]:
        """One prediction per candidate, in the candidates' order."""
        ...


@dataclass(frozen=True)
class RuleScorer:
    """The rule in the module docstring. Placeholders until measured constants replace them."""

    # The step's constants default to StepCost's placeholders: one set for both.
    prefill_tokens_per_s: float = StepCost.prefill_tokens_per_s
    decode_s_per_token: float = StepCost.decode_s_per_token
    load_bytes_per_s: float = 2.0e9
    actor_start_s: float = 3.0  # process start, CUDA context, model skeleton
    batch_row_cost: float = StepCost.batch_row_cost  # a step's growth per extra row, a share of a one-row step
    kv_read_bytes_per_s: float = StepCost.kv_read_bytes_per_s
    attention_pairs_per_s: float = StepCost.attention_pairs_per_s
    overhead_s: float = 0.0  # the control plane's part of every TTFT (module docstring)
    # The cores of a slot's node, which a start shares with the actors busy there (module docstring); 0: a
    # start is predicted as on an idle node; -1: this machine's cores (one node, as `make serve` runs).
    node_cpus: int = 0
    # The threads a step computes on where the node leaves them free: what the constants were fitted on
    # (bench_engine fits at actor.compute_threads). Set from the app's actor config (serve_app/config.py).
    step_threads: int = 1

    def __post_init__(self) -> None:
        if self.node_cpus < -1 or self.step_threads < 1:
            raise ValueError(f"RuleScorer needs node_cpus >= -1 and step_threads >= 1, got {self.node_cpus} and "
                             f"{self.step_threads}")
        if self.node_cpus == -1:  # the cores this process may run on (its affinity), not the host's
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            object.__setattr__(self, "node_cpus", cores or 1)
        for name in ("prefill_tokens_per_s", "load_bytes_per_s", "kv_read_bytes_per_s", "attention_pairs_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RuleScorer.{name} must be > 0, got {getattr(self, name)}")
        for name in ("decode_s_per_token", "actor_start_s", "batch_row_cost", "overhead_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"RuleScorer.{name} must be >= 0, got {getattr(self, name)}")

    @cached_property
    def _cost(self) -> StepCost:
        # Built once per scorer, not once per prediction: `predict` runs on every admission.
        return StepCost(self.decode_s_per_token, self.batch_row_cost, self.prefill_tokens_per_s,
                        self.kv_read_bytes_per_s, self.attention_pairs_per_s)

    def step_cost(self) -> StepCost:
        """The constants a step's cost needs, for the engine's planner (ActorConfig.step_cost)."""
        return self._cost

    def step_s(self, rows: int, tokens: int, kv_bytes_per_token: int) -> float:
        """One decode step of `rows` rows whose caches hold `tokens` positions in all."""
        return self._cost.step_s(rows, 0, tokens, kv_bytes_per_token)

    def start_s(self, weight_bytes: int) -> float:
        """A fresh actor's start to its weights resident: its process, then every byte loaded."""
        return self.actor_start_s + weight_bytes / self.load_bytes_per_s

    def contention(self, candidate: Candidate, threads: int = 1) -> float:
        """How many times longer work on `threads` threads takes on the candidate's node now than alone: a start
        or a warm actor's remaining load (one thread), or a step (`step_threads`). Module doc: the cores the
        others use are the node's computing actors, or its measured CPU use where more."""
        if not self.node_cpus:
            return 1.0
        # A warming actor bound as a fresh one, and a batch joined, count among their node's busy actors themselves.
        is_counted = (candidate.kind == "cold" and candidate.actor_name is not None) or candidate.kind == "join"
        others = float(max(0, candidate.node_num_busy - is_counted))
        if candidate.kind != "join":  # a batch's own steps are in its node's use: its correction measured them
            others = max(others, candidate.slot_utilization * self.node_cpus - is_counted)
        wanted = min(threads, self.node_cpus)
        # The threads its governor keeps beside them (at least one), each sharing the cores with them.
        kept = threads_for(self.node_cpus, others, wanted, 1, wanted)
        return (wanted / kept) * max(1.0, (others + kept) / self.node_cpus)

    def predict(self, features: RequestFeatures, candidates: Sequence[Candidate]) -> list[Prediction]:
        compute_s = self._cost.prefill_s(features.input_tokens)
        own_tokens, per_token = features.input_tokens + features.max_tokens, features.kv_bytes_per_token
        alone = self.step_s(1, own_tokens, per_token)
        start_s = self.start_s(features.weight_bytes)
        out = []
        for c in candidates:
            # A known actor's steps run k times the rule's (1 for a warm or cold one); the node's other busy
            # actors leave a step fewer cores (module doc): a known actor's k may have measured that already.
            k = max(c.step_correction, self.contention(c, self.step_threads))
            if c.kind == "join":
                tpot = k * self.step_s(c.batch_rows + 1, c.batch_tokens + own_tokens, per_token)
                # The step it waits for (a whole-prompt step's prompts too), then the prompts' tokens and its own.
                wait = tpot + k * c.batch_step_prompt_tokens / self.prefill_tokens_per_s
                if c.batch_step_prompt_tokens and c.batch_tpot_target_s is not None:
                    wait = min(wait, max(tpot, idle_step_limit_s(c.batch_tpot_target_s)))  # the engine bounds it
                pending_s = c.batch_pending_prompt_tokens / self.prefill_tokens_per_s
                ttft = wait + (self.overhead_s + k * (compute_s + pending_s)
                               if c.batch_tpot_target_s is None
                               else self._chunked_prefill_s(features.input_tokens, c.batch_pending_prompt_tokens,
                                                            tpot, c.batch_tpot_target_s, per_token, k))
            elif c.kind == "warm":
                to_load = max(0.0, 1.0 - c.resident_fraction) * features.weight_bytes
                # Holding every layer, it plans its steps as a hot actor does; holding fewer, it runs the prompt whole.
                chunks_s = self._chunk_passes_s(features, k) if to_load == 0 else 0.0
                tpot = k * alone
                ttft = self.contention(c) * to_load / self.load_bytes_per_s + self.overhead_s + k * compute_s + chunks_s
            elif c.kind == "hot":
                tpot, ttft = k * alone, self.overhead_s + k * compute_s + self._chunk_passes_s(features, k)
            else:
                tpot, ttft = k * alone, self.contention(c) * start_s + self.overhead_s + k * compute_s
            out.append(Prediction(ttft, ttft + features.max_tokens * tpot, tpot))
        return out

    def _chunk_passes_s(self, features: RequestFeatures, correction: float) -> float:
        """A prompt alone on an actor with every layer resident runs in chunks whose steps stay within the idle step
        limit of its TPOT target (the engine's budget, actors/scheduler.py; the actor's cap aside, which the router
        does not know): `prompt_steps`. Each chunk beyond the first reads the weights once more. 0 without a target
        (the engine runs it whole)."""
        if features.tpot_target_s is None:
            return 0.0
        n, per_token = features.input_tokens, features.kv_bytes_per_token
        room_s = idle_step_limit_s(features.tpot_target_s) / correction - self._cost.step_s(1, 0, 1, per_token)
        num_chunks = max(1, prompt_steps(n - 1, self._cost.prefill_token_s(per_token),
                                         self._cost.prompt_attention_s(n), room_s))
        return correction * self._cost.decode_s_per_token * (num_chunks - 1)  # a one-row step: the weights' pass

    def _chunked_prefill_s(self, input_tokens: int, pending_tokens: int, tpot: float, target_s: float,
                           kv_bytes_per_token: int, correction: float = 1.0) -> float:
        """A joiner's prompt fed in chunks that keep each step of its batch within `target_s`, after the
        `pending_tokens` of earlier joiners, on an actor whose steps run `correction` times the rule's
        (module doc)."""
        token_s = correction * self._cost.prefill_token_s(kv_bytes_per_token)
        attention_s = correction * self._cost.prompt_attention_s(input_tokens)
        tokens = pending_tokens + max(0, input_tokens - 1)
        # Each step fits (target - tpot) of prompt work; the earlier joiners' attention is not known here.
        steps = prompt_steps(tokens, token_s, attention_s, target_s - tpot)
        return (self.overhead_s + tpot * max(1, steps)
                + correction * tokens / self.prefill_tokens_per_s + attention_s)


def prompt_steps(num_tokens: int, token_s: float, attention_s: float, room_s: float) -> int:
    """Steps that `num_tokens` prompt tokens take where each step has `room_s` for them (a step's time beyond its
    rows' one token each): whole tokens at `token_s` each, at least one a step, and where more, all of their work
    with its attention (`attention_s`, the same however the tokens are chunked) over the room, at most a token a
    step. An estimate of the engine's budgets (actors/scheduler.py): stepping them one by one would cost the router
    milliseconds for a long prompt under a tight target, this microseconds."""
    steps = -(-num_tokens // max(1, int(room_s / token_s)))
    if attention_s > 0 and room_s > 0:
        steps = min(max(num_tokens, 1), max(steps, math.ceil((num_tokens * token_s + attention_s) / room_s)))
    return steps


RULE_SCORER = RuleScorer()


def rule_of(scorer: Scorer) -> RuleScorer:
    """The rule behind a scorer, for the constants only the rule has: itself, a CorrectedScorer's rule
    (ttft_check.py), or the default rule beside a trained scorer. Asking it never calls the scorer's own
    `predict` (whose calls the simulator's tests compare between backends)."""
    base = getattr(scorer, "base", scorer)
    return base if isinstance(base, RuleScorer) else RULE_SCORER
