"""One ingress replica's leases (lease.py): the rows it holds, what runs in them, and the view it decides on.

On the replica's event loop only (no lock): admission `take`s a free row for a request that the
pure `decide()` placed on the leased `view`, or `add`s the row the registry's slow path leased
to it; rows.py `release`s the row when the request ends. Once a heartbeat, admission sends the
`report` and `apply`s the grant that answers it.

Demand. For each model and lane, the most rows this replica had in use at once over the last
`demand_window_s`, plus `headroom_rows`, is what it asks to hold; rows beyond that are given back
free, so a replica whose traffic stopped holds nothing after the window. A request larger than
every free row (its KV bytes) takes the slow path; the largest request of the window sizes the
rows asked for.

Start leases (lease.py). A bind or spawn this replica made within `demand_window_s` (on a start lease,
or by the slow path) makes it want one start lease per model and lane. A free one shows in the view
as what it is — a warm actor to bind, or a slot with room for one actor — so the same `decide()`
weighs it against the leased rows; once used, its actor is left out of the view until it has sent
its first token (only then may it batch), and the row is a hot actor's from then on if the actor
stays hot. Otherwise, when its request ends, the row goes back with the next report.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

from serve_app.decisions import Bind, Decision, Dispatch, Join, Spawn
from serve_app.lease import BatchInfo, LeaseConfig, LeasedRow, LeaseGrant, LeaseReport, LeaseWant, RowUse
from serve_app.policy import PolicyConfig, decide
from serve_app.registry_records import AdoptedRow
from serve_app.scorer import Scorer
from serve_app.snapshot import ActorView, ClusterSnapshot, Lane, RequestFeatures, RowView, SlotView
from serve_app.ttft_check import faded

Key = tuple[str, Lane]  # (model, lane)


@dataclass(frozen=True)
class _Sample:
    at: float  # monotonic
    num_rows: int  # rows of the key in use just after a take
    row_bytes: int  # the request's bytes


@dataclass(frozen=True)
class _Start:
    """A bind or spawn this replica made (Key's model and lane), and what a spawn lease for them would hold."""

    at: float  # monotonic
    row_bytes: int
    resident_bytes: int
    max_hot: int
    num_warm: int


STEP_CORRECTION_HALF_LIFE_S = 10.0


class LeaseBook:
    def __init__(self, config: LeaseConfig, replica_id: str, max_batch: int, heartbeat_s: float,
                 node_cpus: int = 0) -> None:
        """`node_cpus`: the rule's (scorer.py), sent with start wants: no start lease on a node too busy."""
        self.config, self.replica_id, self._max_batch = config, replica_id, max_batch
        self._node_cpus = node_cpus
        self.ttl_s = config.ttl_heartbeats * heartbeat_s
        self._usable_s = self.ttl_s - heartbeat_s  # a margin of one heartbeat for the exchange's own time
        self._rows: dict[str, LeasedRow] = {}  # every row held, by id
        self._used: dict[str, RowUse] = {}  # row id -> the request running in it
        self._batches: dict[str, BatchInfo] = {}  # actor -> what else runs there (as of the last grant)
        self._valid_until = 0.0  # monotonic: no row is used after this without a renewal
        self._returned: list[str] = []  # rows given back, sent with the next report
        self._samples: dict[Key, deque[_Sample]] = {}
        self._contended: frozenset[str] = frozenset()  # models the registry lacks rows for (LeaseGrant)
        self._starts: dict[Key, deque[_Start]] = {}  # binds and spawns made, over the demand window
        self._start_uses: dict[str, bool] = {}  # start leases used -> first token seen; reported until answered
        self._started: set[str] = set()  # start leases whose actor sent its first token
        self._recalled: frozenset[str] = frozenset()  # start leases the registry wants back: unused, not used
        # actor -> its engine's step correction and baseline as its last Started said, and when (monotonic): a
        # join on it is priced by the correction, fading back to the baseline (`_step_correction`)
        self._step_corrections: dict[str, tuple[float, float, float]] = {}
        # row id -> (placed at, first token due, the actor's step correction it was priced with), monotonic,
        # until its first token: a prompt overdue says its actor runs slower now than any Started has said
        self._first_token_due: dict[str, tuple[float, float, float]] = {}

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    @property
    def num_free(self) -> int:
        return len(self._rows) - len(self._used)

    def has_free(self, model: str) -> bool:
        """A free row of `model` is held (valid or not: a request would at least be decided)."""
        return any(row.model == model and r not in self._used for r, row in self._rows.items())

    def is_valid(self, now: float | None = None) -> bool:
        return self.config.is_enabled and (time.monotonic() if now is None else now) <= self._valid_until

    # ---- deciding ------------------------------------------------------------------------

    def view(self, features: RequestFeatures, now: float | None = None, lane: str | None = None) -> ClusterSnapshot | None:
        """The leased actors of the model with a free row that fits the request, and its free start leases
        (of `lane`, where given), as `decide()` reads them; None if there is none (or the leases are not
        valid now): the request takes the slow path."""
        if not self.is_valid(now):
            return None
        now = time.monotonic() if now is None else now
        need = features.dispatch_bytes
        mine: dict[str, list[LeasedRow]] = {}  # actor -> every row of ours on it
        free: dict[str, int] = {}  # actor -> the largest fitting free row it has for us
        starts: list[LeasedRow] = []  # free start leases that fit
        for row_id, row in self._rows.items():
            if row.model != features.model:  # an actor serves one model: another's rows are on other actors
                continue
            if row.start:  # a start lease: free, a warm actor or a slot to start one on; used, not batching yet
                if (row_id not in self._used and row_id not in self._recalled and row.row_bytes >= need
                        and (lane is None or row.lane == lane)):
                    starts.append(row)
                continue
            mine.setdefault(row.actor_name, []).append(row)
            if row_id not in self._used and row.row_bytes >= need:
                free[row.actor_name] = max(free.get(row.actor_name, 0), row.row_bytes)
        if not free and not starts:
            return None
        slots: dict[str, SlotView] = {}
        actors = []
        for name, row_bytes in free.items():
            batch, ours = self._batches.get(name), mine[name]
            some_row = ours[0]
            used = tuple(_row_view(r, self._used[r.row_id]) for r in ours if r.row_id in self._used)
            others = batch.other_rows[:max(0, self._max_batch - len(ours))] if batch is not None else ()
            rows = used + others
            actors.append(ActorView(name, some_row.model, some_row.slot_id, "busy" if rows else "idle",
                                    some_row.lane, True, some_row.resident_bytes, rows,
                                    step_correction=self._live_correction(name, now)))
            # The slot as the registry last showed it, but with only what this replica may use of it free.
            base = batch.slot if batch is not None else SlotView(some_row.slot_id, "", row_bytes, 0, 1)
            seen = slots.get(base.slot_id)
            room = max(row_bytes, seen.free_bytes if seen is not None else 0)
            slots[base.slot_id] = SlotView(base.slot_id, base.node_id, base.total_bytes,
                                           max(0, base.total_bytes - room), base.num_actors,
                                           base.fragmentation, base.utilization)
        for row in starts:
            if row.slot_id in slots:  # a slot of our hot rows too (several actors a slot): left to the registry
                continue
            if row.start == "warm":
                actors.append(ActorView(row.actor_name, row.model, row.slot_id, "warm", row.lane, False,
                                        row.resident_bytes, (), row.resident_fraction))
                slots[row.slot_id] = SlotView(row.slot_id, row.node_id, row.resident_bytes + row.row_bytes,
                                              row.resident_bytes, 1)
            else:  # the slot's room for one actor and its row, and nothing else
                slots[row.slot_id] = SlotView(row.slot_id, row.node_id, row.resident_bytes + row.row_bytes, 0, 0)
        return ClusterSnapshot(tuple(slots[s] for s in sorted(slots)), tuple(actors))

    def place(self, features: RequestFeatures, policy: PolicyConfig, scorer: Scorer, at: float,
              now: float | None = None) -> tuple[Join | Dispatch, LeasedRow] | None:
        """A join or dispatch on a row this replica leases, decided by the same `decide()` on the leased view
        alone, and the row taken; None when the leases cannot place the request (the slow path decides).
        `at`: the clock the row's predicted end is on (epoch seconds here, simulated ones in the simulator)."""
        view = self.view(features, now, policy.lane(features.input_tokens, features.max_tokens))
        if view is None:
            return None
        decision = decide(features, view, policy, scorer)
        if isinstance(decision, (Bind, Spawn)):
            start = self._start_lease(decision, features)
            if start is None:  # a spawn beside a hot row's actor, or another lane's lease: the registry decides
                return None
            decision = replace(decision, keep_hot=start.keep_hot)  # the registry counted its actor so
            self._use(start, features, at + _total_s(decision), now, decision)
            return decision, start
        if not isinstance(decision, (Join, Dispatch)):
            return None  # no leased row meets the targets: the registry knows every other option
        if isinstance(decision, Dispatch):  # the actor is hot and leased: it stays hot
            decision = replace(decision, keep_hot=True)
        return decision, self.take(decision, features, at + _total_s(decision), now)

    def take(self, decision: Join | Dispatch, features: RequestFeatures, predicted_end: float,
             now: float | None = None) -> LeasedRow:
        """The free row on the decision's actor that fits the request most tightly, now in use by it."""
        need = features.dispatch_bytes
        fitting = [r for r in self._rows.values() if r.actor_name == decision.actor_name and not r.start
                   and r.row_id not in self._used and r.row_bytes >= need]
        if not fitting:
            raise ValueError(f"no free leased row on {decision.actor_name} fits {need} bytes")
        row = min(fitting, key=lambda r: r.row_bytes)
        self._use(row, features, predicted_end, now, decision)
        return row

    def add(self, row: LeasedRow, features: RequestFeatures, predicted_end: float, now: float | None = None,
            decision: Decision | None = None) -> None:
        """A row the slow path placed the request in, leased to this replica from the start."""
        self._rows[row.row_id] = row
        self._use(row, features, predicted_end, now, decision)

    def note_start(self, model: str, lane: str, row_bytes: int, resident_bytes: int, max_hot: int, num_warm: int,
                   now: float | None = None) -> None:
        """A bind or spawn was made for a request of `model` and `lane` (on a start lease, or by the slow path);
        `max_hot` and `num_warm`: the policy's hot actors and warm pool for them."""
        at = time.monotonic() if now is None else now
        self._starts.setdefault((model, lane), deque()).append(_Start(at, row_bytes, resident_bytes, max_hot,
                                                                      num_warm))

    def started(self, row_id: str) -> None:
        """A start lease's actor sent its first token: every weight is in, it may batch. An actor that stays hot
        is a hot actor's row from now on, in this view too; the registry hears it with the next report."""
        row = self._rows.get(row_id)
        if row is None or not row.start:
            return
        self._start_uses[row_id] = True
        self._started.add(row_id)
        if row.keep_hot:
            self._rows[row_id] = replace(row, start="")

    def release(self, row_id: str) -> bool:
        """The row's request ended (complete, or cancelled once its stream has ended): free again — or, while
        its model is contended, forgotten here; True then, and the caller gives it back at once. A start
        lease's row whose actor does not stay hot goes back with the next report (the actor exits by itself);
        one whose actor never sent a token is the caller's to end (`is_unstarted_start`)."""
        self._used.pop(row_id, None)
        row = self._rows.get(row_id)
        if row is not None and row.start:
            self.forget(row_id)
            self._returned.append(row_id)
            return False
        if row is None or row.model not in self._contended:
            return False
        self.forget(row_id)
        return True

    def give_back_contended(self) -> tuple[str, ...]:
        """The free rows of contended models, forgotten here: the caller gives them back at once."""
        return tuple(r for model in self._contended for r in self.give_back_free(model))

    def forget(self, row_id: str) -> None:
        """The registry already took the row back (an abandoned admission): not ours any more."""
        self._rows.pop(row_id, None)
        self._used.pop(row_id, None)
        self._started.discard(row_id)

    def give_back_free(self, model: str) -> tuple[str, ...]:
        """The free rows of `model`, forgotten here: a slow-path admission returns them to the registry first."""
        free = tuple(r for r, row in self._rows.items() if row.model == model and r not in self._used)
        for row_id in free:
            self.forget(row_id)
        return free

    def drop_actor(self, actor_name: str) -> None:
        """The actor failed: the registry forgets it with every row on it."""
        for row_id in [r for r, row in self._rows.items() if row.actor_name == actor_name]:
            self.forget(row_id)

    # ---- the heartbeat -------------------------------------------------------------------

    def report(self, now: float | None = None) -> LeaseReport:
        """What the next exchange sends: uses, rows given back (forgotten here at once), rows wanted."""
        now = time.monotonic() if now is None else now
        wanted = []
        for key in set(self._samples) | set(self._starts) | {(r.model, r.lane) for r in self._rows.values()}:
            samples = self._samples.get(key, deque())
            while samples and now - samples[0].at > self.config.demand_window_s:
                samples.popleft()
            want_start = self._wants_start(key, now)
            for r in [r for r in self._rows.values() if (r.model, r.lane) == key and r.start]:
                is_unwanted = want_start is None or r.row_id in self._recalled
                if is_unwanted and r.row_id not in self._used and r.row_id not in self._start_uses:  # unused
                    self.forget(r.row_id)
                    self._returned.append(r.row_id)
            held = [r for r in self._rows.values() if (r.model, r.lane) == key and not r.start]
            in_use = sum(1 for r in held if r.row_id in self._used)
            peak = max([s.num_rows for s in samples] + [in_use])
            headroom = 0 if key[0] in self._contended else self.config.headroom_rows
            target = peak + headroom if peak else 0
            free = [r for r in held if r.row_id not in self._used]
            for r in sorted(free, key=lambda r: r.row_bytes)[:max(0, len(held) - target)]:
                self.forget(r.row_id)
                self._returned.append(r.row_id)
            row_bytes = max([s.row_bytes for s in samples] + [r.row_bytes for r in held], default=0)
            if want_start is not None:
                wanted.append(LeaseWant(key[0], key[1], target, max(row_bytes, want_start.row_bytes), 1,
                                        want_start.resident_bytes, want_start.max_hot, want_start.num_warm,
                                        self._node_cpus))
            elif target and row_bytes:
                wanted.append(LeaseWant(key[0], key[1], target, row_bytes))
            if not samples:
                self._samples.pop(key, None)
        returned, self._returned = tuple(self._returned), []
        return LeaseReport(self.replica_id, self.ttl_s, returned, dict(self._used), tuple(wanted),
                           frozenset(self._rows), start_uses=dict(self._start_uses),
                           step_corrections={name: self._live_correction(name, now) for name in self._step_corrections},
                           step_baselines={name: c[1] for name, c in self._step_corrections.items()})

    def apply(self, report: LeaseReport, grant: LeaseGrant, sent_at: float) -> None:
        """The answer to `report`, sent at `sent_at` (monotonic): rows it knew of that the registry no
        longer holds for us are forgotten (a row added since it was sent is kept), new rows are free."""
        for row_id in report.known - grant.held:
            self.forget(row_id)
        for row_id, is_started in report.start_uses.items():  # answered: the registry follows them now
            if self._start_uses.get(row_id) == is_started:
                del self._start_uses[row_id]
        self._recalled = grant.recalled_starts
        self._rows.update((r.row_id, r) for r in grant.granted)
        self._contended = grant.contended
        self._batches = {b.actor_name: b for b in grant.batches}
        self._valid_until = sent_at + self._usable_s
        held_actors = {r.actor_name for r in self._rows.values()}
        for name in [n for n in self._step_corrections if n not in held_actors]:
            del self._step_corrections[name]
        for b in grant.batches:  # an actor newly held: its registry's long-run figure until a Started says more
            if b.actor_name not in self._step_corrections and b.step_baseline > 0 and b.step_baseline != 1.0:
                self._step_corrections[b.actor_name] = (b.step_baseline, b.step_baseline, sent_at)
        for row_id in [r for r in self._first_token_due if r not in self._used]:  # ended before its first token
            del self._first_token_due[row_id]

    def handed_over(self) -> list[AdoptedRow]:
        """Every row held, for a registry that restarted empty: re-adopted as rows are."""
        out = []
        for r in self._rows.values():
            use = self._used.get(r.row_id)
            is_started = not r.start or r.row_id in self._started
            is_unused = r.start and use is None and r.row_id not in self._start_uses and not is_started
            out.append(AdoptedRow(r.actor_name, r.model, r.slot_id, r.lane, r.keep_hot, is_started, r.resident_bytes,
                                  r.row_id, r.row_bytes, use.num_tokens if use else 0,
                                  use.tpot_target_s if use else None, use.predicted_end if use else time.time(),
                                  self.ttl_s, self.replica_id, is_lease=True, start=r.start if is_unused else ""))
        return out

    # ---- internals -----------------------------------------------------------------------

    def _wants_start(self, key: Key, now: float) -> _Start | None:
        """The latest bind or spawn of the key within the window, if start leases are on and it is not
        contended: one start lease is wanted for it."""
        starts = self._starts.get(key)
        while starts and now - starts[0].at > self.config.demand_window_s:
            starts.popleft()
        if not starts:
            self._starts.pop(key, None)
            return None
        if not self.config.is_start_enabled or key[0] in self._contended:
            return None
        return starts[-1]

    def _start_lease(self, decision: Bind | Spawn, features: RequestFeatures) -> LeasedRow | None:
        """The free start lease a Bind or Spawn decided on the leased view names — its warm actor, or its slot
        — if its lane is the decision's (a warm actor bound for the other lane would change lanes unseen by
        the registry) and its row fits; None otherwise (a spawn with evictions, or beside a hot row's actor)."""
        if getattr(decision, "evict", ()):
            return None
        for r in self._rows.values():
            if (r.row_id in self._used or r.row_id in self._recalled or r.lane != decision.lane
                    or r.row_bytes < features.dispatch_bytes):
                continue
            if (r.start == "warm" and isinstance(decision, Bind) and r.actor_name == decision.actor_name) or (
                    r.start == "spawn" and isinstance(decision, Spawn) and r.slot_id == decision.slot_id):
                return r
        return None

    def is_unstarted_start(self, row_id: str) -> bool:
        """A start lease used by a request whose actor has not sent a token: still loading for it."""
        row = self._rows.get(row_id)
        return row is not None and bool(row.start) and row_id not in self._started

    def in_use(self, model: str) -> dict[str, RowUse]:
        """The rows of `model` this replica runs requests in now, and their requests (SlowPathLease)."""
        return {row_id: use for row_id, use in self._used.items()
                if (row := self._rows.get(row_id)) is not None and row.model == model}

    def note_step_correction(self, actor_name: str, correction: float, baseline: float = 1.0,
                             now: float | None = None) -> None:
        """What the actor's engine said of its steps when a request of ours started there (Started): their
        measured ÷ rule-predicted time now, and its long-run average (actors/step_cost.py, StepCheck)."""
        if correction > 0 and baseline > 0 and any(r.actor_name == actor_name for r in self._rows.values()):
            self._step_corrections[actor_name] = (correction, baseline, time.monotonic() if now is None else now)

    def _step_correction(self, actor_name: str, now: float) -> float:
        """The actor's correction as last heard, fading back to its baseline with STEP_CORRECTION_HALF_LIFE_S.

        It is heard only when a request starts there. An actor slowed by a burst and then left alone (every
        request refused on the strength of that figure) would otherwise never be tried again: fading, its
        next prediction is its usual speed's, a request is admitted, and its Started says how fast it runs
        now. Its usual speed, not the rule's constants': on a machine unlike theirs (fp32 where they were
        fitted in bf16) the constants' speed is one the actor never runs at, and a burst after a pause was
        priced at a third of what it took (by hand: 6 joins predicted within 1 s took 2 s).
        """
        correction, baseline, at = self._step_corrections.get(actor_name, (1.0, 1.0, now))
        return baseline + faded(correction - baseline, now - at, STEP_CORRECTION_HALF_LIFE_S)

    def _live_correction(self, actor_name: str, now: float) -> float:
        """The actor's step correction, or more where a prompt of ours there is overdue.

        A row whose first token was due by now, priced with correction k, `elapsed` after it was placed
        and `predicted` before it was due, shows the actor running at least k * elapsed / predicted times
        the rule right now: a joiner's prompt shares the steps with that one (actors/scheduler.py). No
        Started says so (the actor's steps report when a row starts, and a stalled host delays every step):
        in a bench_peer run before this (uncommitted), a load generator starting up stalled a hot request
        4 s past its 0.5 s prediction, and the join placed 1 s later on the old figure took 6.8 s."""
        correction = self._step_correction(actor_name, now)
        for row_id, (placed_at, due, priced_with) in self._first_token_due.items():
            row, use = self._rows.get(row_id), self._used.get(row_id)
            if (row is None or use is None or row.actor_name != actor_name or not use.pending_prompt_tokens
                    or now <= due or due <= placed_at):
                continue
            correction = max(correction, priced_with * (now - placed_at) / (due - placed_at))
        return correction

    def step_corrections(self, now: float | None = None) -> dict[str, float]:
        """Every actor this replica holds rows on -> its step correction as it stands now (SlowPathLease)."""
        now = time.monotonic() if now is None else now
        return {name: self._live_correction(name, now) for name in {r.actor_name for r in self._rows.values()}}

    def prompt_done(self, row_id: str) -> None:
        """The request in leased row `row_id` has its first token: its prompt no longer delays a joiner's."""
        self._first_token_due.pop(row_id, None)
        use = self._used.get(row_id)
        if use is not None and use.pending_prompt_tokens:
            self._used[row_id] = replace(use, pending_prompt_tokens=0)

    def _use(self, row: LeasedRow, features: RequestFeatures, predicted_end: float, now: float | None,
             decision: Decision | None = None) -> None:
        if row.start:
            self._start_uses[row.row_id] = False
        self._used[row.row_id] = RowUse(features.num_tokens, features.tpot_target_s, predicted_end,
                                        features.input_tokens)
        key = (row.model, row.lane)
        in_use = sum(1 for r in self._rows.values() if (r.model, r.lane) == key and r.row_id in self._used)
        at = time.monotonic() if now is None else now
        predicted = getattr(decision, "prediction", None)
        if predicted is not None and predicted.ttft_s > 0 and not row.start:  # a start's first token waits on a load
            priced_with = getattr(getattr(decision, "candidate", None), "step_correction", 1.0)
            self._first_token_due[row.row_id] = (at, at + predicted.ttft_s, priced_with)
            # The figure the decision priced the actor with (the registry's, on the slow path), until its Started
            # says more: a book that gave its rows there back has forgotten its own, and the next join there,
            # placed before that Started, was priced at the rule's constants (by hand: 4x under, 7-10 s TTFTs).
            if priced_with > 0 and row.actor_name not in self._step_corrections:
                self._step_corrections[row.actor_name] = (priced_with, priced_with, at)
        self._samples.setdefault(key, deque()).append(_Sample(at, in_use, features.dispatch_bytes))


def _total_s(decision) -> float:
    return decision.prediction.total_s if decision.prediction is not None else 0.0


def _row_view(row: LeasedRow, use: RowUse) -> RowView:
    return RowView(row.row_bytes, use.num_tokens, use.tpot_target_s, use.predicted_end, use.pending_prompt_tokens)
