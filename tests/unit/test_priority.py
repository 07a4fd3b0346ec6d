"""Lowering an actor's priority: every thread in place, and the runtime_env that starts its worker niced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from actors.priority import runtime_env_for

# Nice is per thread: a thread started before the call must be lowered by its TID, one
# started after inherits the caller's value. Each run is a fresh process: nice only goes up.
_PROBE = textwrap.dedent("""
    import json, os, threading
    from actors.priority import lower_threads

    def nices():
        out = []
        for tid in os.listdir("/proc/self/task"):
            stat = open(f"/proc/self/task/{tid}/stat").read()
            out.append(int(stat[stat.rindex(")") + 2:].split()[16]))  # field 19, nice
        return out

    done = threading.Event()
    threading.Thread(target=done.wait).start()
    if os.environ.get("PRE_NICE"):  # the main thread already nicer than the target
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), int(os.environ["PRE_NICE"]))
    lower_threads(7)
    threading.Thread(target=done.wait).start()
    print(json.dumps(nices()))
    done.set()
""")

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice via /proc is Linux-only")


def _thread_nices(**env: str) -> list[int]:
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=os.environ | env,
                          capture_output=True, text=True, timeout=30, check=True)
    return json.loads(proc.stdout)


@needs_proc
def test_every_thread_before_and_after_the_call_is_lowered():
    if os.getpriority(os.PRIO_PROCESS, 0) > 7:
        pytest.skip("this process is already nicer than 7")
    assert sorted(_thread_nices()) == [7, 7, 7]


@needs_proc
def test_a_thread_already_nicer_than_the_target_is_not_raised():
    nices = _thread_nices(PRE_NICE="12")
    # main (12) and the thread it starts afterwards keep 12; the earlier thread goes to 7
    assert sorted(nices) == [7, 12, 12] or os.getpriority(os.PRIO_PROCESS, 0) > 7


@needs_proc
def test_the_runtime_envs_interpreter_starts_every_thread_niced():
    env = runtime_env_for(11, python=sys.executable)
    assert env["env_vars"]["RAY_worker_niceness"] == "11"  # Ray's connect leaves the main thread there
    command = env["py_executable"].split() + ["-c", _PROBE]
    nices = json.loads(subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout)
    assert min(nices) >= 11  # from the interpreter's first instruction, every thread


def test_nice_0_is_rays_default():
    assert runtime_env_for(0) == {}
