"""The machine a benchmark runs on, read one way for every benchmark: cores, CPU, memory, load, versions.

Every report says something of its machine; each fact is read here only, so two reports
of one machine agree on it. Was something else running when a benchmark started? The
1-minute load average lags by about a minute, so a one-core job that ended just before a
run still shows as ~1; only a figure above `MAX_QUIET_LOAD` says other work shared the
machine (`was_busy`, one rule for every report).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Sequence
from importlib import import_module
from importlib.metadata import version as distribution_version
from pathlib import Path
from typing import Any

MAX_QUIET_LOAD = 1.5
UNKNOWN_CPU = "unknown CPU"
# Packages whose version is read from their metadata: importing them has side effects
# (locust monkey-patches the process it is imported into).
_METADATA_ONLY = frozenset({"locust"})


def cores() -> int | None:
    """Logical CPUs (`os.cpu_count()`): None where the OS does not say."""
    return os.cpu_count()


def cpu_model() -> str:
    """The CPU's model name, from /proc/cpuinfo; `UNKNOWN_CPU` where it has none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return UNKNOWN_CPU


def cpu_features() -> list[str]:
    """The CPU's flags that decide the actors' kernels and dtype (actors/cpu_kernels.py, compute_dtype.py)."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]


def mem_gib() -> float:
    """Physical memory (MemTotal), GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no MemTotal in /proc/meminfo")


def architecture() -> str:
    """The machine's architecture, as `uname -m` says it (x86_64, aarch64)."""
    return platform.machine()


def kernel() -> str:
    """The kernel's release, as `uname -r` says it."""
    return platform.release()


def load_average() -> tuple[float, float, float]:
    """The 1-, 5- and 15-minute load averages now."""
    return os.getloadavg()


def load_text(load: Sequence[float] | None = None, sep: str = " / ") -> str:
    """Load averages (now, unless given) with two decimals: "0.52 / 0.61 / 0.70"."""
    return sep.join(f"{x:.2f}" for x in (load_average() if load is None else load))


def was_busy(load_1min_at_start: float) -> bool:
    """Did other work share the machine when a run started? (The module's docstring says why 1.5.)"""
    return load_1min_at_start > MAX_QUIET_LOAD


def python_version() -> str:
    return platform.python_version()


def version_of(package: str) -> str:
    """A package's version as the package itself reports it (`__version__`), or its metadata's where
    importing it has side effects."""
    if package in _METADATA_ONLY:
        return distribution_version(package)
    return str(import_module(package).__version__)


def versions(*packages: str) -> dict[str, str]:
    """Python's version and each package's, keyed by name: {"python": ..., "torch": ...}."""
    return {"python": python_version(), **{p: version_of(p) for p in packages}}


def machine(*packages: str) -> dict[str, Any]:
    """What a run records of its machine: cores, CPU, memory (GiB), Python's and each package's version."""
    return {"cores": cores(), "cpu": cpu_model(), "mem_gib": mem_gib(), **versions(*packages)}


def write_report(out: Path, name: str, data: dict, text: str) -> None:
    """A benchmark's results under `out`: its data as `name`.json and its report as `name`.md, the report printed."""
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    (out / f"{name}.md").write_text(text)
    print(text)


def make_serve_env(root: Path = Path(".")) -> dict[str, str]:
    """The environment the Makefile's `serve` target sets before `serve run` (direct ingress, HAProxy)."""
    line = next(line for line in (root / "Makefile").read_text().splitlines()
                if "serve_app.launcher configs/serve.yaml" in line)
    return dict(word.split("=", 1) for word in line.split() if "=" in word and word.startswith("RAY_"))


def serve_run_command(config: str | Path) -> list[str]:
    """`serve run config` as `make serve` runs it: through serve_app/launcher.py, which a SIGTERM stops as
    Ctrl-C does, leaving nothing of it behind (its HAProxy once held :8000 against the next server)."""
    return [sys.executable, "-m", "serve_app.launcher", str(config)]


def stop_session(proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Stop a server started in a session of its own (`start_new_session=True`): SIGTERM, then its whole group."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start_serve_direct(port: int, *, is_haproxy: bool = False, include_dashboard: bool = False) -> None:
    """Ray (2 CPUs) and Serve with direct ingress on: each ingress replica serves the API on its own port (30000
    up), and `port` is served by Serve's proxy or, with `is_haproxy`, by Serve's HAProxy. Ray reads the
    switches in the controller and the replicas, which inherit this environment. No load balancer drains here,
    so a stopping replica waits 1 s, not Serve's 30."""
    import ray
    from ray import serve

    os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    if is_haproxy:
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "1"
    ray.init(num_cpus=2, include_dashboard=include_dashboard, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})


def direct_ingress_bases(num_replicas: int = 1, timeout_s: float = 120.0) -> list[str]:
    """The ingress replicas' own HTTP bases (direct ingress: from 30000 up), once `num_replicas` of them answer
    /health."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        bases = []
        for port in range(30000, 30000 + 4 * num_replicas + 6):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    bases.append(f"http://127.0.0.1:{port}")
            except httpx.HTTPError:
                continue
        if len(bases) == num_replicas:
            return bases
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(bases)} of {num_replicas} ingress replicas answer on a direct port: {bases}")
        time.sleep(1)


def served_threads() -> int:
    """The threads `make serve`'s actors compute with (configs/serve.yaml's actor.compute_threads)."""
    import yaml

    app = yaml.safe_load(Path("configs/serve.yaml").read_text())["applications"][0]
    return int(app["args"].get("actor", {}).get("compute_threads", 1))
