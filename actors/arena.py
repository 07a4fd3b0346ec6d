"""Model parameters on 2 MB pages: one arena per model, each parameter a view into it.

Decoding streams every weight once per token; on 4 KB pages that walk costs a TLB miss
every 4 KB, which on a virtualised host (nested page tables) is slow: in
benchmarks/results/runtime.md transformers decodes `small` 1.6x (bf16) and 1.9x (fp32)
slower from its mmapped 4 KB pages than from 2 MB pages like these (its "as loaded" and
"control" rows: the same code, the weights in other memory).
"""

from __future__ import annotations

from torch import nn

from actors.heap import huge_page_arena

_PARAM_ALIGN = 4096


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
