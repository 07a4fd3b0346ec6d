"""`python -m weights_tool` end to end, in subprocesses, as a user runs it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_format import flip_byte, read_dir, tiny_config, write_checkpoint
from weights_tool.reader import ShardReader

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "weights_tool", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_pack_inspect_verify_unpack(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "hf", tiny_config("bfloat16"), num_shards=2)
    zqs = tmp_path / "model.zqs"

    packed = run("pack", str(tmp_path / "hf"), "-o", str(zqs), "--level", "3", "--threads", "2")
    assert packed.returncode == 0, packed.stderr
    assert "compression ratio" in packed.stdout

    inspected = run("inspect", str(zqs))
    assert inspected.returncode == 0, inspected.stderr
    for expected in ("LlamaForCausalLM", "layers        3", "BF16", "layer.2", "final", "ratio"):
        assert expected in inspected.stdout

    verified = run("verify", str(zqs))
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.startswith("OK")

    unpacked = run("unpack", str(zqs), "-o", str(tmp_path / "out"))
    assert unpacked.returncode == 0, unpacked.stderr
    assert read_dir(tmp_path / "out") == read_dir(tmp_path / "hf")

    with ShardReader(zqs) as r:
        frame = r.group("layer.1").frames[0]
    flip_byte(zqs, frame.offset + frame.stored_size // 2)
    broken = run("verify", str(zqs))
    assert broken.returncode == 1
    assert "group layer.1 frame 0" in broken.stderr


def test_raw_codec_and_bad_inputs(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "hf", tiny_config("float16"))
    zqs = tmp_path / "model.zqs"
    packed = run("pack", str(tmp_path / "hf"), "-o", str(zqs), "--level", "0")
    assert packed.returncode == 0, packed.stderr
    assert "raw" in packed.stdout and "1.000" in packed.stdout

    (tmp_path / "not.zqs").write_bytes(b"\x80\x04 pickled")
    bad = run("inspect", str(tmp_path / "not.zqs"))
    assert bad.returncode == 1 and "pickle" in bad.stderr

    missing = run("pack", str(tmp_path / "nowhere"), "-o", str(zqs))
    assert missing.returncode == 1 and "config.json" in missing.stderr

    assert run("pack", str(tmp_path / "hf")).returncode == 2  # no -o: usage error


@pytest.mark.skipif(importlib.util.find_spec("weights_tool.synth") is None, reason="weights_tool.synth not written yet")
def test_synth_then_pack(tmp_path: Path) -> None:
    made = run("synth", "tiny", "-o", str(tmp_path / "hf"), "--dtype", "float32", "--shards", "2")
    assert made.returncode == 0, made.stderr
    packed = run("pack", str(tmp_path / "hf"), "-o", str(tmp_path / "model.zqs"))
    assert packed.returncode == 0, packed.stderr
    assert "F32" in packed.stdout
