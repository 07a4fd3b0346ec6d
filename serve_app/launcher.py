"""`serve run`, stopped cleanly however it is stopped: what `make serve` runs.

    python -m serve_app.launcher configs/serve.yaml      # any `serve run` arguments

`serve run` shuts Serve and the local Ray it started down on Ctrl-C (SIGINT) only. Stopped by
SIGTERM (`kill`, a service manager, a container's stop, a benchmark ending its server), it dies at
once, and Serve's HAProxy can outlive it still listening on port 8000: a Ray worker starts it and
starts it again at each graceful reload, so a copy started after the signal reached the group misses
it. The next `serve run` then cannot bind the port (by hand: two of two SIGTERMs to a `serve run`'s
whole process group left one HAProxy holding :8000, and the next `make serve` failed).

So this runs `serve run` in a session of its own and turns SIGTERM, SIGHUP and a Ctrl-C into the
one SIGINT that `serve run` handles; a second signal, or `stop_timeout_s` without an exit, kills it at
once. Once it has exited, whatever of its session is still running `settle_s` later is ended — SIGTERM,
then SIGKILL after `grace_s` — by session, not process group: Ray puts each worker in a group of its own,
and HAProxy in its manager's. It exits with `serve run`'s status.

After a Ctrl-C, `serve run` exits before the Ray dashboard's module processes do: they notice their
parent's end within a second or two (by hand: 6-9 of them still there the instant `serve run` had
exited, none a few seconds later; nothing on :8000 or :8265). `settle_s` lets them go on their own, so
what the log names as left behind is what would have stayed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

log = logging.getLogger("zeroqueue.launcher")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def session_members(sid: int) -> list[int]:
    """The live processes of session `sid` (zombies, which only wait to be reaped, left out)."""
    out = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def end_session(sid: int, grace_s: float = 10.0, poll_s: float = 0.1, settle_s: float = 0.0) -> list[int]:
    """SIGTERM to every live process of session `sid` still there `settle_s` from now, SIGKILL to those still
    there `grace_s` later; the pids that had to be signalled (none where the session went on its own)."""
    _wait_gone(sid, settle_s, poll_s)
    signalled: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not (members := session_members(sid)):
            break
        for pid in members:
            if pid not in signalled:
                log.info("%s to %d (%s), left behind by serve run", signal.Signals(sig).name, pid, _name(pid))
        signalled += [pid for pid in members if pid not in signalled]
        for pid in members:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        _wait_gone(sid, grace_s, poll_s)
    return signalled


def _wait_gone(sid: int, timeout_s: float, poll_s: float) -> None:
    """Until session `sid` has no live process, or `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and session_members(sid):
        time.sleep(poll_s)


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "gone"


def run(command: list[str], *, stop_timeout_s: float = 60.0, grace_s: float = 10.0, poll_s: float = 0.1,
        settle_s: float = 5.0) -> int:
    """`command` in a session of its own, stopped as the module says; its exit status."""
    stop_asked_at: list[float] = []
    is_killed = False
    child: subprocess.Popen | None = None

    def stop(signum: int, _frame) -> None:
        stop_asked_at.append(time.monotonic())
        if child is None:
            return  # not started yet: the loop below stops it at once
        try:
            if len(stop_asked_at) == 1:
                log.info("%s: stopping serve run as Ctrl-C does", signal.Signals(signum).name)
                child.send_signal(signal.SIGINT)
            else:  # asked again: no more waiting for a graceful stop
                child.kill()
        except ProcessLookupError:
            pass

    # Handlers first: a signal ignored here (a shell that started this in the background ignores SIGINT for
    # it) would stay ignored in `serve run`, which then never hears the SIGINT it is sent. A handled one is
    # reset to its default by exec, and Python installs its KeyboardInterrupt handler there.
    # A SIGHUP ignored here (`nohup`) stays ignored: the server was meant to outlive its terminal.
    handled = [sig for sig in STOP_SIGNALS if not (sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN)]
    previous = {sig: signal.signal(sig, stop) for sig in handled}
    try:
        child = subprocess.Popen(command, start_new_session=True)
        if stop_asked_at:
            child.send_signal(signal.SIGINT)
        while (code := child.poll()) is None:
            if stop_asked_at and not is_killed and time.monotonic() - stop_asked_at[0] > stop_timeout_s:
                log.warning("serve run still running %.0f s after it was asked to stop: killing it",
                            stop_timeout_s)
                child.kill()
                is_killed = True
            time.sleep(poll_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if left := end_session(child.pid, grace_s, poll_s, settle_s):
        log.info("ended %d process(es) serve run left behind: %s", len(left), left)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve = Path(sys.executable).with_name("serve")
    return run([str(serve), "run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
