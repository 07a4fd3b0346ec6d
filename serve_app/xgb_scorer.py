"""The XGBoost scorer: each candidate's TTFT and total time, predicted from measured traces.

The model (trained by `serve_app.train_scorer` on the traces the ingress records) is one
multi-output booster with two targets, log TTFT and log total time, both seconds from the
request's arrival at the ingress. Per decision the scorer builds one small float32 matrix,
one row per candidate (`FEATURE_NAMES`), and predicts it in one in-place call: no DMatrix
per request, one booster call per decision (two boosters would be two calls, each with a
fixed cost that dwarfs the trees: see benchmarks/results/decision.md). TTFT and total are
exp() of the outputs, total raised to at least TTFT, so a prediction is always well-formed.

Files. `scorer.ubj` is XGBoost's own UBJSON format (`Booster.save_model`), never pickle.
Beside it, `scorer.json` (the card) names the schema, the feature names in order, the
targets, the held-out accuracy and the SHA-256 of the model file. Loading checks the hash
*before* XGBoost parses a byte: XGBoost aborts the whole process on some truncated files
(a C++ `terminate`, not an exception), so a damaged file must never reach its parser.
Then the booster's own feature names and count, and one probe prediction of the expected
shape, must match. `load_scorer` never raises: a missing, damaged or mismatched model logs
a warning and returns the rule scorer.

Speed. `Booster.inplace_predict` spends most of its time in Python (argument JSON, array
interface, output wrapping). `_DensePredictor` makes the same C call
(`XGBoosterPredictFromDense`, the entry point `inplace_predict` itself uses) with those
arguments prepared once, and is used only after it has matched `inplace_predict` on probe
rows; otherwise the scorer calls `inplace_predict`.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from serve_app.scorer import RULE_SCORER, Candidate, Prediction, Scorer

if TYPE_CHECKING:
    from serve_app.snapshot import RequestFeatures

log = logging.getLogger(__name__)

SCHEMA = "zq-scorer/1"
# Candidate columns first, then the request's (the same for every row of one decision).
CANDIDATE_FEATURES = ("is_cold", "slot_fragmentation", "slot_utilization", "node_num_busy")
REQUEST_FEATURES = ("input_tokens", "max_tokens", "is_greedy", "top_k", "top_p", "weight_bytes",
                    "kv_bytes_per_token")
FEATURE_NAMES = CANDIDATE_FEATURES + REQUEST_FEATURES
TARGETS = ("log_ttft_s", "log_total_s")
MAX_MODEL_BYTES = 64 << 20
MAX_ROWS = 64  # rows the fast path's buffer holds; more candidates go through inplace_predict


class ScorerLoadError(ValueError):
    """A model file that must not be used; `load_scorer` turns it into a warning."""


def request_columns(f: RequestFeatures) -> list[float]:
    return [float(f.input_tokens), float(f.max_tokens), 1.0 if f.temperature == 0 else 0.0,
            float(f.top_k or 0), 1.0 if f.top_p is None else float(f.top_p), float(f.weight_bytes),
            float(f.kv_bytes_per_token)]


def candidate_columns(c: Candidate) -> list[float]:
    return [1.0 if c.kind == "cold" else 0.0, float(c.slot_fragmentation), float(c.slot_utilization),
            float(c.node_num_busy)]


def feature_matrix(features: RequestFeatures, candidates: Sequence[Candidate]) -> np.ndarray:
    """One float32 row per candidate, columns in `FEATURE_NAMES` order (training uses this too)."""
    common = request_columns(features)
    return np.array([candidate_columns(c) + common for c in candidates], dtype=np.float32).reshape(
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
            raise ScorerLoadError(f"scorer card schema {card.schema!r}, expected {SCHEMA!r}")
        if card.feature_names != FEATURE_NAMES:
            raise ScorerLoadError(f"scorer card features {list(card.feature_names)} != {list(FEATURE_NAMES)}")
        if card.targets != TARGETS:
            raise ScorerLoadError(f"scorer card targets {list(card.targets)} != {list(TARGETS)}")
        return card


class XGBScorer:
    """Predicts from a validated booster; construct with `from_bytes` or `load_scorer`."""

    def __init__(self, raw: bytes, card: ScorerCard, use_fast_path: bool = True) -> None:
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
        expected = booster.inplace_predict(probe)
        if expected.shape != (len(probe), len(TARGETS)) or not np.all(np.isfinite(expected)):
            raise ScorerLoadError(f"model predicts shape {expected.shape}, expected (n, {len(TARGETS)})")
        self.card = card
        self._raw = raw
        self._booster = booster
        self._lock = threading.Lock()
        self._fast = _DensePredictor.verified(booster, probe, expected) if use_fast_path else None

    @classmethod
    def from_file(cls, path: str | Path, use_fast_path: bool = True) -> XGBScorer:
        path = Path(path)
        card = ScorerCard.from_json(_read(card_path(path), 1 << 20).decode("utf-8", "replace"))
        return cls(_read(path, MAX_MODEL_BYTES), card, use_fast_path)

    @property
    def uses_fast_path(self) -> bool:
        return self._fast is not None

    def predict(self, features: RequestFeatures, candidates: Sequence[Candidate]) -> list[Prediction]:
        if not candidates:
            return []
        x = feature_matrix(features, candidates)
        with self._lock:
            if self._fast is not None and len(x) <= MAX_ROWS:
                out = self._fast.predict(x)
            else:
                out = self._booster.inplace_predict(x).tolist()
        predictions = []
        for log_ttft, log_total in out:
            ttft = math.exp(log_ttft)
            predictions.append(Prediction(ttft, max(ttft, math.exp(log_total))))
        return predictions

    # Crossing a process boundary (the ingress hands the scorer to the registry actor): the
    # model travels as its UBJSON bytes and is validated again on arrival.
    def __reduce__(self):
        return _restore, (self._raw, self.card.to_json(), self._fast is not None)


def _restore(raw: bytes, card_json: str, use_fast_path: bool) -> Scorer:
    try:
        return XGBScorer(raw, ScorerCard.from_json(card_json), use_fast_path)
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
    log.info("scorer: XGBoost model %s (%s path)", path, "fast" if scorer.uses_fast_path else "inplace_predict")
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
    """Hot and cold rows over a spread of shapes, to check a model's output before it is used."""
    rows = []
    for is_cold in (0.0, 1.0):
        for tokens in (8.0, 300.0, 4000.0):
            rows.append([is_cold, 0.1, 0.5, 1.0, tokens, tokens / 4, 0.0, 50.0, 0.9, 2e8, 5e4])
    return np.array(rows, dtype=np.float32)


class _DensePredictor:
    """`inplace_predict`'s C call with its arguments prepared once (see the module docstring).

    The input is copied into a buffer this object owns, so the array interface strings
    (pointer, shape) are made once per row count; a proxy DMatrix is reused across calls.
    Callers serialise calls (XGBScorer holds a lock): the buffer and proxy are shared.
    """

    def __init__(self, booster: Any) -> None:
        from xgboost import core

        self._lib = core._LIB
        self._check = core._check_call
        self._booster = booster
        self._buffer = np.zeros((MAX_ROWS, len(FEATURE_NAMES)), dtype=np.float32)
        pointer = self._buffer.__array_interface__["data"][0]
        self._interfaces = [
            json.dumps({"data": [pointer, False], "shape": [n, len(FEATURE_NAMES)], "strides": None,
                        "typestr": "<f4", "version": 3}).encode()
            for n in range(MAX_ROWS + 1)
        ]
        self._config = json.dumps({"type": 0, "training": False, "iteration_begin": 0, "iteration_end": 0,
                                   "missing": float("nan"), "strict_shape": False, "cache_id": 0}).encode()
        self._proxy = ctypes.c_void_p()
        self._check(self._lib.XGProxyDMatrixCreate(ctypes.byref(self._proxy)))
        self._shape = ctypes.POINTER(ctypes.c_uint64)()
        self._dims = ctypes.c_uint64()
        self._out = ctypes.POINTER(ctypes.c_float)()

    @classmethod
    def verified(cls, booster: Any, probe: np.ndarray, expected: np.ndarray) -> _DensePredictor | None:
        try:
            fast = cls(booster)
            got = np.array(fast.predict(probe), dtype=np.float32)
        except Exception as e:  # an XGBoost whose internals moved: the public call still works
            log.info("fast scorer path unavailable (%s); using inplace_predict", e)
            return None
        if got.shape != expected.shape or not np.allclose(got, expected, rtol=1e-6, atol=1e-6):
            log.warning("fast scorer path disagrees with inplace_predict; using inplace_predict")
            return None
        return fast

    def predict(self, x: np.ndarray) -> list[list[float]]:
        n = len(x)
        self._buffer[:n] = x
        self._check(self._lib.XGBoosterPredictFromDense(
            self._booster.handle, self._interfaces[n], self._config, self._proxy,
            ctypes.byref(self._shape), ctypes.byref(self._dims), ctypes.byref(self._out)))
        if self._dims.value != 2 or self._shape[0] != n or self._shape[1] != len(TARGETS):
            raise RuntimeError(f"unexpected prediction shape from XGBoost (dims {self._dims.value})")
        flat = self._out[: n * len(TARGETS)]  # copied out of XGBoost's buffer at once
        return [flat[i:i + len(TARGETS)] for i in range(0, len(flat), len(TARGETS))]

    def __del__(self) -> None:
        try:
            if self._proxy.value:
                self._lib.XGDMatrixFree(self._proxy)
        except Exception:  # at interpreter exit the library may be gone already
            pass
