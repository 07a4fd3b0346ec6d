"""Mapping node telemetry onto slots: which device's figures each slot gets."""

from __future__ import annotations

from actors.telemetry import DeviceTelemetry, NodeTelemetry
from serve_app.ray_cluster.slots import slot_stats
from serve_app.registry import SlotSpec


def _device(node: str, kind: str, index: int, fragmentation: float, utilization: float) -> DeviceTelemetry:
    return DeviceTelemetry(node, index, kind, 100, 40, 60, 10, 30, utilization, fragmentation, 0.0)


def test_each_slot_takes_its_own_devices_figures() -> None:
    nodes = [
        NodeTelemetry("n1", (_device("n1", "cuda", 0, 0.1, 0.5), _device("n1", "cuda", 1, 0.3, 0.9)), 0.0),
        NodeTelemetry("n2", (_device("n2", "cpu", 0, 0.0, 0.25),), 0.0),
    ]
    slots = [
        SlotSpec("n1/gpu0.0", "n1", 50, "cuda", 0), SlotSpec("n1/gpu0.1", "n1", 50, "cuda", 0),
        SlotSpec("n1/gpu1.0", "n1", 100, "cuda", 1),
        SlotSpec("n2/cpu0", "n2", 10), SlotSpec("n2/cpu1", "n2", 10),
    ]
    assert slot_stats(slots, nodes) == {
        "n1/gpu0.0": (0.1, 0.5), "n1/gpu0.1": (0.1, 0.5), "n1/gpu1.0": (0.3, 0.9),
        "n2/cpu0": (0.0, 0.25), "n2/cpu1": (0.0, 0.25),
    }


def test_slots_without_a_reading_keep_their_last_figures() -> None:
    # A missing agent (or a GPU index the agent does not see) yields no entry, not zeros.
    nodes = [NodeTelemetry("n1", (_device("n1", "cuda", 0, 0.1, 0.5),), 0.0)]
    slots = [SlotSpec("n1/gpu1.0", "n1", 100, "cuda", 1), SlotSpec("n9/cpu0", "n9", 10)]
    assert slot_stats(slots, nodes) == {}
