"""Discovering the accelerator slots request actors may occupy.

A slot is one GPU (`num_gpus=1` actors) or, on a CPU-only cluster, one CPU slot of
`cpu_slot_bytes` on the ingress's node. A slot the registry offers must be placeable by
Ray right now whenever it is free — otherwise a spawn onto it would wait in Ray's
scheduler, a hidden queue — so discovery checks that the node has the resources for
every slot's actor at once.
"""

from __future__ import annotations

import logging

import ray

from actors.request_actor import ActorConfig
from actors.telemetry import TelemetryConfig
from actors.telemetry_agent import cluster_snapshot, ensure_agents
from serve_app.config import SlotArgs
from serve_app.registry import SlotSpec

log = logging.getLogger(__name__)


def discover_slots(args: SlotArgs, actor: ActorConfig) -> list[SlotSpec]:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    num_gpus = sum(int(n["Resources"].get("GPU", 0)) for n in nodes)
    kind = args.kind if args.kind != "auto" else ("gpu" if num_gpus else "cpu")
    if kind == "gpu":
        return _gpu_slots(nodes, args, actor)
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
    return [SlotSpec(f"{node_id[:12]}/cpu{i}", node_id, args.cpu_slot_bytes) for i in range(args.num_cpu_slots)]


def _gpu_slots(nodes: list[dict], args: SlotArgs, actor: ActorConfig) -> list[SlotSpec]:
    if actor.num_gpus <= 0:
        raise ValueError("GPU slots need actor.num_gpus > 0")
    per_gpu = max(1, int(1 / actor.num_gpus)) if actor.num_gpus < 1 else 1
    totals: dict[tuple[str, int], int] = {}
    if args.gpu_slot_bytes is None:
        agents = ensure_agents(TelemetryConfig())
        for node in cluster_snapshot(agents, timeout_s=5.0):
            for d in node.devices:
                if d.kind == "cuda":
                    totals[(node.node_id, d.device_index)] = d.total_bytes
    slots = []
    for n in nodes:
        for i in range(int(n["Resources"].get("GPU", 0))):
            total = args.gpu_slot_bytes or totals.get((n["NodeID"], i))
            if total is None:
                raise ValueError(f"no memory figure for GPU {i} on node {n['NodeID'][:12]}: set slots.gpu_slot_bytes")
            # Fractional actors share a GPU: the GPU's memory is split evenly between its slots.
            for k in range(per_gpu):
                slots.append(SlotSpec(f"{n['NodeID'][:12]}/gpu{i}.{k}", n["NodeID"], total // per_gpu))
    return slots
