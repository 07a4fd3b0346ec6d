"""The load report's warm-actor section: process starts against warm binds, and refusals while actors start."""

from __future__ import annotations

from benchmarks.load_report import warm_section
from benchmarks.load_stats import Summary, Tail


def _zq(cold=0, warm=0, rejected=0, answers=()):
    return {"zeroqueue": {"all": Summary(offered=10, completed=10 - rejected, rejected=rejected, good=0, cold=cold,
                                         warm=warm, reject_answer=Tail(0.01, 0.02, 0.02, rejected),
                                         reject_answer_max=max(answers, default=0.0),
                                         reject_answers=tuple(sorted(answers)))}}


def test_the_section_counts_starts_and_judges_both_goals():
    data = {"registry_counters": {"bind": 2, "spawn": 1, "spawn_with_warm_available": 0, "join": 7, "reject": 3}}
    text = "\n".join(warm_section(data, {0.5: _zq(cold=1, warm=2)}, {"coldburst": _zq(warm=2, rejected=3,
                                                                                  answers=(0.01, 0.02, 0.3))}))
    assert "4 completed requests were bound to a warm actor" in text and "1 started on a fresh actor" in text
    assert "**0** spawns were decided with one there (met)" in text
    assert "3 refusals" in text and "1 over 0.25 s (missed)" in text


def test_no_counters_no_section_and_a_spawn_beside_a_warm_actor_is_a_miss():
    assert warm_section({}, {}, {}) == []
    text = "\n".join(warm_section({"registry_counters": {"spawn_with_warm_available": 2}}, {}, {}))
    assert "**2** spawns were decided with one there (missed)" in text
