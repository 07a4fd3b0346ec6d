"""Ray's fake multi-node autoscaling cluster, started and ended without touching any other Ray on the machine.

The fake provider (`provider: {type: fake_multinode}`, env `RAY_FAKE_CLUSTER=1`) is what Ray tests its
autoscaler with: the real autoscaler (v1, the default) runs in the head's monitor process and "launches" a
worker node by starting a local raylet (a `ray._private.node.Node`) with the node type's resources, and
"terminates" it by killing that raylet. `ray.cluster_utils.AutoscalingCluster` starts one, but its start
and shutdown run `ray stop --force` (which ends every Ray process on the machine) and it reads
`fake_multi_node/example.yaml`, which the installed wheel lacks. This harness writes the full config itself.

    cluster = FakeAutoscalingCluster({"CPU": 1}, {"slot_worker": {
        "resources": {"CPU": 1, "zq_slot": 1}, "node_config": {}, "min_workers": 0, "max_workers": 2}})
    address = cluster.start()          # "ip:port"; pass it to ray.init(address=...)
    try: ...
    finally: cluster.shutdown()

- `head_resources`: CPU, GPU and object_store_memory become `ray start` flags, the rest `--resources`.
- `worker_types`: autoscaler node types (`resources`, `node_config`, `min_workers`, `max_workers`).
- `idle_timeout_minutes`: how long a worker node stays idle before the autoscaler terminates it.
- `port` (GCS, default a free one), `temp_dir` (default a new short dir under /tmp: Unix socket paths are
  limited to 107 characters; a dir this harness made is removed on shutdown, one passed in is kept).
- `processes()`: this cluster's live processes; `shutdown()` ends exactly those.

Every process is started under `ray start --head` run in a new session (start_new_session=True): the GCS,
the head raylet, the monitor (autoscaler), and the worker raylets the autoscaler starts all share that
session id, and so do their workers. Shutdown ends the processes of that session, plus any descendant of
them or any process naming this cluster's temp dir (in case one started a session of its own).
RAY_ADDRESS is removed from the cluster's environment; a driver should pass `address=` explicitly.
RAY_AUTH_MODE defaults to "disabled", as for ray.init()'s local clusters.

An idle worker goes idle_timeout_minutes after it became idle, which it may already be while a
`request_resources` holds it: the node goes soon after that request is lowered. The cluster coexists
with other Ray clusters on the machine (ray.init()'s, or another of these). How fast a node joins is
measured by benchmarks/bench_elastic.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import psutil
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_TYPE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class FakeAutoscalingCluster:
    def __init__(self, head_resources: dict, worker_types: dict, *, idle_timeout_minutes: float = 0.2,
                 port: int | None = None, temp_dir: str | None = None):
        self.head_resources = dict(head_resources)
        self.worker_types = json.loads(json.dumps(worker_types))  # a deep copy
        self.idle_timeout_minutes = idle_timeout_minutes
        self.port = port or free_port()
        self._own_temp_dir = temp_dir is None
        self.temp_dir = temp_dir or tempfile.mkdtemp(prefix="rfc-", dir="/tmp")
        self.session_id: int | None = None  # the sid of every process of this cluster
        self.address: str | None = None

    def config(self, gcs_address: str) -> dict:
        """The whole autoscaler config: the v1 autoscaler reads it as is, with no defaults filled in."""
        provider = {"type": "fake_multinode", "gcs_address": gcs_address,  # else worker raylets use :6379
                    "use_node_id_as_ip": True, "disable_node_updaters": True, "disable_launch_config_check": True}
        return {
            "cluster_name": "fake_multinode",
            "max_workers": sum(t.get("max_workers", 0) for t in self.worker_types.values()),
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": self.idle_timeout_minutes,
            "docker": {},
            "provider": provider,
            "auth": {"ssh_user": "ubuntu"},
            "available_node_types": {
                **self.worker_types,
                FAKE_HEAD_NODE_TYPE: {"resources": self.head_resources, "node_config": {}, "max_workers": 0},
            },
            "head_node_type": FAKE_HEAD_NODE_TYPE,
            "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
            "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
        }

    def start(self, timeout_s: float = 120) -> str:
        from ray._private.services import get_node_ip_address

        ip = get_node_ip_address()
        self.address = f"{ip}:{self.port}"
        config_path = os.path.join(self.temp_dir, "autoscaling.json")
        with open(config_path, "w") as f:
            json.dump(self.config(self.address), f)
        resources = dict(self.head_resources)
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [ray_bin if os.path.exists(ray_bin) else "ray", "start", "--head", f"--port={self.port}",
               f"--node-ip-address={ip}", f"--temp-dir={self.temp_dir}", f"--autoscaling-config={config_path}",
               f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}",
               "--dashboard-agent-listen-port=0", "--include-dashboard=false", "--disable-usage-stats"]
        for key, flag in (("CPU", "--num-cpus"), ("GPU", "--num-gpus"), ("object_store_memory", "--object-store-memory")):
            if key in resources:
                cmd.append(f"{flag}={int(resources.pop(key))}")
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_enable_autoscaler_v2="0")
        # With RAY_AUTH_MODE unset, `ray start` turns token auth on when ~/.ray/auth_token exists, and then a
        # driver whose RAY_AUTH_MODE is unset fails with "InvalidAuthToken"; ray.init()'s local clusters do not.
        env.setdefault("RAY_AUTH_MODE", "disabled")
        log_path = os.path.join(self.temp_dir, "ray_start.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.session_id = proc.pid  # a new session's id is its leader's pid; it outlives the leader
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            with open(log_path) as f:
                log_tail = f.read()[-4000:]
            self.shutdown()
            raise RuntimeError(f"ray start exited {rc}:\n{log_tail}")
        return self.address

    def processes(self) -> list[psutil.Process]:
        """This cluster's live processes: its session's, their descendants, and any naming its temp dir."""
        if self.session_id is None:
            return []
        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter(["cmdline"]):
            try:
                if os.getsid(p.pid) == self.session_id or any(a.endswith(self.temp_dir) or f"{self.temp_dir}/" in a
                                                               for a in p.info["cmdline"] or ()):
                    found[p.pid] = p
            except (OSError, psutil.Error):
                pass
        for p in list(found.values()):
            try:
                found.update((c.pid, c) for c in p.children(recursive=True))
            except psutil.Error:
                pass
        found.pop(os.getpid(), None)
        return list(found.values())

    def shutdown(self, grace_s: float = 10) -> None:
        """End this cluster's processes and wait for them to go: SIGTERM, then SIGKILL after grace_s.

        In stages: the autoscaler first (so that it launches no node meanwhile), then all but the GCS, then
        the GCS: signalled all at once, the raylets and the GCS each wait on the other, and the SIGTERM
        grace runs out."""
        def command(p: psutil.Process) -> str:
            try:
                return " ".join(p.cmdline())
            except psutil.Error:
                return ""

        for _ in range(3):  # again, for any process started while the first round ran
            procs = self.processes()
            if not procs:
                break
            monitor = [p for p in procs if "/autoscaler/" in command(p) and "monitor.py" in command(p)]
            gcs = [p for p in procs if "gcs_server" in command(p)]
            rest = [p for p in procs if p not in monitor and p not in gcs]
            for stage in (monitor, rest, gcs):
                for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5)):
                    for p in stage:
                        try:
                            p.send_signal(sig)
                        except psutil.Error:
                            pass
                    _, stage = psutil.wait_procs(stage, timeout=wait_s)
                    if not stage:
                        break
        if left := self.processes():
            raise RuntimeError(f"cluster processes left: {[(p.pid, command(p)) for p in left]}")
        if self._own_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
