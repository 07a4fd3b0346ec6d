"""Discovering the accelerator slots request actors may occupy.

A slot is one GPU (`num_gpus=1` actors), one unit of a Ray resource that nodes declare
(`kind: resource`, e.g. `zq_slot`: slots on every node that has it, which is how CPU slots follow the
nodes an autoscaler adds), or, on a CPU-only cluster, one CPU slot of `cpu_slot_bytes` on the
ingress's node. A slot the registry offers must be placeable by
Ray right now whenever it is free — otherwise a spawn onto it would wait in Ray's
scheduler, a hidden queue — so discovery checks that the node has the resources for
every slot's actor at once.

`SlotRefresher` keeps the registry current on one background thread: it heartbeats the
registry link (registry_link.py; a restarted registry comes back empty and gets the slots
at once), re-registers the slots when the admissible nodes change (a node joins, goes, or
starts draining: read from Ray's node table every heartbeat, so a node an autoscaler adds is
used within a heartbeat of joining) and every `slot_refresh_s` besides, and, every
`telemetry_refresh_s`, copies each
slot's device fragmentation and utilisation EWMA from the node telemetry agents into
the registry, where the scorer sees them: the ingress hands the latest figures to the
registry with its next admission (see `RegistryActor.admit`). Telemetry is best effort: a
slow or missing agent leaves the last figures in place and never holds a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ray

from actors.actor_config import ActorConfig
from actors.telemetry import NodeTelemetry, TelemetryConfig
from actors.telemetry_agent import cluster_snapshot, ensure_agents
from serve_app.config import SlotArgs
from serve_app.ray_cluster.nodes import admissible_nodes
from serve_app.ray_cluster.registry_link import RegistryLink
from serve_app.registry import SlotSpec

log = logging.getLogger(__name__)


# Slot ids name their node in full: node ids need not differ in a prefix (Ray's fake autoscaling provider
# numbers its nodes ffff...0001, ffff...0002), and two slots with one id would be one slot in the registry.
def discover_slots(args: SlotArgs, actor: ActorConfig, telemetry: TelemetryConfig | None = None,
                   nodes: list[dict] | None = None) -> list[SlotSpec]:
    """The slots on `nodes` (Ray's node table entries; default: every admissible node now)."""
    nodes = admissible_nodes() if nodes is None else nodes
    num_gpus = sum(int(n["Resources"].get("GPU", 0)) for n in nodes)
    kind = args.kind if args.kind != "auto" else ("gpu" if num_gpus else "cpu")
    if kind == "resource":
        return _resource_slots(nodes, args, actor)
    if kind == "gpu":
        return _gpu_slots(nodes, args, actor, telemetry or TelemetryConfig())
    return _cpu_slots(args, actor)


def _cpu_slots(args: SlotArgs, actor: ActorConfig) -> list[SlotSpec]:
    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    need = {"CPU": actor.num_cpus * args.num_cpu_slots}
    for key, amount in actor.resources:
        need[key] = need.get(key, 0) + amount * args.num_cpu_slots
    short = {k: v for k, v in need.items() if node["Resources"].get(k, 0) < v}
    if short:
        raise ValueError(
            f"{args.num_cpu_slots} CPU slots need {need} on node {node_id[:12]}, which has "
            f"{ {k: node['Resources'].get(k, 0) for k in need} }: an actor could be left unplaceable"
        )
    return [SlotSpec(f"{node_id}/cpu{i}", node_id, args.cpu_slot_bytes) for i in range(args.num_cpu_slots)]


def _resource_slots(nodes: list[dict], args: SlotArgs, actor: ActorConfig) -> list[SlotSpec]:
    """One slot per unit of `args.resource` on every alive node: the nodes an autoscaler adds bring theirs.

    A node whose CPUs (and the actor's own resources) cannot hold one actor per slot at once offers
    none: a spawn onto it could wait in Ray's scheduler. Such a node is logged, not an error, since it
    may have joined with a different shape than its node type states."""
    slots = []
    for n in nodes:
        have = n["Resources"]
        num = int(have.get(args.resource, 0))
        if num == 0:
            continue
        need = {"CPU": actor.num_cpus * num} | {k: v * num for k, v in actor.resources}
        if any(have.get(k, 0) < v for k, v in need.items()):
            log.warning("node %s has %d %s slots but not %s for their actors; none used", n["NodeID"][:12], num,
                        args.resource, need)
            continue
        slots.extend(SlotSpec(f"{n['NodeID']}/{args.resource}{i}", n["NodeID"], args.cpu_slot_bytes)
                     for i in range(num))
    return slots


def _gpu_slots(nodes: list[dict], args: SlotArgs, actor: ActorConfig, telemetry: TelemetryConfig) -> list[SlotSpec]:
    if actor.num_gpus <= 0:
        raise ValueError("GPU slots need actor.num_gpus > 0")
    per_gpu = max(1, int(1 / actor.num_gpus)) if actor.num_gpus < 1 else 1
    totals: dict[tuple[str, int], int] = {}
    if args.gpu_slot_bytes is None:
        agents = ensure_agents(telemetry, namespace=actor.namespace)
        for node in cluster_snapshot(agents, timeout_s=5.0):
            for d in node.devices:
                if d.kind == "cuda":
                    totals[(node.node_id, d.device_index)] = d.total_bytes
    slots = []
    for n in nodes:
        for i in range(int(n["Resources"].get("GPU", 0))):
            total = args.gpu_slot_bytes or totals.get((n["NodeID"], i))
            if total is None:  # its agent has not answered yet (a node just joined): looked at again next round
                log.warning("no memory figure for GPU %d on node %s yet (its telemetry agent has not answered; "
                            "slots.gpu_slot_bytes sets one): its slots wait", i, n["NodeID"][:12])
                continue
            # Fractional actors share a GPU: the GPU's memory is split evenly between its slots.
            for k in range(per_gpu):
                slots.append(SlotSpec(f"{n['NodeID']}/gpu{i}.{k}", n["NodeID"], total // per_gpu, "cuda", i))
    return slots


def _offers_slots(node: dict, args: SlotArgs) -> bool:
    """Whether the node's slots may come later than the node: its GPUs' memory is read from its telemetry
    agent, which a node that just joined may not have started yet. Other slots come from the node table
    alone (a node that offered none will offer none until it changes)."""
    return args.kind in ("gpu", "auto") and args.gpu_slot_bytes is None and node["Resources"].get("GPU", 0) > 0


def slot_stats(slots: Sequence[SlotSpec], nodes: Iterable[NodeTelemetry]) -> dict[str, tuple[float, float]]:
    """Each slot's (fragmentation, utilisation EWMA), from its device; slots with no reading are left out."""
    devices = {(n.node_id, d.kind, d.device_index): d for n in nodes for d in n.devices}
    stats = {}
    for slot in slots:
        device = devices.get((slot.node_id, slot.device_kind, slot.device_index))
        if device is not None:
            stats[slot.slot_id] = (device.fragmentation, device.utilization_ewma)
    return stats


class SlotRefresher:
    """Keeps the registry's slots, its link and the slots' telemetry current, on one background thread.

    Each round (every heartbeat, or at once when the link is woken) heartbeats the registry
    link; a new registry incarnation gets this replica's slots at once and then whatever
    `on_new_incarnation` hands over (the ingress: its policy and its running rows).
    """

    def __init__(self, link: RegistryLink, args: SlotArgs, actor: ActorConfig, telemetry: TelemetryConfig, *,
                 slot_refresh_s: float, telemetry_refresh_s: float,
                 on_new_incarnation: Callable[[], None] = lambda: None) -> None:
        self._link, self._args, self._actor, self._telemetry = link, args, actor, telemetry
        self._on_new_incarnation = on_new_incarnation
        self._slot_refresh_s, self._telemetry_refresh_s = slot_refresh_s, telemetry_refresh_s
        self.slots: list[SlotSpec] = []
        self._node_ids: frozenset[str] = frozenset()  # the admissible nodes the slots were discovered on
        self._agents: dict[str, Any] = {}
        self._pending_stats: dict[str, tuple[float, float]] | None = None
        # Held while agents are created; once `stop` has taken it, none is: the last replica's detach kills
        # every actor alive then, and an agent a round created after it would outlive the app.
        self._agents_lock = threading.Lock()
        self._is_stopped = False
        self._link.heartbeat(self._hand_over)  # a registry that cannot be reached fails the replica's start

    def register(self) -> None:
        self._register_slots()
        self._ensure_agents()

    def _register_slots(self, nodes: list[dict] | None = None) -> None:
        nodes = admissible_nodes() if nodes is None else nodes
        self.slots = discover_slots(self._args, self._actor, self._telemetry, nodes)
        ray.get(self._link.handle.register_slots.remote(self.slots), timeout=30)
        # A node that should offer slots and offered none (a GPU whose agent has not answered yet) is not
        # counted as seen: the next heartbeat looks again.
        with_slots = {s.node_id for s in self.slots}
        self._node_ids = frozenset(n["NodeID"] for n in nodes
                                   if n["NodeID"] in with_slots or not _offers_slots(n, self._args))

    def _nodes_changed(self) -> list[dict] | None:
        """The admissible nodes, if they are not the ones the slots were discovered on; else None."""
        nodes = admissible_nodes()
        return nodes if frozenset(n["NodeID"] for n in nodes) != self._node_ids else None

    def _ensure_agents(self) -> None:
        # Idempotent: agents already running are returned as they are; new nodes get one.
        with self._agents_lock:
            if not self._is_stopped:
                self._agents = ensure_agents(self._telemetry, namespace=self._actor.namespace)

    def stop(self, timeout_s: float = 30.0) -> None:
        """No agent is created once this returns (a round creating one is waited for, up to `timeout_s`: a
        control plane that hangs must not keep the replica from detaching); the link is closed."""
        self._link.close()
        is_locked = self._agents_lock.acquire(timeout=timeout_s)
        self._is_stopped = True
        if is_locked:
            self._agents_lock.release()

    def _hand_over(self) -> None:
        # The slots and the running rows first: the new registry kills unknown actors after its grace.
        self._register_slots()
        self._on_new_incarnation()
        self._ensure_agents()

    def poll_telemetry(self) -> dict[str, tuple[float, float]]:
        """One telemetry round: what the agents report now, kept for `take_stats`."""
        stats = slot_stats(self.slots, cluster_snapshot(self._agents, timeout_s=self._telemetry_refresh_s))
        if stats:
            self._pending_stats = stats
        return stats

    def take_stats(self) -> dict[str, tuple[float, float]] | None:
        """The figures polled since the last call, if any: the ingress passes them with its next admission."""
        stats, self._pending_stats = self._pending_stats, None
        return stats

    def start(self) -> None:
        threading.Thread(target=self._run, name="zq-slot-refresh", daemon=True).start()

    def _run(self) -> None:
        now = time.monotonic()
        next_slots, next_telemetry = now + self._slot_refresh_s, now + self._telemetry_refresh_s
        while not self._link.is_closed:
            self._link.wait()
            try:
                self._link.heartbeat(self._hand_over)
                now = time.monotonic()
                changed = self._nodes_changed()
                if now >= next_slots or changed is not None:
                    next_slots = now + self._slot_refresh_s
                    self._register_slots(changed)
                    self._ensure_agents()
                if now >= next_telemetry:
                    next_telemetry = now + self._telemetry_refresh_s
                    self.poll_telemetry()
            except Exception:  # a transient GCS, registry or agent error: try again next round
                log.exception("slot refresh failed")
