"""Model parameters on 2 MB pages: one arena per model, each parameter a view into it.

Decoding streams every weight once per token; on 4 KB pages that walk costs a TLB miss
every 4 KB, which on a virtualised host (nested page tables) is slow: in
benchmarks/results/runtime.md transformers decodes `small` 1.6x (bf16) and 1.9x (fp32)
slower from its mmapped 4 KB pages than from 2 MB pages like these (its "as loaded" and
"control" rows: the same code, the weights in other memory).
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

_HUGE_PAGE = 2 << 20
_PARAM_ALIGN = 4096


def huge_page_arena(nbytes: int) -> torch.Tensor:
    """nbytes of CPU memory, 2 MB aligned, advised to be backed by transparent huge pages.

    A private anonymous mmap (a shared one would be shmem, which THP skips): nothing
    is resident until written. Where the kernel has no transparent huge pages the
    advice is a no-op and ordinary pages are used.
    """
    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(buf, dtype=torch.uint8)  # keeps buf alive
    skip = -arena.data_ptr() % _HUGE_PAGE
    return arena[skip : skip + nbytes]


def move_parameters_to_huge_pages(module: nn.Module) -> None:
    """Re-home every (still unwritten) parameter of `module` in one huge-page arena.

    Each parameter stays its own tensor (a view), so loaders and load_state_dict still
    write it in place. The first, never-touched allocations are freed without having
    become resident.
    """
    params = [(m, name, p) for m in module.modules() for name, p in m._parameters.items() if p is not None]
    sizes = [-(-p.nbytes // _PARAM_ALIGN) * _PARAM_ALIGN for _, _, p in params]
    arena = huge_page_arena(sum(sizes))
    offset = 0
    for (m, name, p), size in zip(params, sizes, strict=True):
        view = arena[offset : offset + p.nbytes].view(p.dtype).view(p.shape)
        m._parameters[name] = nn.Parameter(view, requires_grad=False)
        offset += size
