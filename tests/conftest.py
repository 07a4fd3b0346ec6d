"""Session-wide fixtures: one local Ray cluster for every test that needs it."""

from __future__ import annotations

import gc
import os
import sys

import pytest

# The tests size torch's thread pool for a 2-core machine; more threads only contend.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Two workers, each with two OpenMP threads, share two cores: a thread that waits sleeps instead of spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The tests on Ray: tests/serve, tests/reliability, the GPU check's harness, and the port's contract test on
# Ray. Two start a cluster of their own and need nothing of theirs (`serve run`, and a lost node's two-node
# cluster): like any other module, they run in whichever worker is free, which balances the two workers'
# loads, and while they run that worker's own cluster is stopped (stop_local_ray).
RAY_PATHS = ("tests/serve/", "tests/reliability/", "tests/gpu/test_gpu_check.py")
OWN_CLUSTER = ("tests/serve/test_serve_run.py", "tests/reliability/test_node_loss.py")
# `make test`'s two workers each run half of them, on a Ray cluster and a Serve of its own (tests/helpers.py's
# SERVE_PORT differs by worker); these modules are the second half, chosen so that the halves take about as
# long. In each half the tests run in collection order.
SECOND_HALF = (
    "tests/reliability/test_registry_loss.py", "tests/reliability/test_replica_loss.py",
    "tests/serve/test_registry_actor.py", "tests/serve/test_request_actor.py", "tests/serve/test_warm.py",
    "tests/gpu/test_gpu_check.py",
)


# The modules that take longest (a cluster or a real model each), started first after the Ray halves, so that
# the suite ends on short modules that fill both workers rather than on one long module.
LONGEST_FIRST = (
    "tests/serve/test_serve_run.py", "tests/reliability/test_node_loss.py", "tests/elastic/test_elastic.py",
    "tests/runtime/test_smollm2.py",
    "tests/unit/test_bench_loader.py",
)


def is_ray_test(nodeid: str) -> bool:
    return (nodeid.startswith(RAY_PATHS) and not nodeid.startswith(OWN_CLUSTER)) or nodeid.endswith("[ray]")


def ray_half(nodeid: str) -> str:
    return "ray:1" if nodeid.startswith(SECOND_HALF) else "ray:0"


def pytest_collection_finish(session):
    """What collection built (every test module, torch, Ray, transformers: millions of objects) lives until the
    worker ends: frozen, it is no longer scanned by each full garbage collection, nor by each `gc.collect()` a
    benchmark's harness makes before it measures memory (tests/unit/test_bench_loader.py makes 30)."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers. Each starts with one half of the tests on Ray, in
    collection order on one Ray cluster of its own; then the longest modules; then every other module goes
    whole to whichever worker is free (its module-scoped app is built once, its tests in order).
    The suite is bound by its CPU (benchmarks/results/suite_cpu.md), so the halves do not make it faster than
    one worker running every test on Ray; they stay because a worker replaced after a hung test starts a
    cluster for half of them, not all. Starting the longest modules early keeps the end of the run from
    being one long module on one worker while the other is idle.
    (xdist's own `--dist loadgroup` marks do not reach its scheduler under pytest 9.)"""
    from xdist.scheduler import LoadScopeScheduling

    class RayHalves(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ray_half(nodeid) if is_ray_test(nodeid) else nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node) -> None:
            """Worker gwN takes the Ray half N % 2 first, while it is still to run; then the longest modules."""
            for scope in (*reversed(LONGEST_FIRST), f"ray:{int(node.gateway.id[2:]) % 2}"):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

        def remove_node(self, node):
            """A worker that crashed (pytest-timeout ends a hung test's worker) gives its other tests back, but
            not the one it crashed on: LoadScopeScheduling would hand that one to the next worker too, and a hung
            test would then hang every replacement in turn."""
            workload = self.assigned_work[node]
            pending = [nodeid for unit in workload.values() for nodeid, is_done in unit.items() if not is_done]
            if not pending:
                return super().remove_node(node)
            crashed = pending[0]  # a worker runs its tests in the order they were sent
            workload[self._split_scope(crashed)][crashed] = True
            super().remove_node(node)
            return crashed

    return RayHalves(config, log)


def start_local_ray():
    """The worker's local Ray cluster, started by the first test that needs it. It is stopped when the worker
    goes on to tests that need none (pytest_runtest_teardown below): each worker runs its Ray half first, so
    for the rest of the run an idle cluster would only take CPU from the other worker. A later test that needs
    it starts it again (a worker that took over a crashed worker's tests)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # always a cluster of its own, never one another process started here
            # Logical CPUs are more than the machine's cores so that actors which mostly wait (ingress,
            # telemetry) and the CPU request slots can all be placed.
            num_cpus=8,
            namespace="zeroqueue-tests",
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            # Metrics reach Prometheus every second (Ray's floor) instead of every 10 s: the export tests
            # wait for them.
            _system_config={"metrics_report_interval_ms": 1000},
        )
    return ray


def stop_local_ray() -> None:
    ray = sys.modules.get("ray")  # never imported: never started
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster():
    """A real local Ray cluster, shared by every module that needs it (start_local_ray)."""
    return start_local_ray()


def uses_ray(item) -> bool:
    return "ray_cluster" in item.fixturenames or is_ray_test(item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the module's own fixtures (its app, its registry) go first
    if uses_ray(item) and (nextitem is None or not uses_ray(nextitem)):
        stop_local_ray()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random-weight `tiny` Llama checkpoint in HF layout (fp32)."""
    from weights_tool.synth import synthesize

    return synthesize("tiny", tmp_path_factory.mktemp("tiny-hf"), dtype="float32", seed=3)


@pytest.fixture(scope="session")
def tiny_zqs(tiny_checkpoint, tmp_path_factory):
    """The `tiny` checkpoint packed into a `.zqs` shard file."""
    from weights_tool.pack import pack

    return pack(tiny_checkpoint, tmp_path_factory.mktemp("tiny-zqs") / "tiny.zqs")


@pytest.fixture(scope="session")
def tiny_zqs_compressed_embeddings(tiny_checkpoint, tmp_path_factory):
    """The same checkpoint with its embedding table compressed: only the whole table can be read."""
    from weights_tool.pack import pack

    out = tmp_path_factory.mktemp("tiny-zqs-ce") / "tiny.zqs"
    return pack(tiny_checkpoint, out, raw_embeddings=False)


@pytest.fixture(scope="session")
def layered_zqs(tmp_path_factory):
    """A model whose load takes long enough (tens of ms) that overlap with prefill is observable."""
    from weights_tool.pack import pack
    from weights_tool.synth import preset_config, synthesize

    cfg = preset_config("tiny") | {
        "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 4,
    }
    hf = synthesize(cfg, tmp_path_factory.mktemp("layered-hf"), dtype="float32", seed=5)
    return pack(hf, tmp_path_factory.mktemp("layered-zqs") / "layered.zqs", level=1)
