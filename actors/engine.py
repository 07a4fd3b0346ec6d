"""The generation API the actors call: a running batch of requests, stepped one forward at a time.

One `Engine` wraps one loaded model and its tokenizer. `prepare()` does every check that
can fail — sampling ranges, the chat template, the context window — before any compute,
so a bad request costs nothing. `add()` puts a request into the batch: it joins at the
next step boundary, with its own KV cache sized for prompt + max_tokens, its own
sampling generator (seeded per request), text decoder and stop sequences. `step()` runs
one forward over every row (`actors/scheduler.py` decides how far each advances: a decode
row one token, a joining row a chunk of its prompt, sized so that the step's predicted time
keeps every decoding row's mean time per token within its TPOT target), samples, and hands each row its
events; a row that ends leaves the batch, and its cache is freed, *before* its
`FinishEvent` is delivered, so whoever reads that event may add the next request at once.

Per row the events are: one `StartEvent` (its prefill begins), `TokenEvent`s as tokens are
sampled, then exactly one `FinishEvent`. `cancel(row)` ends a row at the next step
boundary ("cancelled") and touches no other row.

Threads. `step()` runs on one thread at a time; `add()` and `cancel()` may be called from
any thread.

A row's tokens in a batch equal its tokens alone: every row attends only to its own
cache, and its sampler draws from its own generator exactly as many times as alone.
`generate()` runs a single request to the end on the calling thread (the CLI, tests,
calibration).

Every step is predicted before it runs (actors/step_cost.py: the rule's constants times
the correction the steps measured so far imply) and checked once it has: the error is
logged every `LOG_EVERY_STEPS` steps, and each row's `FinishEvent` carries the predicted
and measured seconds of its steps. Steps that wait on a cold actor's weights are not
checked: their time is the load's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from actors.attention import is_int8_served
from actors.chat import GenerationRequest, build_prompt, check_context_window
from actors.compiled_step import CompiledDecode
from actors.events import BatchFullError, Emit, Event, FinishEvent, StartEvent, TokenEvent
from actors.kv_cache import KVCache
from actors.model import RowInput, WaitLayer
from actors.sampling import SamplingParams, greedy, make_generator, mask_tokens, sample
from actors.scheduler import RowProgress, max_step_s, paced_due, plan_step, prefill_budget, step_terms
from actors.step_cost import RECENT_STEPS, StepCheck, StepCost
from actors.stop_sequences import StopSequenceFilter
from actors.tokenizer import StreamDecoder, Tokenizer
from weights_tool.dtypes import model_dtype

log = logging.getLogger(__name__)

LOG_EVERY_STEPS = 500


@dataclass(eq=False)
class Row:
    """One request in the batch; the engine's thread owns every field but `is_cancelled`."""

    id: int
    prompt: list[int]
    params: SamplingParams
    emit: Emit
    added_at: float
    tpot_target_s: float | None = None  # bounds its mean time per token, so the prefill work of steps beside it
    first_token_planned: float | None = None  # epoch s: when its prompt is paced to end (scheduler.paced_due)
    is_cancelled: bool = False
    caches: list[KVCache] | None = None  # allocated when the row joins
    slot: int | None = None  # its slot of the compiled step's slabs (actors/compiled_step.py), where it has one
    num_prefilled: int = 0
    last_token: int | None = None
    num_out: int = 0
    compute_start: float | None = None
    first_time: float | None = None
    last_time: float | None = None
    generator: torch.Generator | None = None
    decoder: StreamDecoder | None = None
    stops: StopSequenceFilter | None = None
    engine_s: float = 0.0  # see FinishEvent
    decode_s: float = 0.0  # the step clock's seconds since its first token: its mean time per token so far
    predicted_s: float = 0.0  # the same steps, as predicted before each ran (checked ones only)
    checked_s: float = 0.0  # the measured seconds of those checked steps
    num_steps: int = 0
    num_step_rows: int = 0
    num_step_threads: int = 0  # torch's threads in each of its steps, summed (actors/thread_governor.py)
    stop: tuple[str, str | None] | None = field(default=None)  # (reason, sequence) once it has ended

    @property
    def position(self) -> int:
        """Tokens in the row's cache."""
        return self.num_prefilled + max(0, self.num_out - 1)

    def kv_bytes(self) -> int:
        caches = self.caches
        return sum(c.nbytes() for c in caches) if caches else 0


class Engine:
    def __init__(self, model, tokenizer: Tokenizer, *, max_context: int | None = None, max_batch: int = 1,
                 prefill_chunk_tokens: int = 256, step_cost: StepCost | None = None,
                 compiled: CompiledDecode | None = None, step_check_recent_steps: int = RECENT_STEPS,
                 is_kv_int8: bool = False):
        """`compiled`: decode-only steps of rows in its slots run through it, where their bucket is compiled.
        `step_check_recent_steps`: StepCheck's `recent_steps` (actors/step_cost.py). `is_kv_int8`: rows cache
        their keys and values in 8 bits (kv_cache.py)."""
        if max_batch < 1 or prefill_chunk_tokens < 1:
            raise ValueError(f"max_batch and prefill_chunk_tokens must be >= 1, got {max_batch}, "
                             f"{prefill_chunk_tokens}")
        if is_kv_int8 and compiled is not None:
            raise ValueError("8-bit KV caches are not served by the compiled step")
        if is_kv_int8 and not (model.device.type == "cpu" and is_int8_served(model.dtype, model.config.head_dim)):
            log.warning("8-bit KV caches without their decode kernel here (a bf16 model on an AVX512-BF16/VNNI CPU, "
                        "head_dim up to 128): each decode step dequantizes its rows' spans, slower than the model's "
                        "own dtype")
        self.is_kv_int8 = is_kv_int8
        self.model = model
        self.tokenizer = tokenizer
        window = model.config.max_position_embeddings
        self.max_context = min(window, max_context) if max_context else window
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(model.config.eos_token_ids)
        self.device = next(model.parameters()).device
        self.max_batch = max_batch
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._rows: list[Row] = []  # the running batch, in join order (the step thread's)
        self._inbox: list[Row] = []  # added, joining at the next step boundary
        self._lock = threading.Lock()
        self._next_id = 0
        self._clock = _StepClock(self.device)
        self.step_cost = step_cost or StepCost()
        # One check per count of threads the steps compute on (actors/thread_governor.py changes it while other
        # processes use the node's cores; a step on one thread takes up to twice as long as on two, which one running
        # correction would chase anew at every change).
        self._step_checks: dict[int, StepCheck] = {}
        self._last_check: StepCheck | None = None  # the count's check the last step used: a new count's seed
        self._step_check_recent_steps = step_check_recent_steps
        self._kv_bytes_per_token = model.config.kv_bytes_per_token(model_dtype(model.dtype), is_kv_int8)
        self.compiled = compiled

    @property
    def step_check(self) -> StepCheck:
        """The check of steps at the thread count torch computes on here now (the stepping thread's). A count not
        seen before starts from the last count's figures: the machine's level, until its own steps are measured."""
        threads = torch.get_num_threads()
        check = self._step_checks.get(threads)
        if check is None:
            check = (StepCheck.seeded_from(self._last_check) if self._last_check is not None
                     else StepCheck(recent_steps=self._step_check_recent_steps))
            self._step_checks[threads] = check
        self._last_check = check
        return check

    def prepare(self, request: GenerationRequest) -> list[int]:
        """Tokenize and validate; raises before any compute. Returns the prompt token ids."""
        return build_prompt(self.tokenizer, request, self.max_context)

    # ---- membership (any thread) ------------------------------------------------------

    def add(self, prompt: list[int], params: SamplingParams, emit: Emit,
            tpot_target_s: float | None = None, first_token_due: float | None = None) -> Row:
        """Queue a row to join at the next step boundary; raises BatchFullError when the batch is full.

        `tpot_target_s`: once the row decodes, no step is planned that would take its mean time per
        token past this (actors/scheduler.py: slack it has left may lengthen a step, to twice the target).
        `first_token_due` (epoch s): while it prefills, every step carries at least the prompt tokens that keep its
        first token due by a share of the way to then (scheduler.paced_due) at the steps' pace, whatever the decoding
        rows' targets (scheduler.tokens_due).

        Cancelled rows still in the batch do not count: they leave at the next boundary.
        """
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        # Checked again here, not only by build_prompt: a row too long for its cache would fail the
        # step, and with it every other row of the batch.
        check_context_window(len(prompt), params.max_tokens, self.max_context)
        with self._lock:
            if self.num_rows >= self.max_batch:
                raise BatchFullError(f"the batch already runs {self.max_batch} rows")
            now = time.time()
            planned = None if first_token_due is None else paced_due(now, first_token_due)
            row = Row(self._next_id, list(prompt), params, emit, now, tpot_target_s, planned)
            self._next_id += 1
            self._inbox.append(row)
        return row

    def cancel(self, row: Row) -> None:
        row.is_cancelled = True

    @property
    def num_rows(self) -> int:
        """Rows running or joining, not counting cancelled ones."""
        return sum(not r.is_cancelled for r in self._rows) + sum(not r.is_cancelled for r in self._inbox)

    @property
    def has_work(self) -> bool:
        return bool(self._rows or self._inbox)

    def kv_bytes(self) -> int:
        """Bytes of KV memory held: every running row's own cache, and the compiled step's slabs (held throughout)."""
        own = sum(r.kv_bytes() for r in list(self._rows) if r.slot is None)
        return own + (self.compiled.kv_bytes() if self.compiled is not None else 0)

    # ---- the step (one thread) ----------------------------------------------------------

    @torch.inference_mode()
    def step(self, wait_layer: WaitLayer | None = None) -> None:
        """Admit joiners, drop cancelled rows, run one forward over the batch, sample, deliver events."""
        with self._lock:
            joining, self._inbox = self._inbox, []
        now = time.time()
        for row in joining:
            self._join(row, now)
        for row in [r for r in self._rows if r.is_cancelled]:
            self._leave(row, "cancelled", None)
        if not self._rows:
            return
        progress = [self._progress(r, now) for r in self._rows]
        # A cold actor's prompts run whole while no row decodes: its layers compute as they become resident.
        is_whole = wait_layer is not None and all(p.is_prefilling for p in progress)
        plan = plan_step(progress, None if is_whole else self._prefill_budget(progress))
        predicted_s = self._predict(progress, plan)
        threads = torch.get_num_threads()  # what this step computes on: fewer while the node is busy
        clock = self._clock
        clock.start()
        rows, tokens, inputs = [], [], []
        for row, (_, n) in zip(self._rows, plan, strict=True):
            if row.num_prefilled < len(row.prompt):
                start = row.num_prefilled
                chunk = row.prompt[start : start + n]
                row.num_prefilled += n  # a failing step ends every row (fail_all): no rollback needed
                needs_logits = row.num_prefilled == len(row.prompt)
            else:
                chunk, start, needs_logits = [row.last_token], row.position, True
            tokens += chunk
            inputs.append(RowInput(row.caches, start, n, needs_logits))
            if needs_logits:
                rows.append(row)
        if self._is_compiled_step(wait_layer, len(tokens)):
            logits = self.compiled.decode(tokens, [r.slot for r in self._rows], [i.start_pos for i in inputs])
        else:
            logits = self.model.forward_rows(torch.tensor(tokens, dtype=torch.long, device=self.device), inputs,
                                             wait_layer)
        ids = self._sample(logits, rows)
        clock.stop()
        ids = ids.tolist()
        seconds = clock.seconds()
        is_checked = wait_layer is None  # a cold actor's steps wait on its weights: not the rule's to predict
        if is_checked:
            self.step_check.observe(predicted_s / self.step_check.correction, seconds)
            self._log_check()
        for row in self._rows:  # every row advances every step (actors/scheduler.py)
            if row.first_time is not None:
                row.decode_s += seconds
            row.engine_s += seconds
            row.num_steps += 1
            row.num_step_rows += len(self._rows)
            row.num_step_threads += threads
            if is_checked:
                row.predicted_s += predicted_s
                row.checked_s += seconds
        now = time.time()
        for row, token_id in zip(rows, ids, strict=True):
            self._deliver(row, token_id, now)

    def _is_compiled_step(self, wait_layer: WaitLayer | None, num_tokens: int) -> bool:
        """Every row decodes one token from a slot of the compiled step, whose bucket is compiled."""
        compiled = self.compiled
        return (compiled is not None and wait_layer is None and num_tokens == len(self._rows)
                and all(r.slot is not None and r.num_prefilled == len(r.prompt) for r in self._rows)
                and compiled.is_compiled_for(len(self._rows), max(r.position for r in self._rows)))

    @staticmethod
    def _progress(row: Row, now: float) -> RowProgress:
        # The step clock, not the wall clock, measures its time per token: what the steps cost is what the
        # planner answers for (the host's few ms between steps are not), and what the checks predict. Its first
        # token's due time is the wall clock's: the client's wait is.
        limit = max_step_s(row.tpot_target_s, row.num_out, row.decode_s) if row.first_time is not None else None
        planned = row.first_token_planned
        return RowProgress(row.id, len(row.prompt), row.num_prefilled, row.position, row.tpot_target_s, limit,
                           None if planned is None or row.num_prefilled >= len(row.prompt) else planned - now)

    def _rule_step_s(self, num_rows: int, num_extra_prompt_tokens: int, num_kv_tokens: int,
                     num_attention_pairs: int = 0) -> float:
        return self.step_check.correction * self.step_cost.step_s(num_rows, num_extra_prompt_tokens, num_kv_tokens,
                                                                  self._kv_bytes_per_token, num_attention_pairs)

    def _prefill_budget(self, progress: list[RowProgress]) -> int | None:
        k = self.step_check.correction
        return prefill_budget(progress, self.prefill_chunk_tokens, self._rule_step_s,
                              k * self.step_cost.prefill_token_s(self._kv_bytes_per_token),
                              k / self.step_cost.attention_pairs_per_s)

    def _predict(self, progress: list[RowProgress], plan: list[tuple[int, int]]) -> float:
        """The planned step's predicted seconds, the correction included."""
        return self._rule_step_s(*step_terms(progress, plan))

    def _log_check(self) -> None:
        check = self.step_check
        if check.num_steps % LOG_EVERY_STEPS == 0:
            log.info("step time: predicted vs measured, median error %.0f%% over the last %d steps; "
                     "the rule's constants corrected by %.2fx", 100 * (check.median_error() or 0.0),
                     len(check.recent_errors), check.correction)

    def fail_all(self, error: BaseException) -> None:
        """A step raised: every row, running or joining, ends with `error` (the batch shares the model)."""
        with self._lock:
            rows, self._inbox = self._rows + self._inbox, []
        self._rows = []
        for row in rows:
            self._free_cache(row)
            row.stop = ("error", None)
            row.emit(error)

    def _join(self, row: Row, now: float) -> None:
        if row.is_cancelled:
            row.emit(self._finish_event(row, ("cancelled", None)))
            return
        p = row.params
        num_positions = len(row.prompt) + p.max_tokens
        claimed = self.compiled.claim(num_positions) if self.compiled is not None else None
        if claimed is not None:
            row.slot, row.caches = claimed
        else:  # its own cache, sized for it: its steps run eagerly
            row.caches = self.model.new_row_cache(num_positions, is_int8=self.is_kv_int8)
        row.generator = make_generator(p, self.device)
        row.decoder = StreamDecoder(self.tokenizer)
        row.stops = StopSequenceFilter(p.stop_sequences)
        row.compute_start = now
        self._rows.append(row)
        row.emit(StartEvent(now, self.step_check.correction, self.step_check.baseline))

    def _sample(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Each row's next token, [R] int64, from its logits [R, V]. The greedy rows with no token masked (the usual
        case) take one argmax together; the others sample one by one, each on its own generator. One host sync
        for the whole step follows (the caller's tolist)."""
        is_plain = [r.params.is_greedy and r.num_out >= r.params.min_tokens for r in rows]
        if all(is_plain):
            return greedy(logits)
        ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if plain := [i for i, p in enumerate(is_plain) if p]:
            ids[plain] = greedy(logits[plain])
        for i, (r, p) in enumerate(zip(rows, is_plain, strict=True)):
            if not p:
                ids[i] = sample(self._allowed(logits[i : i + 1], r), r.params, r.generator)[0]
        return ids

    def _allowed(self, logits: torch.Tensor, row: Row) -> torch.Tensor:
        """The row's logits [1, V], without the end-of-turn tokens while it is short of its `min_tokens`."""
        if row.num_out >= row.params.min_tokens:
            return logits
        eos = sorted(i for i in self.eos_token_ids if i < logits.shape[-1])  # [K]: a handful of ids
        return mask_tokens(logits, torch.tensor(eos, dtype=torch.long, device=logits.device)) if eos else logits

    def _deliver(self, row: Row, token_id: int, now: float) -> None:
        row.num_out += 1
        row.last_token = token_id
        row.last_time = now
        row.first_time = row.first_time or now
        # With ignore_eos an end-of-turn token is text like any other (a special token: none shown).
        is_eos = token_id in self.eos_token_ids and not row.params.ignore_eos
        is_last = is_eos or row.num_out >= row.params.max_tokens
        # Exactly one event per sampled token; the last one also flushes held-back text.
        piece = row.decoder.flush() if is_eos else row.decoder.push(token_id)
        if is_last and not is_eos:
            piece += row.decoder.flush()
        text, matched = row.stops.push(piece)
        if matched is None and is_last:
            text += row.stops.flush()
        event = TokenEvent(token_id, text, row.num_out, now)
        if matched is not None:
            self._leave(row, "stop_sequence", matched, event)
        elif is_eos:
            self._leave(row, "end_turn", None, event)
        elif is_last:
            self._leave(row, "max_tokens", None, event)
        else:
            row.emit(event)

    def _leave(self, row: Row, reason: str, sequence: str | None, last: TokenEvent | None = None) -> None:
        """The row ends: out of the batch, its cache freed, before anyone hears it (its last token, its finish)."""
        self._rows.remove(row)
        self._free_cache(row)
        if last is not None:
            row.emit(last)
        row.emit(self._finish_event(row, (reason, sequence)))

    def _drop(self, row: Row) -> None:
        """Take a row out wherever it is, without events (its consumer has gone)."""
        with self._lock:
            if row in self._inbox:
                self._inbox.remove(row)
        if row in self._rows:
            self._rows.remove(row)
        self._free_cache(row)

    def _free_cache(self, row: Row) -> None:
        row.caches = None
        if row.slot is not None:
            self.compiled.release(row.slot)
            row.slot = None

    @staticmethod
    def _finish_event(row: Row, stop: tuple[str, str | None]) -> FinishEvent:
        row.stop = stop
        return FinishEvent(stop_reason=stop[0], stop_sequence=stop[1], input_tokens=len(row.prompt),
                           output_tokens=row.num_out, compute_start=row.compute_start or row.added_at,
                           first_token_time=row.first_time, last_token_time=row.last_time,
                           engine_s=row.engine_s, num_steps=row.num_steps, num_step_rows=row.num_step_rows,
                           num_step_threads=row.num_step_threads,
                           predicted_step_s=row.predicted_s, checked_step_s=row.checked_s)

    # ---- one request on the calling thread ----------------------------------------------

    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        cancel: Callable[[], bool] | None = None,
        wait_layer: WaitLayer | None = None,
    ) -> Iterator[TokenEvent | FinishEvent]:
        """Stream one completion of `prompt` (token ids from `prepare`), stepping the engine here.

        `cancel` is polled between steps. Other rows in the batch advance too.
        """
        events: list[Event] = []
        row = self.add(prompt, params, events.append)
        try:
            while True:
                self.step(wait_layer)
                for event in events:
                    if isinstance(event, BaseException):
                        raise event
                    if not isinstance(event, StartEvent):
                        yield event
                    if isinstance(event, FinishEvent):
                        return
                events.clear()
                if cancel is not None and cancel():
                    self.cancel(row)
        finally:
            if row.stop is None:
                self._drop(row)  # closed early or failed: the row must not stay in the batch


class _StepClock:
    """One step's compute time: CUDA events on a GPU (the device's own time, not the host's
    launches), the host's clock on a CPU (the step computes on the calling thread).
    One per engine, restarted every step (the stepping thread's alone)."""

    def __init__(self, device: torch.device) -> None:
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._start = self._end = 0.0

    def start(self) -> None:
        if self._events is not None:
            self._events[0].record()
        self._start = time.perf_counter()

    def stop(self) -> None:
        """Mark the step's end (its work queued on the device; `seconds` waits for it)."""
        if self._events is not None:
            self._events[1].record()
        self._end = time.perf_counter()

    def seconds(self) -> float:
        if self._events is None:
            return self._end - self._start
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3
