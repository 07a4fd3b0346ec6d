"""The loader report's figures: the runs of one (shape, regime, method, destination), and a shape's sizes.

`benchmarks.loader_report` builds them from a run's results; `benchmarks.loader_goals`
judges them. Both import them from here.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.loader_artefacts import artefact_paths
from benchmarks.loader_methods import safetensors_specs


@dataclass(frozen=True)
class Cell:
    """The runs of one (shape, regime, method, destination)."""

    runs: tuple[dict[str, Any], ...]

    @property
    def seconds(self) -> float:
        return statistics.median(r["seconds"] for r in self.runs)

    @property
    def best(self) -> float:
        """The fastest run: the figure least disturbed by other jobs on the machine."""
        return min(r["seconds"] for r in self.runs)

    @property
    def best_first_layer_s(self) -> float | None:
        firsts = [r["first_layer_s"] for r in self.runs if r["first_layer_s"] is not None]
        return min(firsts) if firsts else None

    @property
    def cpu_s(self) -> float:
        return statistics.median(r["cpu_s"] for r in self.runs)

    @property
    def first_layer_s(self) -> float | None:
        firsts = [r["first_layer_s"] for r in self.runs if r["first_layer_s"] is not None]
        return statistics.median(firsts) if firsts else None

    @property
    def peak_rss(self) -> int:
        return max(r["peak_rss"] for r in self.runs)

    @property
    def extra(self) -> int:
        """Peak RSS beyond the RSS before the load and the destination bytes the load allocated."""
        return max(r["peak_rss"] - r["rss_before"] - r["fresh_dest_bytes"] for r in self.runs)

    def spread(self) -> str:
        times = [r["seconds"] for r in self.runs]
        return f"{min(times):.3f}–{max(times):.3f}" if len(times) > 1 else "—"


Cells = dict[tuple[str, str, str, str], Cell]  # (shape, regime, method, destination) -> runs


@dataclass(frozen=True)
class ShapeInfo:
    name: str
    num_params: int
    model_bytes: int
    num_layers: int
    layer_bytes: int
    embed_bytes: int
    files: dict[str, int]  # artefact -> bytes

    def ratio(self, artefact: str) -> float:
        return self.model_bytes / self.files[artefact]


def shape_info(shape: str, cache: Path) -> ShapeInfo:
    paths = artefact_paths(shape, cache)
    specs = safetensors_specs(paths["safetensors"])
    num_layers = 1 + max(int(s.name.split(".")[2]) for s in specs if ".layers." in s.name)
    return ShapeInfo(
        shape, sum(s.size // s.dtype.itemsize for s in specs), sum(s.size for s in specs), num_layers,
        sum(s.size for s in specs if ".layers.0." in s.name), sum(s.size for s in specs if "embed_tokens" in s.name),
        {k: p.stat().st_size for k, p in paths.items()},
    )
