"""Predicted TTFT checked against measured TTFT, per placement kind, and the correction that follows. Pure.

The rule (scorer.py) predicts from constants measured on a quiet machine; the engine corrects
its own step planning by the steps it measures (actors/step_cost.py, StepCheck), and a join
or dispatch is priced with that actor's correction. What neither sees is the rest of a
first token's path as it runs now: a warm actor's first forward (its remaining layers
loading, its kernels and pages touched for the first time) beside busy neighbours, a
process start on a host that is also running the load generator, the ingress's own CPU.
On the peer benchmark, warm binds took 1.8-2x their predicted TTFT at the median (4.6x at
P90) while the steps were predicted within 6% (benchmarks/results/peer.md as of commit 2d2a959).

`TtftCheck` keeps, per model and candidate kind ("hot", "join", "warm", "cold"), a factor
that the ingress multiplies that kind's predicted TTFT by (`CorrectedScorer`), learned from
each admitted request's measured ÷ predicted TTFT the moment its first token arrives:

    log f  <-  log f + weight * log(measured / predicted)        (within [min_factor, max_factor])

with each sample's ratio first clipped to [1 / max_sample_ratio, max_sample_ratio]: a first token
many times its prediction is a stall of the host, and one such sample (28x, a load generator
starting beside the actors) made every join predicted past the target for the next 40 s (an
uncommitted bench_peer run).

`predicted` is what the decision used, the factor of the time included, so the factor moves
until the corrected predictions are right on a (geometric) average. A kind that is no
longer chosen gets no samples, so its factor decays back toward 1 with `half_life_s`: a
factor learned in a burst must not refuse that kind for good once the burst has passed.
A request that ends before its first token (its client gave up, its actor failed) leaves no
sample: the factor can lag behind the slowest first tokens.

The factor makes the predictions right on average; a TTFT target is a tail's (a contract's P99),
and the ratio scatters about its average (benchmarks/results/peer_avx2.md, 2-core AVX2 host:
joins' measured ÷ predicted TTFT had P50 0.89-1.01 and P90 1.09-1.66 at 1-10 req/s, margin
included: admitted within the target on the average prediction, one in ten went up to half as
long again past it). So each kind also keeps the
measured ÷ (corrected) predicted ratios of its last `window` requests within `horizon_s`, and
their `quantile` (the 90th by default) once there are `min_samples` of them, at least 1: the
kind's `margin`. A prediction carries `ttft_high_s` = its TTFT times the margin, and a TTFT
target is checked against that (policy.meets_targets): a placement is taken where nine in ten
like it have come in within the target, not one in two. The ranking still uses the average.
Two bounds keep the margin from refusing a kind for good, since only admitted requests give
samples: it is at most `max_margin` (a first token several times its prediction is a stall of
the host — a load generator starting up beside the actors took 4-5 s for a 0.5 s prompt — that
no margin predicts, and a P90 of such stalls refused every request while the host ran idle,
in an uncommitted bench_peer run), and like the factor it fades back to 1 with `half_life_s` once no sample confirms it.

The registry decides the slow path's requests with the same correction: the replica sends its
`TtftCorrection` with each admission (registry.py, `admit`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from serve_app.scorer import Candidate, Prediction, Scorer

if TYPE_CHECKING:
    from serve_app.snapshot import RequestFeatures


@dataclass(frozen=True)
class TtftCorrection:
    """Per candidate kind, the factor its predicted TTFT is multiplied by, and the margin its upper bound is
    the corrected TTFT times (1 where absent)."""

    factors: tuple[tuple[str, float], ...] = ()
    margins: tuple[tuple[str, float], ...] = ()

    def factor(self, kind: str) -> float:
        return dict(self.factors).get(kind, 1.0)

    def margin(self, kind: str) -> float:
        return dict(self.margins).get(kind, 1.0)


@dataclass(frozen=True)
class CorrectedScorer:
    """`base`'s predictions with each candidate kind's TTFT (and so its total) times its factor, and the TTFT's
    upper bound times the kind's margin on top."""

    base: Scorer
    correction: TtftCorrection = field(default_factory=TtftCorrection)

    def predict(self, features: RequestFeatures, candidates: Sequence[Candidate]) -> list[Prediction]:
        out = []
        for c, p in zip(candidates, self.base.predict(features, candidates), strict=True):
            ttft = p.ttft_s * self.correction.factor(c.kind)
            # max(): where the base predicts total == ttft (a one-token answer, or XGBScorer's clamp), the
            # sum below can round an ulp under ttft, and a malformed prediction sends policy to the rule.
            margin = self.correction.margin(c.kind)
            out.append(replace(p, ttft_s=ttft, total_s=max(ttft, p.total_s + ttft - p.ttft_s),
                               ttft_high_s=ttft * margin if margin > 1.0 else None))
        return out


def faded(deviation: float, age_s: float, half_life_s: float) -> float:
    """A correction's deviation from none, halved every `half_life_s` unheard: a figure no longer confirmed
    fades back to the rule's own (here a log factor; lease_book.py an actor's step correction less 1)."""
    return deviation * 0.5 ** (max(0.0, age_s) / half_life_s)


def corrected(scorer: Scorer, correction: TtftCorrection | None) -> Scorer:
    """`scorer` with `correction` applied, or as it is where there is none."""
    return (CorrectedScorer(scorer, correction) if correction is not None and (correction.factors or correction.margins)
            else scorer)


@dataclass(frozen=True)
class TtftCheckConfig:
    """How the factor learns and how wide the margin is (module doc); `AppArgs.ttft_check` in YAML."""

    weight: float = 0.2
    half_life_s: float = 20.0
    min_factor: float = 0.5
    max_factor: float = 4.0
    # The margin: this quantile of a kind's last `window` measured ÷ predicted TTFTs within `horizon_s`, once
    # there are `min_samples`, at most `max_margin`. The 99th measured no better than the 90th on the peer
    # benchmark (benchmarks/results/peer_margin.md, peer_margin_again.md: within two runs' spread): the first
    # tokens past a 1 s target there came 2-7x their prediction, stalls beyond any margin within max_margin.
    quantile: float = 0.9
    window: int = 64
    min_samples: int = 8
    horizon_s: float = 300.0
    max_margin: float = 1.5
    max_sample_ratio: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1 or not self.half_life_s > 0 or not 0 < self.min_factor <= 1 <= self.max_factor:
            raise ValueError(f"ttft_check needs 0 < weight <= 1, half_life_s > 0 and min <= 1 <= max factor, got "
                             f"{self.weight}, {self.half_life_s}, {self.min_factor}, {self.max_factor}")
        if (not 0.5 <= self.quantile < 1 or not 1 <= self.min_samples <= self.window or not self.horizon_s > 0
                or not self.max_margin >= 1):
            raise ValueError(f"ttft_check needs 0.5 <= quantile < 1, 1 <= min_samples <= window, horizon_s > 0 and "
                             f"max_margin >= 1, got {self.quantile}, {self.min_samples}, {self.window}, "
                             f"{self.horizon_s}, {self.max_margin}")
        if not self.max_sample_ratio > 1:
            raise ValueError(f"ttft_check needs max_sample_ratio > 1, got {self.max_sample_ratio}")


class TtftCheck:
    def __init__(self, config: TtftCheckConfig = TtftCheckConfig(), **overrides: float) -> None:
        self.config = c = replace(config, **overrides)
        self._lo, self._hi = math.log(c.min_factor), math.log(c.max_factor)
        self._max_log_sample = math.log(c.max_sample_ratio)
        # (model, kind) -> (log factor, when last set): one entry per model and kind served, never more
        self._log_factor: dict[tuple[str, str], tuple[float, float]] = {}
        # (model, kind) -> (when, measured ÷ predicted) of its last `window` requests, for the margin
        self._ratios: dict[tuple[str, str], deque[tuple[float, float]]] = {}

    def observe(self, model: str, kind: str, measured_s: float, predicted_s: float, now: float) -> None:
        """A request of `model` placed on a candidate of `kind`: its TTFT as measured, and as predicted."""
        if not (measured_s > 0 and predicted_s > 0):
            return
        log_r = min(self._max_log_sample, max(-self._max_log_sample, math.log(measured_s / predicted_s)))
        log_f = self._decayed((model, kind), now) + self.config.weight * log_r
        self._log_factor[(model, kind)] = (min(self._hi, max(self._lo, log_f)), now)
        self._ratios.setdefault((model, kind), deque(maxlen=self.config.window)).append((now, measured_s / predicted_s))

    def margin(self, model: str, kind: str, now: float) -> float:
        """The `quantile` of the kind's recent measured ÷ predicted TTFTs (within `horizon_s`), within [1,
        max_margin], faded toward 1 since the last of them; 1 with fewer than `min_samples`. Each ratio is against
        the corrected prediction as the decision had it, so the margin is what the factor leaves: the scatter
        about the average, not its level."""
        recent = [(at, r) for at, r in self._ratios.get((model, kind), ()) if now - at <= self.config.horizon_s]
        if len(recent) < self.config.min_samples:
            return 1.0
        ratios = sorted(r for _, r in recent)
        tail = min(self.config.max_margin, max(1.0, ratios[min(len(ratios) - 1, int(self.config.quantile * len(ratios)))]))
        return 1.0 + faded(tail - 1.0, now - max(at for at, _ in recent), self.config.half_life_s)

    def factor(self, model: str, kind: str, now: float) -> float:
        return math.exp(self._decayed((model, kind), now))

    def correction(self, model: str, now: float) -> TtftCorrection:
        """The model's factors as they stand at `now`, for the scorer (and the registry's slow path)."""
        kinds = [kind for m, kind in sorted(self._log_factor) if m == model]
        return TtftCorrection(tuple((kind, round(self.factor(model, kind, now), 4)) for kind in kinds),
                              tuple((kind, round(m, 4)) for kind in kinds if (m := self.margin(model, kind, now)) > 1))

    def _decayed(self, key: tuple[str, str], now: float) -> float:
        log_f, at = self._log_factor.get(key, (0.0, now))
        return faded(log_f, now - at, self.config.half_life_s)
