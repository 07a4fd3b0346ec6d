"""Linear weights repacked for a faster CPU kernel: oneDNN's blocked layout, or bf16_linear.py's pairs.

A decode step is mostly linear layers (70% of a one-row step, 51% at 8 rows:
benchmarks/results/linear.md), and eager `F.linear` / `torch.mv` on a plain row-major bf16
weight stream it at 3.4-3.9 GB/s here. oneDNN's linear on a weight reordered once into its
blocked layout (`torch.ops.mkldnn`, what inductor's frozen CPU graphs call) runs the same
products without any compile: bitwise equal in bf16, set up in a fraction of a second
(max-autotune's `torch.compile` takes 2 minutes), for any number of rows. On SmolLM2 here
the linear layers ran 1.13x (one row) and 1.26x (8 rows) faster, the whole step 1.03x and
1.22x (benchmarks/results/linear.md; bench_batch's `small` model: batch.md's last table).

Only bf16 is packed. Where the CPU has AVX512-BF16, `kernel="auto"` (`actor.packed_kernel`) packs
for actors/bf16_linear.py instead (and, installing, lets decoding rows attend in one call a layer:
attention.py's `batch_decode_attention`, the same extension of actors/cpu_kernels.py): it streams the weights about 2x faster than oneDNN for one or
two rows and no slower for any count (benchmarks/results/bf16_linear.md), its products equal to
`F.linear`'s up to rounding. oneDNN's packed products are bitwise equal to `F.linear`'s (one
exception: a single row through a layer with a bias, where the plain path's gemv rounds before it
adds the bias and the packed one rounds once). Either way eager plain (`actor.is_weight_packed:
false`) is the parity reference. fp32 packs too and is faster, but accumulates in another order
(differences of ~1e-4).

A CPU with AVX2 but no AVX512-BF16 computes a bf16 file in fp32 (compute_dtype.py). There `kernel="auto"` packs
the widened weights back into bf16 for actors/bf16_weight_linear.py (they hold bf16 values, so nothing is lost),
the tied head too: a step reads half the bytes, and a packed model holds half the widened one's weight memory.

How an actor uses it, without touching a weight a step may be reading:

    packed = pack(model)        # any thread, once every weight is resident: new tensors only
    packed.install()            # the stepping thread, between steps: swaps and frees the plain

`install` releases each plain weight's pages (they live in the model's huge-page arena,
actors/arena.py), so a packed model holds about the memory of an unpacked one, and swaps in
an empty plain weight so that a stale reader fails loudly instead of reading zeros. A tied
LM head is the embedding table: for oneDNN it stays plain (lookups read the table, and oneDNN's
layout is opaque); for bf16_linear it is packed too, and lookups read their rows back from the
pairs (`Transformer.embed`), so the plain table is released as well.
"""

from __future__ import annotations

import functools
import logging
import mmap
from dataclasses import dataclass, field

import torch
from torch import nn

from actors import bf16_linear, bf16_weight_linear, cpu_kernels, decode_layers
from actors.actor_config import PACKED_KERNELS
from actors.attention import Attention, batch_decode_attention
from actors.heap import glibc
from actors.layers import Linear, fuse_rms_norms
from actors.model import MLP, Transformer

log = logging.getLogger(__name__)

# The row count oneDNN lays the weight out for; every count runs with any. 8, a batch's usual
# size: in a sweep by hand (not a committed benchmark) of hints 1, 4, 8, 16 and 32 over
# SmolLM2's linear layers at 1 to 32 rows, no hint was best everywhere and 8 was within this
# machine's noise of the best.
BATCH_HINT = 8
# The actors' own kernels by name, each the module of its layout (`pack`, `is_packable`, `linear`, `rows_of`).
LAYOUTS = {"bf16_linear": bf16_linear, "bf16_weights": bf16_weight_linear}


def is_packable(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight, where this torch has oneDNN's linear and this CPU runs its bf16 path."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and _has_onednn_bf16())


@functools.cache
def _has_onednn_bf16() -> bool:
    """oneDNN's bf16 linear needs AVX-NE-CONVERT or AVX512 (BW, VL, DQ); on an AVX2-only CPU its reorder raises
    ("bf16 path needs the cpu support ..."), so packing is asked once, on a tiny weight, before any model is."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), BATCH_HINT)
    except RuntimeError:
        return False
    return True


@dataclass
class PackedWeights:
    """Packed copies of a model's linear weights, made but not yet in use."""

    layers: list[tuple[Linear, torch.Tensor]]
    kernel: str = "onednn"  # which kernel the packed weights are laid out for: "onednn", "bf16_linear", "bf16_weights"
    model: nn.Module | None = None  # what was packed
    head: torch.Tensor | None = None  # a Transformer `model`'s tied head and embedding table, for either own kernel
    fused: list[tuple[nn.Module, bf16_linear.Fused]] = field(default_factory=list)  # Attention / MLP: q,k,v; gate,up
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
            layer.packed_weight, layer.packed_kernel = packed, self.kernel
            layer.weight = nn.Parameter(torch.empty(0, dtype=plain.dtype), requires_grad=False)
            released += _release_pages(plain)
        for owner, fused in self.fused:  # its members' packed weights are views of it: no more memory
            owner.fused_in = fused
        if self.kernel in LAYOUTS and self.model is not None:  # the same extension: decoding rows attend
            batch_decode_attention(self.model)  # in one call a layer, and RMSNorms normalise in one pass
            fuse_rms_norms(self.model)
        if self.head is not None:
            table = self.model.model.embed_tokens
            plain = table.weight
            self.model.packed_head, self.model.packed_head_layout = self.head, LAYOUTS[self.kernel]  # lookups, head
            table.weight = nn.Parameter(torch.empty(0, dtype=plain.dtype, device=plain.device), requires_grad=False)
            released += _release_pages(plain)
        if isinstance(self.model, Transformer):  # None unless every layer is packed for one of our kernels
            self.model.decode_layers = decode_layers.build(self.model)
        self.is_installed = True
        log.info("packed %d linear weights for %s (%.0f MB); %.0f MB of plain weights released",
                 len(self.layers), self.kernel, self.nbytes_packed() / 1e6, released / 1e6)
        return released

    def nbytes_packed(self) -> int:
        # oneDNN's packed tensors are opaque; their logical size is the plain one's (a pair-packed one pads N to 16).
        head = [] if self.head is None else [self.head]
        return sum(p.numel() * p.element_size() for p in [p for _, p in self.layers] + head)


def pack(model: nn.Module, batch_hint: int = BATCH_HINT, kernel: str = "auto") -> PackedWeights:
    """Packed copies of every packable `Linear` of `model` (nothing is changed until `install`), for `kernel`
    (PACKED_KERNELS). "auto" builds or loads the actors' own kernels where the CPU runs them: bf16_linear.py's for
    bf16 weights on AVX512-BF16, bf16_weight_linear.py's for fp32 weights of bf16 values on AVX2. Call it off the
    stepping thread."""
    if kernel not in PACKED_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(PACKED_KERNELS)}, got {kernel!r}")
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.packed_weight is None]
    if kernel == "auto" and _is_bf16_weights(linears):
        return _pack_own(model, linears, "bf16_weights")
    modules = [m for m in linears if is_packable(m.weight)]
    if (kernel == "auto" and bool(modules) and all(bf16_linear.is_packable(m.weight) for m in modules)
            and cpu_kernels.is_available()):
        return _pack_own(model, modules, "bf16_linear")
    with torch.inference_mode():
        layers = [(m, torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), batch_hint)) for m in modules]
    return PackedWeights(layers, "onednn", model)


def _is_bf16_weights(modules: list[Linear]) -> bool:
    """fp32 linear weights that all hold bf16 values (a widened bf16 file), where the AVX2 kernel runs."""
    return (bool(modules) and cpu_kernels.is_avx2_supported()
            and all(bf16_weight_linear.is_packable(m.weight) for m in modules)
            and cpu_kernels.avx2_extension() is not None)


def _pack_own(model: nn.Module, modules: list[Linear], kernel: str) -> PackedWeights:
    """`modules` packed for one of the actors' own kernels (LAYOUTS), q, k, v and gate, up joined, and a tied
    Transformer head packed too."""
    layout = LAYOUTS[kernel]
    with torch.inference_mode():
        layers = [(m, layout.pack(m.weight.detach())) for m in modules]
        fused = _fuse(model, layers, layout)
        head = None
        if (isinstance(model, Transformer) and model.lm_head is None and model.packed_head is None
                and layout.is_packable(model.model.embed_tokens.weight)):
            head = layout.pack(model.model.embed_tokens.weight.detach())
    return PackedWeights(layers, kernel, model, head, fused)


def _fuse(model: nn.Module, layers: list[tuple[Linear, torch.Tensor]], layout) -> list[tuple[nn.Module, bf16_linear.Fused]]:
    """Join each Attention's q, k, v and each MLP's gate, up packs (bf16_linear.fuse, for `layout`'s kernel); every
    member's entry in `layers` becomes a view of its group's tensor, so a member computing alone reads the same
    memory."""
    index = {id(module): i for i, (module, _) in enumerate(layers)}
    groups = []
    for owner in model.modules():
        if isinstance(owner, Attention):
            members = (owner.q_proj, owner.k_proj, owner.v_proj)
        elif isinstance(owner, MLP):
            members = (owner.gate_proj, owner.up_proj)
        else:
            continue
        if not all(id(m) in index for m in members):
            continue
        fused = bf16_linear.fuse([layers[index[id(m)]][1] for m in members], [m.out_features for m in members],
                                 [m.bias for m in members], layout.linear)
        if fused is None:
            continue
        begin = 0
        for m in members:  # blocks of 16 columns: a member's are rows [begin, begin + N/16) of the join
            blocks = m.out_features // bf16_linear.COLUMNS
            layers[index[id(m)]] = (m, fused.packed[begin: begin + blocks])
            begin += blocks
        groups.append((owner, fused))
    return groups


def packed_kernel_of(model: nn.Module) -> str | None:
    """The kernel `model`'s packed weights run on ("onednn", "bf16_linear", "bf16_weights"); None while none is."""
    return next((m.packed_kernel for m in model.modules() if isinstance(m, Linear) and m.packed_weight is not None),
                None)


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
