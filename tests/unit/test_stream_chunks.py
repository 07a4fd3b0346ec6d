"""How often a row's chunks leave its actor, and how consecutive tokens merge into one chunk."""

from __future__ import annotations

import pytest

from actors.actor_config import ActorConfig
from actors.messages import Completion, TextChunk
from actors.stream_chunks import chunk_interval_s, coalesce


def test_one_row_streams_at_the_minimum_and_more_rows_share_the_actors_chunks_a_second():
    assert chunk_interval_s(1, 0.02, 50.0, 0.2) == 0.02  # 1/50 s: the minimum, as before the share
    assert chunk_interval_s(4, 0.02, 50.0, 0.2) == pytest.approx(0.08)
    assert chunk_interval_s(8, 0.02, 50.0, 0.2) == pytest.approx(0.16)
    assert chunk_interval_s(32, 0.02, 50.0, 0.2) == 0.2  # capped: text still moves five times a second
    assert chunk_interval_s(0, 0.02, 50.0, 0.2) == 0.02  # between rows (the last one ending)


def test_the_rows_together_send_at_most_the_actors_chunks_a_second_until_the_cap():
    for rows in range(1, 33):
        interval = chunk_interval_s(rows, 0.0, 50.0, 0.2)
        assert interval <= 0.2
        assert rows / interval <= 50.0 + 1e-9 or interval == 0.2


def test_no_share_leaves_the_minimum_alone():
    assert chunk_interval_s(16, 0.02, 0.0, 0.2) == 0.02
    assert chunk_interval_s(16, 0.0, 0.0, 0.2) == 0.0  # every token its own chunk
    assert chunk_interval_s(16, 0.5, 50.0, 0.2) == 0.5  # a minimum above the cap wins


def test_the_actor_config_refuses_a_negative_share():
    with pytest.raises(ValueError, match="max_stream_chunks_per_s"):
        ActorConfig(max_stream_chunks_per_s=-1.0)
    with pytest.raises(ValueError, match="max_stream_interval_s"):
        ActorConfig(max_stream_interval_s=-0.1)


def test_consecutive_chunks_merge_and_other_items_keep_their_place():
    a, b, c = TextChunk((1,), "a", 1, 1.0), TextChunk((2,), "b", 2, 2.0), TextChunk((3,), "c", 3, 3.0)
    done = Completion.__new__(Completion)  # any non-chunk item: only its place matters
    merged = coalesce([a, b, done, c])
    assert merged[0] == TextChunk((1, 2), "ab", 2, 2.0) and merged[1] is done and merged[2] == c
    assert coalesce([]) == []
