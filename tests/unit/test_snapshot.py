"""`summarize`: the counts /health reports and the ingress's gauges show, from one registry snapshot."""

from __future__ import annotations

from serve_app.snapshot import ACTOR_STATES, ActorView, ClusterSnapshot, RowView, SlotView, summarize

ROW = RowView(request_bytes=10, num_tokens=20, tpot_target_s=None, predicted_end=0.0)


def _actor(name, slot, state, *, is_hot=True, num_rows=0):
    return ActorView(name, "m", slot, state, "short", is_hot, 100, (ROW,) * num_rows)


def test_a_summary_counts_every_state_rows_free_slots_and_the_occupancy_of_batching_actors():
    snap = ClusterSnapshot(
        slots=(SlotView("s0", "n", 1000, 400, 2), SlotView("s1", "n", 1000, 110, 1), SlotView("s2", "n", 1000, 0, 0)),
        actors=(_actor("a", "s0", "busy", num_rows=3), _actor("b", "s0", "busy", num_rows=1),
                _actor("c", "s1", "busy", is_hot=False, num_rows=1)))
    summary = summarize(snap, max_batch=4)
    assert summary.actors == dict.fromkeys(ACTOR_STATES, 0) | {"busy": 3}  # states with none are 0, not absent
    assert (summary.num_rows, summary.num_slots, summary.num_free_slots) == (5, 3, 1)
    assert summary.free_bytes == 600 + 890 + 1000
    # Two hot actors batching hold 4 of their 8 rows; the dedicated (not hot) actor is not a batch.
    assert summary.batch_occupancy == 0.5


def test_with_nothing_batching_the_occupancy_is_zero():
    snap = ClusterSnapshot(slots=(SlotView("s0", "n", 1000, 100, 1),), actors=(_actor("a", "s0", "idle"),))
    summary = summarize(snap, max_batch=8)
    assert summary.batch_occupancy == 0.0 and summary.actors["idle"] == 1 and summary.num_rows == 0
