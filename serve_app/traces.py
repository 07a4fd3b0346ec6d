"""Request traces: one JSON line per request, the data the XGBoost scorer is trained on.

Each line holds the request's features at decision time, the decision (the chosen
candidate and what the scorer predicted for it, or the refusal), and, for admitted
requests, the measured outcome. Off unless the app config switches it on
(`traces: {enabled: true}`).

A line (schema "zq-trace/3"; times are seconds, measured from the request's arrival at
the ingress; `null` where a value does not apply):

    {"schema": "zq-trace/3", "time": <arrival, epoch s>, "request_id": "req_…", "model": "zq-demo",
     "features": {"input_tokens", "max_tokens", "temperature", "top_k", "top_p", "weight_bytes",
                  "kv_bytes_per_token", "workspace_bytes", "actor_overhead_bytes",
                  "ttft_target_s", "total_target_s", "tpot_target_s"},
     "decision": {"kind": "dispatch" | "join" | "bind" | "spawn" | "reject", "reason", "message" (a refusal's
                  own words: what it found, the fastest predicted TTFT for a latency target), "slot_id", "lane",
                  "keep_hot", "reserve_bytes", "tier": "hot" | "join" | "warm" | "cold", "evict": [actor names],
                  "candidate": {Candidate's fields, batch_rows, batch_tokens and resident_fraction included},
                  "predicted": {"ttft_s", "total_s", "tpot_s", "ttft_high_s" (the TTFT bound a target was
                  checked against, ttft_check.py; null: ttft_s)}},
     "outcome": null for refusals, else {"ok", "error", "dispatch_s", "load_s", "ttft_s", "ttft_seen_s", "total_s",
                "tpot_s", "output_tokens", "stop_reason", "is_cold", "first_layers", "reserved_bytes", "peak_bytes",
                "mean_step_threads"}}

`ok` is true for a completed request; otherwise `error` is how it ended ("cancelled",
"failed") and no timings follow. `tpot_s` is the measured time per output token once
decoding, (last token - first token) / (output tokens - 1): for a row of a batch, the
batch's step time as that row saw it. It is null with fewer than 2 output tokens (no step
after the first token was timed). `ttft_s` ends where the actor sampled the first token,
`ttft_seen_s` where the ingress received it: what lies between (the actor's event loop, Ray's
stream, the ingress's loop) a client waits for too (null in lines written before it was recorded;
across nodes it holds the two clocks' offset). `load_s` is actor start to all layers resident (cold
requests only). `peak_bytes` is the request's peak as the actor measured it
(actors/peak_memory.py: the CUDA allocator's peak, or the CPU process's peak resident
set); `reserved_bytes` is what the registry reserved for the request, which the ingress
knows exactly. `mean_step_threads` is the mean of torch's threads over the steps the request took part
in (actors/thread_governor.py drops to fewer while the node's other processes are busy); null where
the actor did not say.

`tier` is where the request ran: an idle hot actor, a hot actor's batch, a bound warm actor
(its process up, its first layers in) or a fresh actor; `evict` names the idle hot or
warm actors a spawn retired to make room (empty otherwise).

Older lines. "zq-trace/2" lines were recorded before warm actors existed: no request
ran on one, and a scorer trained on them could not rank a warm candidate. "zq-trace/1"
lines were recorded before hot actors ran batches. They could
be converted (no batch fields means an empty batch, and TPOT follows from total - TTFT),
but their timings are the old runtime's, and a scorer trained on them would predict a
system that no longer runs. `read_traces` skips them, with one warning per file that says
how many, and counts them for its caller (`train_scorer` names them when too few rows
are left). Skipping rather than refusing the file keeps the newer part of a file that was
appended to across an upgrade (the writer appends to whatever is at its path).

Writing never blocks the caller: `TraceWriter.write` puts the record on a bounded queue
(a full queue drops it, with a warning) and one thread serialises and appends. The file is
bounded: a line that would take it past `max_bytes` first moves it to `<path>.1` (replacing
an older one), so traces take at most twice `max_bytes` on disk.

Several ingress replicas may share one path. Each append (check the size, maybe rotate,
write) holds an exclusive `flock` on `<path>.lock`, so no replica appends to a file another
has just moved away, and no two rotate the same full file (the second would replace the
first's `.1` with a nearly empty file). The size checked is the file's own, not a count of
this replica's lines.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCHEMA = "zq-trace/3"
SCHEMA_FAMILY = "zq-trace/"  # another version of this schema: counted as such when skipped


@dataclass(frozen=True)
class TraceConfig:
    path: str
    max_bytes: int = 64 << 20
    max_pending: int = 4096  # records queued for the writer thread; more are dropped

    def __post_init__(self) -> None:
        if self.max_bytes < 1024 or self.max_pending < 1:
            raise ValueError(f"TraceConfig needs max_bytes >= 1024 and max_pending >= 1, got {self}")


class TraceWriter:
    def __init__(self, config: TraceConfig) -> None:
        self.config = config
        self.path = Path(config.path)
        self.num_written = 0
        self.num_dropped = 0
        self._queue: queue.Queue = queue.Queue(config.max_pending)
        self._rotated = self.path.with_name(self.path.name + ".1")
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._thread = threading.Thread(target=self._run, name="zq-trace-writer", daemon=True)
        self._thread.start()

    def write(self, record: dict[str, Any]) -> bool:
        """Queue one record; False (and a warning now and then) when the queue is full."""
        try:
            self._queue.put_nowait(record)
            return True
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped in (1, 10, 100) or self.num_dropped % 1000 == 0:
                log.warning("trace writer is behind: %d records dropped", self.num_dropped)
            return False

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued record is on disk (tests, the trace generator)."""
        done = threading.Event()
        self._queue.put(done, timeout=timeout_s)
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                line = (json.dumps(item, separators=(",", ":"), allow_nan=False) + "\n").encode()
                self._append(line)
                self.num_written += 1
            except Exception:  # a bad record or a full disk costs that line, never the writer
                log.exception("trace record not written")
        for fd in (self._fd, self._lock_fd):
            if fd is not None:
                os.close(fd)

    def _append(self, line: bytes) -> None:
        if len(line) > self.config.max_bytes:
            raise ValueError(f"a {len(line)}-byte trace line exceeds max_bytes")
        if self._lock_fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        # Other replicas check, rotate and append under the same lock (module docstring).
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            if self._fd is None or self._is_moved():
                self._open()
            if os.fstat(self._fd).st_size + len(line) > self.config.max_bytes:
                os.replace(self.path, self._rotated)
                self._open()
            # One write of the whole line to an O_APPEND file. A short write (a signal, a
            # nearly full disk) is finished while the lock is held: no other line lands inside it.
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view):]
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _open(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None  # never a closed fd, should the open below fail
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _is_moved(self) -> bool:
        """Another replica rotated the file: reopen, so this one follows the new file."""
        try:
            return os.stat(self.path).st_ino != os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return True


# ---------------------------------------------------------------- records


def features_record(features: Any) -> dict[str, Any]:
    """A `RequestFeatures` (duck-typed) as the trace stores it."""
    return {name: getattr(features, name) for name in (
        "input_tokens", "max_tokens", "temperature", "top_k", "top_p", "weight_bytes", "kv_bytes_per_token",
        "workspace_bytes", "actor_overhead_bytes", "ttft_target_s", "total_target_s", "tpot_target_s")}


def decision_record(decision: Any) -> dict[str, Any]:
    """A `Dispatch`, `Join`, `Bind`, `Spawn` or `Reject` (duck-typed) as the trace stores it."""
    kind = type(decision).__name__.lower()
    if kind == "reject":
        return {"kind": kind, "reason": decision.reason, "retry_after_s": decision.retry_after_s,
                "message": decision.message}
    candidate, predicted = decision.candidate, decision.prediction
    return {
        "kind": kind, "slot_id": decision.slot_id, "lane": decision.lane, "keep_hot": decision.keep_hot,
        "reserve_bytes": decision.reserve_bytes,
        "tier": None if candidate is None else candidate.kind, "evict": list(getattr(decision, "evict", ())),
        "candidate": None if candidate is None else asdict(candidate),
        "predicted": None if predicted is None else {"ttft_s": predicted.ttft_s, "total_s": predicted.total_s,
                                                     "tpot_s": predicted.tpot_s, "ttft_high_s": predicted.ttft_high_s},
    }


def outcome_record(arrival: float, dispatch_time: float, reserved_bytes: int, completion: Any | None,
                   error: str | None = None, first_token_seen_at: float = 0.0) -> dict[str, Any]:
    """What was measured for an admitted request.

    `completion` is the actor's `Completion` when the request completed; `error` is None
    then, else how it ended ("cancelled", "failed"). `first_token_seen_at`: when the ingress
    received the first token (0: it did not).
    """
    out: dict[str, Any] = {"ok": completion is not None and error is None, "error": error,
                           "dispatch_s": dispatch_time - arrival, "reserved_bytes": reserved_bytes}
    if completion is None:
        return out
    t = completion.timings
    out.update(
        load_s=(t.all_layers_resident - t.actor_start
                if completion.is_cold and t.all_layers_resident is not None else None),
        ttft_s=None if t.first_token is None else t.first_token - arrival,
        ttft_seen_s=first_token_seen_at - arrival if first_token_seen_at else None,
        total_s=None if t.last_token is None else t.last_token - arrival,
        tpot_s=tpot_s(t.first_token, t.last_token, completion.output_tokens),
        output_tokens=completion.output_tokens, stop_reason=completion.stop_reason,
        is_cold=completion.is_cold, first_layers=completion.first_layers,
        peak_bytes=getattr(completion, "peak_bytes", None),
        mean_step_threads=getattr(completion, "mean_step_threads", None) or None,
    )
    return out


def tpot_s(first_token: float | None, last_token: float | None, output_tokens: int) -> float | None:
    """Seconds per output token after the first; None with fewer than 2 tokens or a missing time."""
    if first_token is None or last_token is None or output_tokens < 2:
        return None
    return (last_token - first_token) / (output_tokens - 1)


def trace_record(request_id: str, model: str, arrival: float, features: Any, decision: Any,
                 outcome: dict[str, Any] | None) -> dict[str, Any]:
    return {"schema": SCHEMA, "time": arrival, "request_id": request_id, "model": model,
            "features": features_record(features), "decision": decision_record(decision), "outcome": outcome}


def read_traces(paths: Iterable[str | Path], skipped: Counter | None = None) -> Iterator[dict[str, Any]]:
    """Every well-formed "zq-trace/3" record of the files, in order.

    A torn or foreign line is skipped; so is a line of another zq-trace version, with a
    warning per file (see the module docstring). `skipped`, if given, counts the lines
    left out: under their schema for other zq-trace versions, else "torn" or "foreign".
    """
    skipped = Counter() if skipped is None else skipped
    for path in paths:
        old = Counter()
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    skipped["torn"] += 1
                    continue
                schema = record.get("schema") if isinstance(record, dict) else None
                if schema == SCHEMA:
                    yield record
                elif isinstance(schema, str) and schema.startswith(SCHEMA_FAMILY):
                    old[schema] += 1
                else:
                    skipped["foreign"] += 1
        for schema, n in sorted(old.items()):
            log.warning("%s: %d %s lines skipped (recorded by another version of the app); only %s is read",
                        path, n, schema, SCHEMA)
        skipped.update(old)
