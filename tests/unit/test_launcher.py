"""serve_app/launcher.py against a stand-in for `serve run`: a process that leaves a grandchild behind in a
process group of its own, as Ray's workers (and the HAProxy one of them starts) are. tests/serve/test_serve_run.py
stops the real `serve run` through it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from serve_app.launcher import end_session, session_members

# Exits 0 on SIGINT, as `serve run` does on Ctrl-C, leaving its grandchild running; "stubborn" ignores SIGINT.
SERVE_RUN_STAND_IN = textwrap.dedent("""
    import os, pathlib, signal, subprocess, sys, time
    out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=os.setpgrp)
    if mode == "stubborn":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    (out / "grandchild").write_text(str(grandchild.pid))
    try:
        while True:
            time.sleep(0.05)
    except KeyboardInterrupt:
        (out / "sigint").write_text("heard")
        sys.exit(0)
""")

# The launcher with SIGINT ignored, as a shell starts a background job: it must still reach the stand-in.
LAUNCHER = ("import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); from serve_app.launcher import run; "
            "timeout = float(sys.argv.pop(1)); sys.exit(run(sys.argv[1:], stop_timeout_s=timeout, grace_s=2.0, poll_s=0.05, "
            "settle_s=0.5))")


@contextlib.contextmanager
def _launched(tmp_path: Path, mode: str, stop_timeout_s: float):
    """The launcher running the stand-in, once the stand-in has started its grandchild: (launcher, grandchild's
    pid); both killed on the way out, whatever the test did."""
    (tmp_path / "stand_in.py").write_text(SERVE_RUN_STAND_IN)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(stop_timeout_s), sys.executable,
                                 str(tmp_path / "stand_in.py"), str(tmp_path), mode],
                                cwd=Path(__file__).parents[2])
    grandchild = None
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "grandchild").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, "the stand-in did not start"
            time.sleep(0.05)
        grandchild = int((tmp_path / "grandchild").read_text())
        yield launcher, grandchild
    finally:
        for pid in (launcher.pid, grandchild):
            try:
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.wait()


def _is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not _is_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _is_gone(pid)


def test_sigterm_stops_serve_run_as_ctrl_c_does_and_ends_what_it_left(tmp_path):
    with _launched(tmp_path, "graceful", stop_timeout_s=30) as (launcher, grandchild):
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(20) == 0  # serve run's own status: it stopped on the SIGINT it was sent
        assert (tmp_path / "sigint").read_text() == "heard"
        assert _wait_gone(grandchild), "the process serve run left behind outlived the launcher"


def test_serve_run_that_does_not_stop_is_killed_after_the_timeout(tmp_path):
    with _launched(tmp_path, "stubborn", stop_timeout_s=1) as (launcher, grandchild):
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(20) == 128 + signal.SIGKILL
        assert not (tmp_path / "sigint").exists()
        assert _wait_gone(grandchild)


def test_a_second_signal_kills_at_once(tmp_path):
    with _launched(tmp_path, "stubborn", stop_timeout_s=600) as (launcher, grandchild):
        launcher.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(20) == 128 + signal.SIGKILL
        assert _wait_gone(grandchild)


def test_ending_a_session_with_nothing_left_signals_nobody():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    assert session_members(proc.pid) == []
    assert end_session(proc.pid, grace_s=0.1) == []


def test_a_process_that_ends_on_its_own_while_the_session_settles_is_not_signalled():
    # As the Ray dashboard's modules do after a Ctrl-C: they go a moment after serve run has exited.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in session_members(proc.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        reaper = threading.Thread(target=proc.wait)  # reaped as its parent would, so it is gone, not a zombie
        reaper.start()
        assert end_session(proc.pid, grace_s=0.5, poll_s=0.05, settle_s=60) == []
        reaper.join(5)
        assert proc.returncode == 0  # it ended by itself, not by a signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("ignores_term", [False, True])
def test_ending_a_session_terms_then_kills(ignores_term):
    code = ("import signal, time; " + ("signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignores_term else "")
            + "time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in session_members(proc.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)  # its SIGTERM disposition set
        assert end_session(proc.pid, grace_s=0.5, poll_s=0.05) == [proc.pid]
        assert proc.wait(5) == (-signal.SIGKILL if ignores_term else -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

