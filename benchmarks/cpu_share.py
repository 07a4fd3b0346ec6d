"""Where a system's CPU goes while it runs full: CPU seconds per process role over a window.

The load benchmark reads every process's CPU time (user + system) at the start and the end
of each system's closed-loop capacity window and charges the difference to a role named
from the process's command line: the engines (zeroqueue's request actors, or a baseline
replica, which also parses and streams its own HTTP), zeroqueue's ingress and registry,
the telemetry agent, Serve's proxy and controller, Ray's own daemons, the load client.
Divided by the requests completed in the window it is what one request costs each role —
on CPU slots the control plane's share comes out of the same cores the engines use.
"""

from __future__ import annotations

import threading
import time

import psutil

# (substring of the command line, role), first match wins; a process that matches none is "other".
ROLES: tuple[tuple[str, str], ...] = (
    ("RequestActor", "engines"),
    ("ServeReplica:queue-", "engines"),  # a baseline replica: its engine and its own HTTP handling
    ("ServeReplica:zeroqueue", "ingress"),
    ("haproxy", "haproxy"),  # Serve's direct ingress: HAProxy in front of the ingress replicas
    ("llama-server", "engines"),  # the peer (bench_peer): its engine, its HTTP and its queue
    ("RegistryActor", "registry"),
    ("TelemetryAgent", "telemetry"),
    ("ProxyActor", "proxy"),
    ("ServeController", "ray and serve"),
    ("raylet", "ray and serve"),
    ("gcs_server", "ray and serve"),
    ("benchmarks.load_client", "load client"),
    ("benchmarks.bench_admissions", "load client"),  # its client runs in the benchmark's own process
)


def cpu_times() -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) for every process that can be read."""
    out = {}
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        try:
            cmd, times = " ".join(proc.info["cmdline"] or ()), proc.info["cpu_times"]
        except (psutil.Error, TypeError):
            continue
        if times is not None:
            out[proc.pid] = (role_of(cmd), times.user + times.system)
    return out


def shares_of_cores(cpu: dict, num_cores: int) -> dict[str, float]:
    """Each role's CPU seconds over a block (`{"wall_s", "by_role_s"}`) as a share of the cores' time (wall x cores)."""
    capacity = cpu["wall_s"] * num_cores
    return {role: s / capacity for role, s in cpu["by_role_s"].items()}


def role_of(cmdline: str) -> str:
    return next((role for key, role in ROLES if key in cmdline), "other")


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role used between two readings (processes that ran through both)."""
    used: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        if pid in before:
            used[role] = used.get(role, 0.0) + max(0.0, seconds - before[pid][1])
    return dict(sorted(used.items(), key=lambda kv: -kv[1]))


class CpuSampler:
    """Reads `cpu_times()` every `period_s` on a thread, with the epoch time of each reading."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._read()  # the block's start and end are always among the readings
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._read()

    def _read(self) -> None:
        self.samples.append((time.time(), cpu_times()))

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self._read()

    def between(self, start: float, end: float) -> tuple[float, dict[str, float]]:
        """(seconds between the readings nearest `start` and `end`, CPU seconds per role in between)."""
        if len(self.samples) < 2:
            return 0.0, {}
        t0, first = min(self.samples, key=lambda s: abs(s[0] - start))
        t1, last = min(self.samples, key=lambda s: abs(s[0] - end))
        return t1 - t0, cpu_by_role(first, last)
