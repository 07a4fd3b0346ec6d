"""How fast each feasible placement would serve a request: the scorer interface and its rule.

`decide` (policy.py) first works out which placements are feasible — an idle hot actor
whose slot has room for the request's KV cache and workspace, or a cold spawn onto a
slot where a fresh actor fits — and only then asks a `Scorer` to predict, per
candidate, the time to first token and the total time. The scorer ranks; it never
decides feasibility, so no prediction, however wrong, can place a request where it does
not fit.

`RuleScorer` is the documented rule, used when no XGBoost model is configured or the
configured one cannot be used (`xgb_scorer.load_scorer`), and for any decision whose
model predictions are malformed:

    prefill_s = input_tokens / prefill_tokens_per_s
    hot:  ttft_s = prefill_s
    cold: ttft_s = actor_start_s + weight_bytes / load_bytes_per_s + prefill_s
    total_s = ttft_s + max_tokens * decode_s_per_token

The constants are placeholders of the right order for a small model on one GPU, not
measurements. The rule does not look at the slot, so every cold candidate gets the same
prediction and every hot one is faster than any cold one; with ties kept in candidate
order, `decide` reduces to "the first idle hot actor, else the first slot that fits"
(first fit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from serve_app.policy import RequestFeatures

CandidateKind = Literal["hot", "cold"]


@dataclass(frozen=True)
class Candidate:
    """One feasible placement. `actor_name` is set for hot candidates, None for cold ones."""

    kind: CandidateKind
    slot_id: str
    actor_name: str | None
    slot_free_bytes: int
    slot_num_actors: int
    slot_fragmentation: float  # 0..1, from telemetry
    slot_utilization: float  # 0..1 EWMA, from telemetry
    node_num_busy: int = 0  # actors starting or busy on the slot's node: they share its host


@dataclass(frozen=True)
class Prediction:
    ttft_s: float  # the request's arrival at the ingress to its first token
    total_s: float  # the request's arrival at the ingress to its last token


class Scorer(Protocol):
    def predict(self, features: RequestFeatures, candidates: Sequence[Candidate]) -> Sequence[Prediction]:
        """One prediction per candidate, in the candidates' order."""
        ...


@dataclass(frozen=True)
class RuleScorer:
    """The rule in the module docstring. Placeholders until measured constants replace them."""

    prefill_tokens_per_s: float = 4000.0
    decode_s_per_token: float = 0.03
    load_bytes_per_s: float = 2.0e9
    actor_start_s: float = 3.0  # process start, CUDA context, model skeleton

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "load_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RuleScorer.{name} must be > 0, got {getattr(self, name)}")
        for name in ("decode_s_per_token", "actor_start_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"RuleScorer.{name} must be >= 0, got {getattr(self, name)}")

    def predict(self, features: RequestFeatures, candidates: Sequence[Candidate]) -> list[Prediction]:
        prefill_s = features.input_tokens / self.prefill_tokens_per_s
        decode_s = features.max_tokens * self.decode_s_per_token
        cold_ttft_s = self.actor_start_s + features.weight_bytes / self.load_bytes_per_s + prefill_s
        hot = Prediction(prefill_s, prefill_s + decode_s)
        cold = Prediction(cold_ttft_s, cold_ttft_s + decode_s)
        return [hot if c.kind == "hot" else cold for c in candidates]


RULE_SCORER = RuleScorer()
