"""A lossy link between the load client and the server: a network namespace, a veth pair, tc netem.

    client (in namespace zq-bench-<pid>) ──veth, netem both ways──▶ relay on the host end ──▶ Serve on 127.0.0.1

Serve listens on loopback only, and loopback cannot be impaired without impairing Ray's
own traffic, so the client runs in a namespace of its own and reaches Serve through a
veth pair (a private /30, no route anywhere else) and a small TCP relay on the host end.
netem on each end of the pair delays and drops packets in each direction. Everything is
created by `lossy_link` and removed when it exits, whatever happened inside.

`probe()` builds and removes the link once, so a run knows before it starts whether this
machine allows it (root, `ip`, `tc`, and a kernel with netem), and if not, the exact error.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Impairment:
    loss_pct: float = 2.0
    delay_ms: float = 10.0
    jitter_ms: float = 2.0

    def netem_args(self) -> list[str]:
        return ["netem", "loss", f"{self.loss_pct:g}%", "delay", f"{self.delay_ms:g}ms", f"{self.jitter_ms:g}ms"]

    def describe(self) -> str:
        return (f"{self.loss_pct:g}% packet loss and {self.delay_ms:g} ± {self.jitter_ms:g} ms delay "
                f"each way (tc netem on both ends of a veth pair)")


@dataclass(frozen=True)
class Link:
    namespace: str
    base_url: str  # what the client in the namespace connects to
    exec_prefix: tuple[str, ...]  # prepend to a command to run it in the namespace


class NetemUnavailable(RuntimeError):
    """This machine cannot build the lossy link; the message is the failing command and its error."""


def _run(*cmd: str) -> None:
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        raise NetemUnavailable(f"`{' '.join(cmd)}`: {e}") from None
    except subprocess.CalledProcessError as e:
        raise NetemUnavailable(f"`{' '.join(cmd)}` exited {e.returncode}: {(e.stderr or e.stdout).strip()}") from None


def probe(impairment: Impairment) -> str | None:
    """None if the lossy link can be built here; otherwise why not, exactly."""
    try:
        with lossy_link(impairment, upstream_port=None):
            return None
    except NetemUnavailable as e:
        return str(e) + _kernel_hint()


def _kernel_hint() -> str:
    """Why the kernel has no netem, where it says so itself."""
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            if "# CONFIG_NET_SCH_NETEM is not set" in f.read():
                return " (this kernel is built without netem: `# CONFIG_NET_SCH_NETEM is not set` in /proc/config.gz)"
    except OSError:
        pass
    return ""


@contextmanager
def lossy_link(impairment: Impairment | None, upstream_port: int | None) -> Iterator[Link]:
    """The namespace, the veth pair with netem on both ends (none if `impairment` is None), and a
    relay to 127.0.0.1:`upstream_port` (none if None). Removed on exit, always."""
    pid = os.getpid()
    ns, host_if, ns_if = f"zq-bench-{pid}", f"zqb{pid % 100000}h", f"zqb{pid % 100000}n"
    # A private /30 per process, so two runs on one machine do not collide.
    host_ip, ns_ip = f"10.254.{pid % 250}.1", f"10.254.{pid % 250}.2"
    relay = None
    try:
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _run("ip", "link", "set", ns_if, "netns", ns)
        _run("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        _run("ip", "link", "set", host_if, "up")
        _run("ip", "-n", ns, "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        _run("ip", "-n", ns, "link", "set", ns_if, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        if impairment is not None:
            _run("tc", "qdisc", "add", "dev", host_if, "root", *impairment.netem_args())  # server -> client
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ns_if, "root",
                 *impairment.netem_args())  # client -> server
        port = 0
        if upstream_port is not None:
            relay = Relay(host_ip, ("127.0.0.1", upstream_port))
            port = relay.start()
        yield Link(ns, f"http://{host_ip}:{port}", ("ip", "netns", "exec", ns))
    finally:
        if relay is not None:
            relay.stop()
        # Deleting one end removes the pair (and its qdiscs); then the namespace.
        for cmd in (("ip", "link", "del", host_if), ("ip", "netns", "del", ns)):
            try:
                _run(*cmd)
            except NetemUnavailable:
                pass  # never created, or already gone with the namespace


class Relay:
    """A TCP relay from (listen_host, an ephemeral port) to `upstream`, on its own thread and event loop."""

    def __init__(self, listen_host: str, upstream: tuple[str, int]) -> None:
        self.listen_host, self.upstream = listen_host, upstream
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="zq-relay", daemon=True)
        self._server: asyncio.base_events.Server | None = None

    def start(self) -> int:
        """Start listening; returns the port."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        return future.result(timeout=10)

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.listen_host, 0)
        return self._server.sockets[0].getsockname()[1]

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF or an error on either side, then close the writer (the other pipe then ends too)."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()
