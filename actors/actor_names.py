"""Names of the named actors a deployment creates in its namespace: made and recognised here only.

    zq-{model}-{12 hex}      a request actor (hot, warm or fresh), one per process
    zq-telemetry-{12 hex}    a node's telemetry agent (the node id's first 12 hex digits)
    zq-registry              the deployment's admission registry

The registry tells request actors from the others by name: it kills unknown request actors
as orphans, and must never take an agent or itself for one.
"""

from __future__ import annotations

import re
import uuid

REGISTRY_NAME = "zq-registry"
_TELEMETRY_PREFIX = "zq-telemetry-"
_REQUEST_ACTOR = re.compile(r"^zq-(?!telemetry-|registry).+-[0-9a-f]{12}$")


def new_actor_name(model: str) -> str:
    """A fresh request actor's name: unique, and recognisable from the model id."""
    return f"zq-{model}-{uuid.uuid4().hex[:12]}"


def is_request_actor_name(name: str) -> bool:
    return _REQUEST_ACTOR.match(name) is not None


def agent_name(node_id: str) -> str:
    """The telemetry agent of the node `node_id` (one per node; found by this name)."""
    return f"{_TELEMETRY_PREFIX}{node_id[:12]}"
