"""Building the actors' CPU kernels: a builder that died mid-build blocks no later build, and each checkout
builds in a folder of its own (actors/cpu_kernels.py). No compiler runs here: torch's `load` is replaced at
its seam, and the lock is held by a real process that is really killed."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from actors import cpu_kernels


@pytest.fixture
def extension_root(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def _is_locked(folder) -> bool:
    with open(folder / "zq-build.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_a_build_removes_the_lock_file_a_dead_builder_left_and_builds_in_this_checkouts_folder(
        extension_root, monkeypatch):
    import torch.utils.cpp_extension as cpp

    folder = cpu_kernels.build_directory("zq_test_kernels")
    assert folder.parent == extension_root and folder.name.startswith("zq_test_kernels-")
    (folder / "lock").touch()  # torch's FileBaton, as a builder killed mid-build leaves it
    seen = {}

    def load(name, sources, build_directory=None, **kwargs):
        seen.update(name=name, build_directory=build_directory, stale=(folder / "lock").exists(),
                    locked=_is_locked(folder))  # a second open file description cannot take the flock
        return "extension"

    monkeypatch.setattr(cpp, "load", load)
    assert cpu_kernels._build("zq_test_kernels", cpu_kernels.SOURCES, ("-O3",)) == "extension"
    # torch's load would have waited on the stale file for ever; it is gone, and the build holds the flock.
    assert seen == {"name": "zq_test_kernels", "build_directory": str(folder), "stale": False, "locked": True}
    assert not _is_locked(folder)  # released after the build


def test_a_builder_killed_holding_the_lock_blocks_no_later_build(extension_root):
    folder = cpu_kernels.build_directory("zq_test_kernels")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from actors import cpu_kernels
        with cpu_kernels.build_lock(Path({str(folder)!r})):
            Path({str(folder)!r}, "lock").touch()  # mid-build: torch's own lock file taken
            print("held", flush=True)
            time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extension_root)})
    try:
        assert holder.stdout.readline().strip() == "held"
        assert _is_locked(folder)  # a second builder waits while the first lives
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert (folder / "lock").exists()  # what the dead builder left
    assert not _is_locked(folder)  # the kernel dropped its flock
    with cpu_kernels.build_lock(folder):
        assert not (folder / "lock").exists()
