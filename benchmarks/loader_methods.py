"""The ways the loader benchmark loads one checkpoint, and the storage regimes it loads them in.

Each method takes the artefact paths, the checkpoint's tensor specs, a Throttle (or
None) and, optionally, prefaulted destination tensors, and returns the loaded tensors
with the moment layer 0 (and the embeddings) were in place, if it knows one earlier
than the end. bench_loader times them; the report describes them.
"""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import zstandard

from benchmarks.loader_storage import (
    CHUNK_BYTES,
    PAGE,
    PreadFile,
    Throttle,
    open_fd,
    read_all,
    read_exact,
    throttled_reader,
)
from weights_tool.checkpoint import read_safetensors_header
from weights_tool.dtypes import MODEL_DTYPE_OF, torch_dtype
from weights_tool.layer_stream import LayerStream
from weights_tool.reader import ShardReader

DTYPE = "bfloat16"
RATES = {"throttled 1 GB/s": 1e9, "throttled 0.5 GB/s": 0.5e9}
REGIMES = ("warm", "cold", *RATES)
NUM_THREADS = 2  # LayerStream threads: one per core here


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute, in model.safetensors
    size: int


def safetensors_specs(path: Path, throttle: Throttle | None = None) -> list[TensorSpec]:
    """The tensors of a safetensors file of model-dtype weights, in data order; its header read through `throttle`."""
    with open_fd(path) as fd:

        def read_at(offset: int, n: int) -> bytes:
            buf = bytearray(n)
            read_exact(fd, buf, offset, throttle)
            return bytes(buf)

        tensors, _ = read_safetensors_header(path, read_at=read_at)
    return [TensorSpec(t.name, torch_dtype(MODEL_DTYPE_OF[t.dtype]), t.shape, t.start, t.size) for t in tensors]


Paths = dict[str, Path]
Tensors = dict[str, torch.Tensor]
Loaded = tuple[Tensors, float | None]  # the tensors, and perf_counter() when layer 0 (and the embeddings) were in place
Loader = Callable[[Paths, list[TensorSpec], "Throttle | None", "Tensors | None"], Loaded]


def load_tar_xz(paths: Paths, specs: list[TensorSpec], throttle: Throttle | None, dests: Tensors | None) -> Loaded:
    """The seed's first baseline: stream the tar.xz through tarfile into memory, then safetensors.torch.load."""
    raw = io.BufferedReader(PreadFile(paths["tar.xz"], throttle), CHUNK_BYTES)
    with tarfile.open(fileobj=raw, mode="r|xz", bufsize=CHUNK_BYTES) as tar:
        member = next(m for m in tar if m.name == "model.safetensors")
        data = tar.extractfile(member).read()
        while raw.read(CHUNK_BYTES):  # the archive's tail (end-of-archive blocks), as `tar x` reads it
            pass
    return safetensors.torch.load(data), None


def load_zst_whole(paths: Paths, specs: list[TensorSpec], throttle: Throttle | None, dests: Tensors | None) -> Loaded:
    """The seed's second baseline: read the whole .zst, decompress it to memory, then safetensors.torch.load."""
    raw = read_all(paths["zst"], throttle)
    data = zstandard.ZstdDecompressor().decompress(raw)
    del raw
    return safetensors.torch.load(data), None


def _load_zqs(key: str, *, verify: bool = True) -> Loader:
    def load(paths: Paths, specs: list[TensorSpec], throttle: Throttle | None, dests: Tensors | None) -> Loaded:
        tensors = dests if dests is not None else empty_tensors(specs)
        views = {n: t.view(torch.uint8).numpy() for n, t in tensors.items()}
        with (throttled_reader(throttle), ShardReader(paths[key]) as reader,
              LayerStream(reader, views, num_threads=NUM_THREADS, verify=verify) as stream):
            stream.wait(-1)
            stream.wait(0)
            first = time.perf_counter()
            for i in range(1, reader.num_layers + 1):
                stream.wait(i)
        return tensors, first

    return load


def load_st_mmap_copy(paths: Paths, specs: list[TensorSpec], throttle: Throttle | None, dests: Tensors | None) -> Loaded:
    """safetensors.torch.load_file (mmap), then copy_ into the destinations, as load_state_dict does."""
    src = safetensors.torch.load_file(paths["safetensors"])
    tensors = dests if dests is not None else empty_tensors(specs)
    with torch.no_grad():
        for name, t in tensors.items():
            t.copy_(src[name])
    return tensors, None


def load_st_pread(paths: Paths, specs: list[TensorSpec], throttle: Throttle | None, dests: Tensors | None) -> Loaded:
    """safetensors.torch.load_file(backend="pread"): its fresh tensors are the destinations."""
    return safetensors.torch.load_file(paths["safetensors"], backend="pread"), None


def load_st_pread_emulated(paths: Paths, specs: list[TensorSpec], throttle: Throttle | None, dests: Tensors | None) -> Loaded:
    """What the pread backend does, done here so it can be throttled: the header, then a fresh tensor per entry,
    pread into it."""
    tensors = {}
    with open_fd(paths["safetensors"]) as fd:
        for s in safetensors_specs(paths["safetensors"], throttle):
            t = torch.empty(s.shape, dtype=s.dtype)
            read_exact(fd, t.view(torch.uint8).numpy(), s.offset, throttle)
            tensors[s.name] = t
    return tensors, None


def load_st_mmap_touch(paths: Paths, specs: list[TensorSpec], throttle: Throttle | None, dests: Tensors | None) -> Loaded:
    """Reference: load_file's mmap with one byte of every page read. Page cache, not private memory."""
    tensors = safetensors.torch.load_file(paths["safetensors"])
    for t in tensors.values():
        int(t.reshape(-1).view(torch.uint8).numpy()[::PAGE].sum())
    return tensors, None


@dataclass(frozen=True)
class Method:
    name: str
    artefact: str
    load: Loader
    regimes: tuple[str, ...]
    dests: tuple[str, ...]  # "own": the method allocates; else "fresh" and/or "prefaulted" caller tensors


_ALL, _UNTHROTTLED = REGIMES, ("warm", "cold")
METHODS = (
    Method("tar.xz", "tar.xz", load_tar_xz, _ALL, ("own",)),
    Method("zst-whole", "zst", load_zst_whole, _ALL, ("own",)),
    Method("zqs-bytegroup", "zqs-bytegroup", _load_zqs("zqs-bytegroup"), _ALL, ("fresh", "prefaulted")),
    Method("zqs-zstd", "zqs-zstd", _load_zqs("zqs-zstd"), _ALL, ("fresh", "prefaulted")),
    Method("zqs-raw", "zqs-raw", _load_zqs("zqs-raw"), _ALL, ("fresh", "prefaulted")),
    # A trusted local copy may skip the crc32 (docs/zqs-format.md); safetensors checks nothing either.
    Method("zqs-raw-nocrc", "zqs-raw", _load_zqs("zqs-raw", verify=False), ("warm",), ("fresh", "prefaulted")),
    Method("st-pread", "safetensors", load_st_pread, _UNTHROTTLED, ("own",)),
    # Throttling cannot reach inside safetensors' Rust reads (or an mmap's page faults); the
    # emulation stands for the uncompressed file there, and is checked against st-pread when warm.
    Method("st-pread-emul", "safetensors", load_st_pread_emulated, ("warm", *RATES), ("own",)),
    Method("st-mmap-copy", "safetensors", load_st_mmap_copy, _UNTHROTTLED, ("fresh", "prefaulted")),
    Method("st-mmap-touch", "safetensors", load_st_mmap_touch, _UNTHROTTLED, ("mapped",)),
)
BY_NAME = {m.name: m for m in METHODS}


def empty_tensors(specs: list[TensorSpec]) -> Tensors:
    return {s.name: torch.empty(s.shape, dtype=s.dtype) for s in specs}


def prefaulted_tensors(specs: list[TensorSpec]) -> Tensors:
    tensors = empty_tensors(specs)
    for t in tensors.values():
        t.view(torch.uint8).fill_(0)
    return tensors
