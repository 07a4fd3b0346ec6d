"""Linear weights repacked into oneDNN's blocked layout: the same products, faster on a CPU.

A decode step is mostly linear layers (70% of a one-row step, 51% at 8 rows:
benchmarks/results/linear.md), and eager `F.linear` / `torch.mv` on a plain row-major bf16
weight stream it at 3.4-3.9 GB/s here. oneDNN's linear on a weight reordered once into its
blocked layout (`torch.ops.mkldnn`, what inductor's frozen CPU graphs call) runs the same
products without any compile: bitwise equal in bf16, set up in a fraction of a second
(max-autotune's `torch.compile` takes 2 minutes), for any number of rows. On SmolLM2 here
the linear layers ran 1.13x (one row) and 1.26x (8 rows) faster, the whole step 1.03x and
1.22x (benchmarks/results/linear.md; bench_batch's `small` model: batch.md's last table).

Only bf16 is packed: its packed products are bitwise equal to `F.linear`'s, so eager plain
(`actor.is_weight_packed: false`) stays an exact parity reference (one exception: a single
row through a layer with a bias, where the plain path's gemv rounds before it adds the bias
and the packed one rounds once). fp32 packs too and is faster, but accumulates in another
order (differences of ~1e-4).

How an actor uses it, without touching a weight a step may be reading:

    packed = pack(model)        # any thread, once every weight is resident: new tensors only
    packed.install()            # the stepping thread, between steps: swaps and frees the plain

`install` releases each plain weight's pages (they live in the model's huge-page arena,
actors/arena.py), so a packed model holds about the memory of an unpacked one, and swaps in
an empty plain weight so that a stale reader fails loudly instead of reading zeros. A tied
LM head is the embedding table, which lookups read plain: it stays unpacked.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass

import torch
from torch import nn

from actors.heap import glibc
from actors.layers import Linear

log = logging.getLogger(__name__)

# The row count oneDNN lays the weight out for; every count runs with any. 8, a batch's usual
# size: in a sweep by hand (not a committed benchmark) of hints 1, 4, 8, 16 and 32 over
# SmolLM2's linear layers at 1 to 32 rows, no hint was best everywhere and 8 was within this
# machine's noise of the best.
BATCH_HINT = 8


def is_packable(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight, where this torch has oneDNN's linear."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@dataclass
class PackedWeights:
    """Packed copies of a model's linear weights, made but not yet in use."""

    layers: list[tuple[Linear, torch.Tensor]]
    is_installed: bool = False

    def install(self) -> int:
        """Make every layer compute with its packed weight and free the plain one; returns bytes released.

        Call it where no forward is running (an actor's stepping thread, between steps).
        """
        if self.is_installed:
            return 0
        released = 0
        for layer, packed in self.layers:
            plain = layer.weight
            layer.packed_weight = packed
            layer.weight = nn.Parameter(torch.empty(0, dtype=plain.dtype), requires_grad=False)
            released += _release_pages(plain)
        self.is_installed = True
        log.info("packed %d linear weights (%.0f MB); %.0f MB of plain weights released",
                 len(self.layers), self.nbytes_packed() / 1e6, released / 1e6)
        return released

    def nbytes_packed(self) -> int:
        # Packed tensors are opaque; their logical size is the plain one's.
        return sum(p.numel() * p.element_size() for _, p in self.layers)


def pack(model: nn.Module, batch_hint: int = BATCH_HINT) -> PackedWeights:
    """Packed copies of every packable `Linear` of `model` (nothing is changed until `install`)."""
    layers = []
    with torch.inference_mode():
        for module in model.modules():
            if isinstance(module, Linear) and module.packed_weight is None and is_packable(module.weight):
                layers.append((module, torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), batch_hint)))
    return PackedWeights(layers)


def _release_pages(plain: torch.Tensor) -> int:
    """Give the whole pages under `plain` back to the kernel (arena views are page-aligned); bytes released.

    The arena is a private anonymous mapping: a released page reads as zeros if touched
    again, which is why `install` swaps in an empty weight first.
    """
    if plain.untyped_storage().nbytes() <= plain.nbytes:
        return 0  # its own allocation, not an arena view: freed with its last reference
    lib = glibc()
    start = plain.data_ptr()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + plain.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if lib is None or end <= first:
        return 0
    if lib.madvise(first, end - first, mmap.MADV_DONTNEED) != 0:
        return 0
    return end - first
