"""The files the loader benchmark loads, one set per shape: where they are, and how each is built.

`benchmarks.bench_loader` builds them before it measures; the report reads their sizes
(`benchmarks.loader_cells`) and names how the archives were made. Every file is written
atomically and cached, so a later run reuses it.
"""

from __future__ import annotations

import logging
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zstandard

from benchmarks.loader_methods import DTYPE, NUM_THREADS
from weights_tool.pack import pack
from weights_tool.synth import synthesize

log = logging.getLogger("bench_loader")

XZ_PRESET = 0  # xz is ~9 MB/s at preset 0 on this machine; the archive is built once and cached
ZST_LEVEL = 3  # zstd's own default, what a whole-file `zstd model.safetensors` writes


def artefact_paths(shape: str, cache: Path) -> dict[str, Path]:
    stem = cache / f"{shape}-{DTYPE}"
    return {
        "safetensors": stem / "model.safetensors",
        "tar.xz": cache / f"{shape}-{DTYPE}.tar.xz",
        "zst": cache / f"{shape}-{DTYPE}.safetensors.zst",
        "zqs-bytegroup": cache / f"{shape}-{DTYPE}.bytegroup.zqs",
        "zqs-zstd": cache / f"{shape}-{DTYPE}.zstd.zqs",
        "zqs-raw": cache / f"{shape}-{DTYPE}.raw.zqs",
    }


def build_artefacts(shape: str, cache: Path) -> dict[str, float]:
    """Synthesise and pack what is missing (each written atomically); returns seconds spent per artefact."""
    paths = artefact_paths(shape, cache)
    hf_dir = paths["safetensors"].parent
    st = paths["safetensors"]
    makers: dict[str, Callable[[Path], Any]] = {
        "safetensors": lambda _: synthesize(shape, hf_dir, dtype=DTYPE),
        "tar.xz": lambda out: _write_tar_xz(st, out),
        "zst": lambda out: _write_zst(st, out),
        # Every group compressed, embeddings included: the ratio goal is about compression.
        "zqs-bytegroup": lambda out: pack(hf_dir, out, raw_embeddings=False),
        "zqs-zstd": lambda out: pack(hf_dir, out, byte_group=False, raw_embeddings=False),
        "zqs-raw": lambda out: pack(hf_dir, out, codec="raw"),
    }
    spent = {}
    for name, make in makers.items():
        done = (hf_dir / "config.json").is_file() if name == "safetensors" else paths[name].is_file()
        if done:
            continue
        log.info("building %s for %s (cached under %s afterwards)", name, shape, cache)
        t0 = time.perf_counter()
        if name == "safetensors":
            make(hf_dir)
        else:
            tmp = paths[name].with_name(f".{paths[name].name}.tmp")
            make(tmp)
            tmp.replace(paths[name])
        spent[name] = time.perf_counter() - t0
    return spent


def _write_tar_xz(src: Path, out: Path) -> None:
    with tarfile.open(out, "w:xz", preset=XZ_PRESET) as tar:
        tar.add(src, arcname=src.name)


def _write_zst(src: Path, out: Path) -> None:
    cctx = zstandard.ZstdCompressor(level=ZST_LEVEL, threads=NUM_THREADS, write_content_size=True)
    with open(src, "rb") as fin, open(out, "wb") as fout:
        cctx.copy_stream(fin, fout, size=src.stat().st_size)
