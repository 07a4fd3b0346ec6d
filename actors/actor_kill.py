"""Killing a named actor by its name: the one Ray call the ingress's placer and the registry share.

It lives in actors/, below both users (serve_app/ray_cluster/placement.py and registry_actor.py),
so that neither reaches sideways into the other. It is kept out of actor_names.py, which
stays free of Ray: the registry's pure state machine (serve_app/registry.py) imports names
from there without importing Ray.
"""

from __future__ import annotations

import ray


def kill_named(name: str, namespace: str) -> None:
    """Kill the actor named `name`, for good; one that is gone already is left alone."""
    try:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    except ValueError:  # no such actor
        pass
