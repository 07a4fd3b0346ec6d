"""LayerStream: groups load in order on background threads; wait(i) is exact; errors stay with their layer."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.unit.test_format import flip_byte, packed_checkpoint
from weights_tool.format import ShardFormatError
from weights_tool.layer_stream import THREAD_NAME, LayerStream, LayerStreamClosed
from weights_tool.reader import ShardReader

NUM_LAYERS = 3
ALL_GROUPS = list(range(-1, NUM_LAYERS + 1))


class SlowReader(ShardReader):
    """A reader whose every group read first sleeps `delay` seconds (waking early on cancel), like a slow disk."""

    def __init__(self, path: Path, delay: float) -> None:
        super().__init__(path)
        self.delay = delay
        self.started: list[str] = []

    def read_group(self, name: str, into: Any = None, *, verify: bool = True,
                   cancel: threading.Event | None = None) -> dict[str, np.ndarray]:
        self.started.append(name)
        if cancel is not None:
            cancel.wait(self.delay)
        else:
            time.sleep(self.delay)
        return super().read_group(name, into, verify=verify, cancel=cancel)


@pytest.fixture
def zqs(tmp_path: Path) -> Path:
    return packed_checkpoint(tmp_path, "bfloat16", byte_group="always")


def expected_bytes(path: Path) -> dict[str, bytes]:
    with ShardReader(path) as r:
        return {n: a.tobytes() for g in r.groups for n, a in r.read_group(g.name).items()}


def empty_destinations(reader: ShardReader) -> dict[str, np.ndarray]:
    return {n: np.zeros(t.size, dtype=np.uint8) for n, t in reader.tensors.items()}


def stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


def group_complete(reader: ShardReader, dests: dict[str, np.ndarray], expected: dict[str, bytes], index: int) -> bool:
    name = "embed" if index == -1 else "final" if index == reader.num_layers else f"layer.{index}"
    return all(dests[t.name].tobytes() == expected[t.name] for t in reader.group(name).tensors)


@pytest.mark.parametrize("num_threads", [1, 2, 4])
def test_loads_every_group_exactly(zqs: Path, num_threads: int) -> None:
    expected = expected_bytes(zqs)
    with ShardReader(zqs) as r:
        dests = empty_destinations(r)
        with LayerStream(r, dests, num_threads=num_threads) as stream:
            for i in ALL_GROUPS:
                stream.wait(i, timeout=10)
                assert stream.is_ready(i)
            assert sorted(stream.ready_times()) == ALL_GROUPS
            assert stream.throughput() > 0
        assert {n: d.tobytes() for n, d in dests.items()} == expected
    assert stream_threads() == []


def test_wait_returns_exactly_when_its_group_is_complete(zqs: Path) -> None:
    expected = expected_bytes(zqs)
    with SlowReader(zqs, delay=0.05) as r:
        dests = empty_destinations(r)
        with LayerStream(r, dests, num_threads=1) as stream:
            for i in ALL_GROUPS:
                stream.wait(i, timeout=10)
                assert group_complete(r, dests, expected, i)
                if i < NUM_LAYERS:  # the slow reader has not reached the last group yet
                    assert not stream.is_ready(NUM_LAYERS)
            times = stream.ready_times()
        assert r.started == ["embed", "layer.0", "layer.1", "layer.2", "final"]
        assert [times[i] for i in ALL_GROUPS] == sorted(times[i] for i in ALL_GROUPS)


def test_two_threads_start_groups_in_order(zqs: Path) -> None:
    with SlowReader(zqs, delay=0.02) as r, LayerStream(r, empty_destinations(r), num_threads=2) as stream:
        stream.wait(NUM_LAYERS, timeout=10)
        for i in ALL_GROUPS:
            stream.wait(i, timeout=10)
        assert r.started == ["embed", "layer.0", "layer.1", "layer.2", "final"]


def test_an_error_surfaces_only_at_its_layers_wait(zqs: Path) -> None:
    expected = expected_bytes(zqs)
    with ShardReader(zqs) as r:
        frame = r.group("layer.1").frames[0]
    flip_byte(zqs, frame.offset + frame.stored_size // 2)
    with ShardReader(zqs) as r:
        dests = empty_destinations(r)
        with LayerStream(r, dests, num_threads=2) as stream:
            for i in [-1, 0, 2, NUM_LAYERS]:
                stream.wait(i, timeout=10)
                assert group_complete(r, dests, expected, i)
            with pytest.raises(ShardFormatError, match=r"group layer\.1 frame 0"):
                stream.wait(1, timeout=10)
            assert not stream.is_ready(1)
            with pytest.raises(ShardFormatError, match=r"group layer\.1"):
                stream.wait(1)  # and again, for a second waiter
            assert sorted(stream.ready_times()) == [-1, 0, 2, NUM_LAYERS]


def test_close_stops_threads_promptly(zqs: Path) -> None:
    before = set(threading.enumerate())
    with SlowReader(zqs, delay=5.0) as r:
        stream = LayerStream(r, empty_destinations(r), num_threads=2)
        assert len(stream_threads()) == 2
        start = time.perf_counter()
        stream.close()
        assert time.perf_counter() - start < 1.0
        assert stream_threads() == []
        assert set(threading.enumerate()) <= before
        for i in ALL_GROUPS:
            with pytest.raises(LayerStreamClosed):
                stream.wait(i, timeout=1)
        stream.close()  # twice is fine


def test_close_wakes_a_blocked_waiter(zqs: Path) -> None:
    with SlowReader(zqs, delay=5.0) as r:
        stream = LayerStream(r, empty_destinations(r), num_threads=1)
        errors: list[BaseException] = []

        def waiter() -> None:
            try:
                stream.wait(NUM_LAYERS)
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.05)
        stream.close()
        t.join(timeout=2)
        assert not t.is_alive() and isinstance(errors[0], LayerStreamClosed)


def test_wait_timeout(zqs: Path) -> None:
    with SlowReader(zqs, delay=1.0) as r, LayerStream(r, empty_destinations(r), num_threads=1) as stream:
        with pytest.raises(TimeoutError, match="group 3"):
            stream.wait(NUM_LAYERS, timeout=0.01)
        with pytest.raises(IndexError):
            stream.wait(NUM_LAYERS + 1)


def test_destinations_are_checked_before_any_thread_starts(zqs: Path) -> None:
    with ShardReader(zqs) as r:
        dests = empty_destinations(r)
        del dests["model.layers.2.mlp.down_proj.weight"]
        with pytest.raises(ValueError, match="model.layers.2.mlp.down_proj.weight"):
            LayerStream(r, dests)
        dests = empty_destinations(r)
        dests["model.norm.weight"] = np.zeros(3, dtype=np.uint8)
        with pytest.raises(ValueError, match="model.norm.weight"):
            LayerStream(r, dests)
        with pytest.raises(ValueError, match="num_threads"):
            LayerStream(r, empty_destinations(r), num_threads=0)
    assert stream_threads() == []


def test_groups_start_in_the_order_given(zqs: Path) -> None:
    expected = expected_bytes(zqs)
    order = [0, 1, 2, -1, NUM_LAYERS]  # layers first, as for a raw embedding table
    with SlowReader(zqs, delay=0.02) as r:
        dests = empty_destinations(r)
        with LayerStream(r, dests, num_threads=1, order=order) as stream:
            stream.wait(0, timeout=10)
            assert not stream.is_ready(-1)
            for i in ALL_GROUPS:
                stream.wait(i, timeout=10)
            times = stream.ready_times()
        assert r.started == ["layer.0", "layer.1", "layer.2", "embed", "final"]
        assert sorted(times, key=times.get) == order
        assert {n: d.tobytes() for n, d in dests.items()} == expected


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [-1, 0, 1, 2, 3, 3], [-1, 0, 1, 2, 4]])
def test_an_order_must_name_every_group_once(zqs: Path, order: list[int]) -> None:
    with ShardReader(zqs) as r, pytest.raises(ValueError, match="each group"):
        LayerStream(r, empty_destinations(r), order=order)
    assert stream_threads() == []


@pytest.mark.parametrize("num_threads", [1, 2])
def test_hold_after_loads_a_prefix_until_resumed(zqs: Path, num_threads: int) -> None:
    expected = expected_bytes(zqs)
    with ShardReader(zqs) as r:
        dests = empty_destinations(r)
        with LayerStream(r, dests, num_threads=num_threads, hold_after=2) as stream:
            stream.wait(-1, timeout=10)
            stream.wait(0, timeout=10)
            with pytest.raises(TimeoutError):
                stream.wait(1, timeout=0.2)  # held: nothing beyond the prefix starts
            assert not stream.is_ready(NUM_LAYERS)
            stream.resume()
            for i in ALL_GROUPS:
                stream.wait(i, timeout=10)
        assert {n: d.tobytes() for n, d in dests.items()} == expected
    assert stream_threads() == []


def test_throughput_leaves_out_the_time_held(zqs: Path) -> None:
    with SlowReader(zqs, delay=0.02) as r, LayerStream(r, empty_destinations(r), num_threads=1, hold_after=1) as stream:
        stream.wait(-1, timeout=10)
        time.sleep(0.5)  # far longer than loading the rest takes
        stream.resume()
        stream.wait(NUM_LAYERS, timeout=10)
        loaded = sum(r.group(g.name).size for g in r.groups)
        # Over the ~0.1 s the five slowed reads take, not over the 0.5 s held besides.
        assert stream.throughput() > loaded / 0.4


def test_close_releases_a_held_stream(zqs: Path) -> None:
    with ShardReader(zqs) as r:
        stream = LayerStream(r, empty_destinations(r), num_threads=2, hold_after=1)
        stream.wait(-1, timeout=10)
        stream.close()  # returns once its held threads have woken and ended
        assert stream_threads() == []
        with pytest.raises(LayerStreamClosed):
            stream.wait(0, timeout=1)


def test_hold_after_must_fit_the_order(zqs: Path) -> None:
    with ShardReader(zqs) as r, pytest.raises(ValueError, match="hold_after"):
        LayerStream(r, empty_destinations(r), hold_after=len(ALL_GROUPS) + 1)
