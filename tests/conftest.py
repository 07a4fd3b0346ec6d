"""Session-wide fixtures: one local Ray cluster for every test that needs it."""

from __future__ import annotations

import os

import pytest

# The tests size torch's thread pool for a 2-core machine; more threads only contend.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster, started once per session.

    Logical CPUs are more than the machine's cores so that actors which mostly wait
    (ingress, telemetry) and the CPU request slots can all be placed.
    """
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=8,
            namespace="zeroqueue-tests",
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    yield ray
    ray.shutdown()
