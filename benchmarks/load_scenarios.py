"""What the load benchmark offers every system: request classes, load scenarios, and their arrival schedules.

Load is open-loop: each scenario is a fixed schedule of arrival times (a Poisson process
whose rate follows the scenario's phases, drawn once from a seed), and the client sends
every request at its time whether or not earlier ones have been answered. A closed loop
(N users, each waiting for its answer before sending again) would let a slow server slow
its own arrivals, so a queue could never grow past N and its delay would go unmeasured.
Every system gets the very same schedule: the same arrivals, classes, prompts and seeds,
so the same tokens are generated and the work is identical.

Rates are multiples of a capacity measured live in the same run (load_sweep: the
unbounded baseline's closed-loop saturation throughput for the mix). The sweep's steady
points are built in load_sweep; the extra scenarios (`--extras`) are here.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from actors.tokenizer import Message
from benchmarks.load_stats import Slo

# A plain English text that tokenizes evenly; prompts are cut from it to a token count.
_TEXT = ("Queues hide in every layer of a serving stack: in the proxy, in the router, in the "
         "scheduler and inside the replica. A request that waits behind a long generation pays "
         "for it in its tail latency, and the user sees that tail. ")


@dataclass(frozen=True)
class RequestClass:
    name: str
    input_tokens: int  # the prompt, chat template included
    output_tokens: int  # max_tokens; random weights almost never sample end-of-turn first


# Scaled so that on one core a short request takes about a tenth of a second and a long one
# a second and a half (the demo model decodes ~16.5 ms/token in bf16 at batch 1,
# benchmarks/results/batch.md). benchmarks/load.yaml puts all three in zeroqueue's short
# lane, so every batch row of every system can take any of them.
CLASSES: dict[str, RequestClass] = {
    "short": RequestClass("short", 24, 4),
    "medium": RequestClass("medium", 96, 12),
    "long": RequestClass("long", 600, 64),
}
MIXED = (("short", 0.4), ("medium", 0.5), ("long", 0.1))  # the mix


@dataclass(frozen=True)
class Phase:
    duration_s: float
    start_load: float  # offered rate at the phase start, in multiples of capacity
    end_load: float  # ... and at its end; the rate ramps linearly in between


def steady(duration_s: float, load: float) -> tuple[Phase, ...]:
    return (Phase(duration_s, load, load),)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    mix: tuple[tuple[str, float], ...]
    phases: tuple[Phase, ...]
    lossy: bool = False  # the client reaches the server through a netem link
    spike: tuple[float, float] | None = None  # the overload window (s from the start), if any
    # Sent as x-zq-ttft-target-s on every request: the client states its TTFT SLO. zeroqueue
    # refuses at once what it predicts would miss it; the baselines have no way to act on it.
    ttft_target_s: float | None = None
    # Each system is deployed afresh right before it (no warm-up): zeroqueue's actors start
    # while the scenario runs, and every refusal meanwhile shows whether admission kept its CPU.
    is_fresh: bool = False

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    @property
    def peak_load(self) -> float:
        return max(max(p.start_load, p.end_load) for p in self.phases)

    def load_at(self, t: float) -> float:
        """Offered load (× capacity) at `t` seconds from the start; 0 outside the scenario."""
        start = 0.0
        for p in self.phases:
            if t < start + p.duration_s:
                return p.start_load + (p.end_load - p.start_load) * (t - start) / p.duration_s
            start += p.duration_s
        return 0.0

    def describe(self) -> str:
        parts = []
        for p in self.phases:
            load = f"{p.start_load:g}×" if p.start_load == p.end_load else f"{p.start_load:g}→{p.end_load:g}×"
            parts.append(f"{load} for {p.duration_s:g} s")
        return ", then ".join(parts)


def burst_phases(ramp_s: float, base_s: float, spike_s: float, tail_s: float,
                 base: float = 0.5, spike: float = 10.0) -> tuple[Phase, ...]:
    """The seed's burst, scaled: ramp to base load, hold, a short spike, back to base."""
    return (Phase(ramp_s, 0.0, base), Phase(base_s, base, base), Phase(spike_s, spike, spike),
            Phase(tail_s, base, base))


SLO_TTFT_S = Slo().ttft_s
EXTRAS = ("burst", "coldburst", "lossy", "slo")  # `--extras`: scenarios beside the sweep, outside its budget


def extra_scenarios(names: Sequence[str], quick: bool) -> tuple[Scenario, ...]:
    """The scenarios `--extras` names, in a fixed order, at multiples of the same measured capacity.

    burst: 0.5x with a 10x spike (how fast refusals come back when everything overflows);
    coldburst: a 10x spike from the first second of a freshly deployed system, then 0.5x
    (zeroqueue's warm and cold actors start under it: how fast refusals come back then);
    lossy: 0.5x through a lossy link (netem, where this machine allows it); slo: 0.9x with
    the client stating its TTFT SLO (`x-zq-ttft-target-s`), which zeroqueue acts on and the
    baselines cannot.
    """
    unknown = set(names) - set(EXTRAS)
    if unknown:
        raise ValueError(f"unknown extras {sorted(unknown)}; known: {', '.join(EXTRAS)}")
    if quick:
        burst, spike, steady_s = burst_phases(2, 2, 2, 4), (4.0, 6.0), 8.0
        cold = (Phase(2, 10.0, 10.0), Phase(4, 0.5, 0.5))
    else:
        burst, spike, steady_s = burst_phases(10, 15, 5, 25), (25.0, 30.0), 45.0
        cold = (Phase(5, 10.0, 10.0), Phase(10, 0.5, 0.5))
    all_ = {
        "burst": Scenario("burst", "burst: 0.5× base, 10× spike", MIXED, burst, spike=spike),
        "coldburst": Scenario("coldburst", "cold burst: 10× from the first second of a fresh deployment, then "
                              "0.5×", MIXED, cold, spike=(0.0, cold[0].duration_s), is_fresh=True),
        "lossy": Scenario("lossy", "mixed lengths at 0.5× over a lossy link", MIXED, steady(steady_s, 0.5),
                          lossy=True),
        "slo": Scenario("slo", f"mixed lengths at 0.9×, the client stating its {SLO_TTFT_S:g} s TTFT SLO "
                        "(x-zq-ttft-target-s)", MIXED, steady(2 * steady_s, 0.9), ttft_target_s=SLO_TTFT_S),
    }
    return tuple(all_[n] for n in EXTRAS if n in names)


@dataclass(frozen=True)
class Arrival:
    index: int
    t: float  # seconds from the scenario's start
    cls: str
    seed: int  # the request's sampling seed


def schedule(scenario: Scenario, capacity: float, seed: int) -> list[Arrival]:
    """A Poisson arrival process whose rate follows the scenario, drawn by thinning.

    Candidates arrive at the peak rate; each is kept with probability rate(t) / peak, which
    gives exactly the time-varying Poisson process. Deterministic for a seed.
    """
    rng = random.Random(f"{scenario.name}/{seed}")
    peak = scenario.peak_load * capacity
    names = [c for c, _ in scenario.mix]
    weights = [w for _, w in scenario.mix]
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= scenario.duration_s:
            return out
        keep = rng.random() < scenario.load_at(t) * capacity / peak
        cls = rng.choices(names, weights)[0]
        request_seed = rng.getrandbits(63)
        if keep:
            out.append(Arrival(len(out), t, cls, request_seed))


def prompt_of(tokenizer, input_tokens: int) -> str:
    """The longest cut of the text whose chat-templated prompt has at most `input_tokens` tokens."""

    def size(n_words: int) -> int:
        return len(tokenizer.encode_chat([Message("user", _words(n_words))]))

    lo, hi = 1, 4 * input_tokens
    if size(lo) > input_tokens:
        raise ValueError(f"the chat template alone is longer than {input_tokens} tokens")
    while lo < hi:  # largest n with size(n) <= input_tokens
        mid = (lo + hi + 1) // 2
        if size(mid) <= input_tokens:
            lo = mid
        else:
            hi = mid - 1
    return _words(lo)


def _words(n: int) -> str:
    words = _TEXT.split()
    return " ".join(words[i % len(words)] for i in range(n))
