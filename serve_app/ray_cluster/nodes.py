"""The nodes admission may place on: alive in Ray's node table, and not being drained.

A node being drained (autoscaler v2 ending an idle node, or a preemption with a deadline: `ray
drain-node`, or KubeRay before it deletes the pod) is still alive, and its actors still run: it
leaves admission first — discovery skips it, and the registry's reconcile takes its slots out of
every decision (`Books.set_draining`) — so no new row lands on a node about to go, while the rows
already there run on, booked, until they end or the node does. Ray lists draining nodes only
through its GCS state accessor, not `ray.nodes()`.
"""

from __future__ import annotations

import logging

import ray

log = logging.getLogger(__name__)


def draining_node_ids() -> set[str]:
    """Hex ids of the nodes being drained; empty when Ray cannot say (an older GCS): best effort."""
    try:
        return set(ray._private.state.state.get_draining_nodes())
    except Exception:  # the accessor is Ray's private API: never let it fail a reconcile or a refresh
        log.debug("draining nodes not read", exc_info=True)
        return set()


def admissible_nodes() -> list[dict]:
    """Ray's node table entries of the nodes that are alive and not being drained."""
    draining = draining_node_ids()
    return [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in draining]
