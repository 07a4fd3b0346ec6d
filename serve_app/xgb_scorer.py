"""The XGBoost scorer: each candidate's TTFT, total time and TPOT, predicted from measured traces.

The model (trained by `serve_app.train_scorer` on the traces the ingress records) is one
multi-output booster with three targets: log TTFT and log total time, both seconds from
the request's arrival at the ingress, and log TPOT, seconds per output token once
decoding (for a join, the batch's step time with the new row in it). Per decision the
scorer builds one small float32 matrix, one row per candidate (`FEATURE_NAMES`), and
predicts it in one `Booster.inplace_predict` call: no DMatrix per request, one booster
call per decision (one booster per target would be three calls, each with a fixed cost
that dwarfs the trees: see benchmarks/results/decision.md).

Features (schema "zq-scorer/3"). Per candidate: its kind (`is_cold`, `is_join`, `is_warm`;
all 0 for an idle hot actor) and the share of its weights already resident
(`resident_fraction`: 1 on a hot actor, a warm actor's first layers, 0 on a fresh one), the slot's telemetry and its node's load, and the batch a join
would enter: `batch_rows`, `batch_tokens` (KV positions those rows read per step, at most)
and `batch_kv_read_bytes` = (batch_tokens + the request's own input + max_tokens) x its
kv_bytes_per_token: the KV bytes one step reads once the request runs there (for an idle
or fresh actor, its own alone). A decode step reads every weight once for the whole
batch, so what makes a bigger batch slower is mostly that KV read: the memory-aware
batching feature, given to the trees directly because a sum of products is what trees
learn worst. Then
the request's own columns, the same on every row of one decision.

Predictions are well-formed by construction, so `decide` never has to fall back for a
model's numbers alone: the log outputs are clipped to `LOG_S_BOUNDS` (a tree sum far
outside the training data can land anywhere, and `math.exp` raises past ~709), then
TTFT, total and TPOT are exp() of them, and total is raised to at least TTFT.

Files. `scorer.ubj` is XGBoost's own UBJSON format (`Booster.save_model`), never pickle.
Beside it, `scorer.json` (the card) names the schema, the feature names in order, the
targets, the held-out accuracy and the SHA-256 of the model file. Loading checks the hash
*before* XGBoost parses a byte: XGBoost aborts the whole process on some truncated files
(a C++ `terminate`, not an exception), so a damaged file must never reach its parser.
Then the card's schema, features and targets, the booster's own feature names and count,
and one probe prediction of the expected shape must match. A "zq-scorer/1" model (two
targets, no batch features: trained before hot actors ran batches) is refused like any
other mismatch. `load_scorer` never raises: a missing, damaged, old or mismatched model
logs a warning and returns the rule scorer.

Only XGBoost's public API is used. An earlier version called the C library through
`xgboost.core._LIB` with prepared arguments, which halved the decision's time; a private
entry point can change under any release, and the project takes the public call's cost.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from serve_app.scorer import RULE_SCORER, Candidate, Prediction, Scorer

if TYPE_CHECKING:
    from serve_app.snapshot import RequestFeatures

log = logging.getLogger(__name__)

SCHEMA = "zq-scorer/3"
# Candidate columns first, then the request's (the same for every row of one decision).
CANDIDATE_FEATURES = ("is_cold", "is_join", "is_warm", "resident_fraction", "slot_fragmentation",
                      "slot_utilization", "node_num_busy", "batch_rows", "batch_tokens", "batch_kv_read_bytes")
REQUEST_FEATURES = ("input_tokens", "max_tokens", "is_greedy", "top_k", "top_p", "weight_bytes",
                    "kv_bytes_per_token")
FEATURE_NAMES = CANDIDATE_FEATURES + REQUEST_FEATURES
TARGETS = ("log_ttft_s", "log_total_s", "log_tpot_s")
# Predictions are kept within 1 µs .. ~11.6 days: well-formed whatever the trees add up to.
LOG_S_BOUNDS = (math.log(1e-6), math.log(1e6))
MAX_MODEL_BYTES = 64 << 20


class ScorerLoadError(ValueError):
    """A model file that must not be used; `load_scorer` turns it into a warning."""


def request_columns(f: RequestFeatures) -> list[float]:
    return [float(f.input_tokens), float(f.max_tokens), 1.0 if f.temperature == 0 else 0.0,
            float(f.top_k or 0), 1.0 if f.top_p is None else float(f.top_p), float(f.weight_bytes),
            float(f.kv_bytes_per_token)]


def candidate_columns(c: Candidate, f: RequestFeatures) -> list[float]:
    kv_read_bytes = (c.batch_tokens + f.input_tokens + f.max_tokens) * f.kv_bytes_per_token
    resident = 1.0 if c.kind in ("hot", "join") else float(c.resident_fraction)
    return [1.0 if c.kind == "cold" else 0.0, 1.0 if c.kind == "join" else 0.0, 1.0 if c.kind == "warm" else 0.0,
            resident, float(c.slot_fragmentation), float(c.slot_utilization), float(c.node_num_busy), float(c.batch_rows), float(c.batch_tokens),
            float(kv_read_bytes)]


def feature_matrix(features: RequestFeatures, candidates: Sequence[Candidate]) -> np.ndarray:
    """One float32 row per candidate, columns in `FEATURE_NAMES` order (training uses this too)."""
    common = request_columns(features)
    return np.array([candidate_columns(c, features) + common for c in candidates], dtype=np.float32).reshape(
        len(candidates), len(FEATURE_NAMES))


def card_path(model_path: str | Path) -> Path:
    return Path(model_path).with_suffix(".json")


@dataclass(frozen=True)
class ScorerCard:
    """The sidecar of a model file: what it predicts from what, how well, and its hash."""

    sha256: str
    schema: str = SCHEMA
    feature_names: tuple[str, ...] = FEATURE_NAMES
    targets: tuple[str, ...] = TARGETS
    xgboost_version: str = ""
    training: dict[str, Any] = field(default_factory=dict)  # traces, rows, seed, parameters
    held_out: dict[str, Any] = field(default_factory=dict)  # MAE, R², hindsight share

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ScorerCard:
        try:
            raw = json.loads(text)
            card = cls(sha256=str(raw["sha256"]), schema=str(raw["schema"]),
                       feature_names=tuple(raw["feature_names"]), targets=tuple(raw["targets"]),
                       xgboost_version=str(raw.get("xgboost_version", "")),
                       training=dict(raw.get("training", {})), held_out=dict(raw.get("held_out", {})))
        except (ValueError, KeyError, TypeError) as e:
            raise ScorerLoadError(f"unreadable scorer card: {e}") from None
        if card.schema != SCHEMA:
            raise ScorerLoadError(f"scorer card schema {card.schema!r}, expected {SCHEMA!r}: a model of another "
                                  "feature set; retrain it (python -m serve_app.train_scorer) on zq-trace/3 traces")
        if card.feature_names != FEATURE_NAMES:
            raise ScorerLoadError(f"scorer card features {list(card.feature_names)} != {list(FEATURE_NAMES)}")
        if card.targets != TARGETS:
            raise ScorerLoadError(f"scorer card targets {list(card.targets)} != {list(TARGETS)}")
        return card


class XGBScorer:
    """Predicts from a validated booster; construct with `from_file` or `load_scorer`.

    `predict` may be called from several threads at once: `inplace_predict` keeps no
    state between calls (XGBoost documents it as thread-safe), and the booster's
    parameters are set here, before the scorer is shared.
    """

    def __init__(self, raw: bytes, card: ScorerCard) -> None:
        digest = hashlib.sha256(raw).hexdigest()
        if digest != card.sha256:
            raise ScorerLoadError(f"model file hash {digest[:12]}… does not match its card's {card.sha256[:12]}…")
        import xgboost as xgb  # lazily: policy and registry import no third-party code

        booster = xgb.Booster()
        try:
            booster.load_model(bytearray(raw))
        except xgb.core.XGBoostError as e:
            raise ScorerLoadError(f"XGBoost cannot read the model: {e}") from None
        if booster.num_features() != len(FEATURE_NAMES) or tuple(booster.feature_names or ()) != FEATURE_NAMES:
            raise ScorerLoadError(f"model features {booster.feature_names} ({booster.num_features()}) "
                                  f"!= {list(FEATURE_NAMES)}")
        # A few rows at a time: more threads would only add wake-up latency.
        booster.set_param({"nthread": 1})
        probe = _probe_rows()
        out = booster.inplace_predict(probe)
        if out.shape != (len(probe), len(TARGETS)) or not np.all(np.isfinite(out)):
            raise ScorerLoadError(f"model predicts shape {out.shape}, expected (n, {len(TARGETS)}) and finite")
        self.card = card
        self._raw = raw
        self._booster = booster

    @classmethod
    def from_file(cls, path: str | Path) -> XGBScorer:
        path = Path(path)
        card = ScorerCard.from_json(_read(card_path(path), 1 << 20).decode("utf-8", "replace"))
        return cls(_read(path, MAX_MODEL_BYTES), card)

    def predict(self, features: RequestFeatures, candidates: Sequence[Candidate]) -> list[Prediction]:
        if not candidates:
            return []
        out = self._booster.inplace_predict(feature_matrix(features, candidates))
        predictions = []
        for log_ttft, log_total, log_tpot in np.clip(out, *LOG_S_BOUNDS).tolist():
            ttft = math.exp(log_ttft)
            predictions.append(Prediction(ttft, max(ttft, math.exp(log_total)), math.exp(log_tpot)))
        return predictions

    # Crossing a process boundary (the ingress hands the scorer to the registry actor): the
    # model travels as its UBJSON bytes and is validated again on arrival.
    def __reduce__(self):
        return _restore, (self._raw, self.card.to_json())


def _restore(raw: bytes, card_json: str) -> Scorer:
    try:
        return XGBScorer(raw, ScorerCard.from_json(card_json))
    except Exception as e:  # never fail the process that receives it
        log.warning("scorer could not be restored (%s); using the rule scorer", e)
        return RULE_SCORER


def load_scorer(path: str | Path | None) -> Scorer:
    """The XGBoost scorer at `path`, or the rule scorer (with a warning) if it cannot be used."""
    if path is None:
        return RULE_SCORER
    try:
        scorer = XGBScorer.from_file(path)
    except Exception as e:  # ScorerLoadError, OSError, ImportError: all mean "use the rule"
        log.warning("scorer model %s is not usable (%s); using the rule scorer", path, e)
        return RULE_SCORER
    log.info("scorer: XGBoost model %s (%s)", path, SCHEMA)
    return scorer


def save_model(booster: Any, path: str | Path, card: ScorerCard) -> ScorerCard:
    """Write the booster as UBJSON and its card (with the file's hash) beside it."""
    path = Path(path)
    if path.suffix != ".ubj":
        raise ValueError(f"the scorer is saved in XGBoost's UBJSON format: name it *.ubj, got {path}")
    booster.set_attr(zq_schema=SCHEMA)
    raw = bytes(booster.save_raw(raw_format="ubj"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    import xgboost as xgb

    card = ScorerCard(hashlib.sha256(raw).hexdigest(), SCHEMA, FEATURE_NAMES, TARGETS, xgb.__version__,
                      card.training, card.held_out)
    card_path(path).write_text(card.to_json())
    return card


def _read(path: Path, max_bytes: int) -> bytes:
    size = path.stat().st_size
    if size > max_bytes:
        raise ScorerLoadError(f"{path} has {size} bytes, more than the {max_bytes} allowed")
    return path.read_bytes()


def _probe_rows() -> np.ndarray:
    """Hot, join and cold rows over a spread of shapes, to check a model's output before it is used."""
    from serve_app.snapshot import RequestFeatures

    rows = []
    for tokens in (8, 300, 4000):
        f = RequestFeatures("probe", tokens, max(1, tokens // 4), 200_000_000, 50_000, 0, top_k=50, top_p=0.9)
        candidates = [Candidate("hot", "s", "a", 1 << 30, 1, 0.1, 0.5, 1),
                      Candidate("join", "s", "a", 1 << 30, 1, 0.1, 0.5, 1, 3, 3 * tokens),
                      Candidate("cold", "s", None, 1 << 30, 0, 0.1, 0.5, 1)]
        rows.append(feature_matrix(f, candidates))
    return np.concatenate(rows)
