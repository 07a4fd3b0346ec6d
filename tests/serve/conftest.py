"""Fixtures the serve tests share: an app deployed on the session's real Serve and HTTP for a module,
and cleared after it."""

from __future__ import annotations

import pytest

from tests.helpers import kill_namespace, run_app, undeploy


@pytest.fixture(scope="module")
def deploy_app(ray_cluster):
    """`deploy_app(port, name, app, namespace=None)` runs the built `app` on the session's Serve (`port` is
    SERVE_PORT) as `name` and returns its base URL; after the module, its app is deleted (Serve stays for
    the next module) and the named actors left in `namespace` (request actors, the registry, telemetry
    agents) are killed."""
    namespaces: list[str | None] = []

    def deploy(port: int, name: str, app, namespace: str | None = None) -> str:
        namespaces.append(namespace)
        return run_app(port, name, app)

    yield deploy
    if namespaces:
        undeploy(ray_cluster)
        for namespace in dict.fromkeys(n for n in namespaces if n is not None):
            kill_namespace(ray_cluster, namespace)
