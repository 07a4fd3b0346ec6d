"""The loader benchmark's helpers: the throttle, eviction and residency, and every method's bytes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import bench_loader as bench
from benchmarks.loader_artefacts import artefact_paths, build_artefacts
from benchmarks.loader_methods import METHODS, RATES, load_st_pread_emulated, safetensors_specs
from benchmarks.loader_storage import Throttle, evict, read_all, resident_pages, throttled_reader, warm
from weights_tool import frames as frames_module
from weights_tool import reader as reader_module
from weights_tool.layer_stream import LayerStream
from weights_tool.reader import ShardReader


def _random_file(path: Path, size: int, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


def _filesystem(path: Path) -> str:
    best, fs = "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, kind = line.split()[:3]
        if str(path.resolve()).startswith(mount) and len(mount) > len(best):
            best, fs = mount, kind
    return fs


def test_throttle_delivers_the_bytes_at_its_rate(tmp_path: Path) -> None:
    data = _random_file(tmp_path / "f", 3 << 20)
    rate = 15e6
    throttle = Throttle(rate)
    t0 = time.perf_counter()
    got = read_all(tmp_path / "f", throttle)
    elapsed = time.perf_counter() - t0
    assert bytes(got) == data
    assert throttle.num_bytes == len(data)
    assert 0.8 * len(data) / rate <= elapsed <= 1.2 * len(data) / rate


def test_threads_share_one_link(tmp_path: Path) -> None:
    data = [_random_file(tmp_path / f"f{k}", 1 << 20, seed=k) for k in range(2)]
    rate = 10e6
    throttle = Throttle(rate)
    got: dict[int, bytearray] = {}
    threads = [threading.Thread(target=lambda k=k: got.__setitem__(k, read_all(tmp_path / f"f{k}", throttle)))
               for k in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    assert [bytes(got[k]) for k in range(2)] == data
    assert 0.8 * 2 * len(data[0]) / rate <= elapsed <= 1.2 * 2 * len(data[0]) / rate


def test_throttle_refuses_a_rate_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="rate"):
        Throttle(0)


def test_throttled_reader_routes_every_shard_read(tiny_zqs: Path) -> None:
    with ShardReader(tiny_zqs) as reader:
        want = {n: a.copy() for g in reader.groups for n, a in reader.read_group(g.name).items()}
        stored = sum(f.stored_size for g in reader.groups for f in g.frames)
    throttle = Throttle(1e9)
    dests = {n: np.zeros_like(a) for n, a in want.items()}
    with throttled_reader(throttle), ShardReader(tiny_zqs) as reader, LayerStream(reader, dests) as stream:
        for i in range(-1, reader.num_layers + 1):
            stream.wait(i)
    assert all(np.array_equal(dests[n], want[n]) for n in want)
    assert throttle.num_bytes >= stored
    assert reader_module.os is os and frames_module.os is os  # the patch is gone


def test_evict_leaves_the_file_non_resident(tmp_path: Path) -> None:
    if _filesystem(tmp_path) == "tmpfs":
        pytest.skip("tmpfs pages are the file: they cannot be evicted")
    path = tmp_path / "f"
    _random_file(path, 1 << 20)
    assert warm(path) == resident_pages(path)[1] == (1 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert evict(path) == 0
    assert resident_pages(path)[0] == 0


def test_every_method_loads_the_checkpoints_bytes(tmp_path: Path) -> None:
    """run_one checks each tensor against model.safetensors; here on the `tiny` preset, every method and regime."""
    build_artefacts("tiny", tmp_path)
    regimes = ["warm", *RATES] + ([] if _filesystem(tmp_path) == "tmpfs" else ["cold"])
    num_threads = torch.get_num_threads()  # run_one expects a process of its own and sets it to 1
    try:
        for m in METHODS:
            for regime in set(regimes) & set(m.regimes):
                result = bench.run_one(bench.RunSpec("tiny", regime, m.name, m.dests[-1], 0, str(tmp_path)))
                assert result["seconds"] > 0
                assert (result["first_layer_s"] is not None) == m.name.startswith("zqs")
                if regime == "cold":
                    assert result["resident_pages_at_start"] == 0
                if regime in RATES:
                    assert result["throttled_bytes"] >= result["bytes_to_read"]
    finally:
        torch.set_num_threads(num_threads)


def test_the_byte_check_catches_a_wrong_tensor(tmp_path: Path) -> None:
    build_artefacts("tiny", tmp_path)
    st = artefact_paths("tiny", tmp_path)["safetensors"]
    specs = safetensors_specs(st)
    tensors, _ = load_st_pread_emulated({"safetensors": st}, specs, None, None)
    bench._check_bytes(tensors, specs, st)
    last = tensors[specs[-1].name].reshape(-1).view(torch.uint8)
    last[-1] ^= 1
    with pytest.raises(AssertionError, match=specs[-1].name):
        bench._check_bytes(tensors, specs, st)
