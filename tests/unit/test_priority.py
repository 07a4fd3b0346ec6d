"""The actor setup hook that lowers every thread of its worker process, and its runtime_env."""

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
    from actors.priority import lower_priority

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
    lower_priority()
    threading.Thread(target=done.wait).start()
    print(json.dumps(nices()))
    done.set()
""")

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice via /proc is Linux-only")


def _thread_nices(**env: str) -> tuple[list[int], str]:
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=os.environ | env,
                          capture_output=True, text=True, timeout=30, check=True)
    return json.loads(proc.stdout), proc.stderr


@needs_proc
def test_every_thread_before_and_after_the_call_gets_the_nice_from_the_env():
    if os.getpriority(os.PRIO_PROCESS, 0) > 7:
        pytest.skip("this process is already nicer than 7")
    nices, _ = _thread_nices(ZQ_ACTOR_NICE="7")
    assert len(nices) == 3 and set(nices) == {7}


@needs_proc
def test_a_thread_already_nicer_than_the_target_is_not_raised():
    nices, _ = _thread_nices(ZQ_ACTOR_NICE="7", PRE_NICE="12")
    # main (12) and the thread it starts afterwards keep 12; the earlier thread goes to 7
    assert sorted(nices) == [7, 12, 12] or os.getpriority(os.PRIO_PROCESS, 0) > 7


@needs_proc
def test_a_bad_value_warns_and_changes_nothing():
    nices, stderr = _thread_nices(ZQ_ACTOR_NICE="high")
    assert set(nices) == {os.getpriority(os.PRIO_PROCESS, 0)}
    assert "not an integer" in stderr


def test_runtime_env_names_the_hook_and_the_nice_and_is_empty_at_nice_0():
    assert runtime_env_for(0) == {}
    env_vars = runtime_env_for(10)["env_vars"]
    assert env_vars["__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"] == "actors.priority.lower_priority"
    assert env_vars["ZQ_ACTOR_NICE"] == env_vars["RAY_worker_niceness"] == "10"
