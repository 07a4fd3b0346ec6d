"""The MLP's activation kernel (csrc/silu_mul.cpp through actors/layers.py): silu(gate) * up of bf16 rows in one
pass, with torch's bits for F.silu(gate, inplace=True).mul_(up), the ops it replaced in MLP.forward and the decode
layers' loop, but for products below fp32's normal range, which it flushes to 0."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors import cpu_kernels
from actors.layers import silu_mul

pytestmark = pytest.mark.skipif(not cpu_kernels.is_available(),
                                reason="no AVX512-BF16 on this CPU, or the kernels could not be built")

SMALLEST_NORMAL = torch.finfo(torch.float32).tiny


def _torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.clone().chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


@pytest.mark.parametrize("rows, inter", [(1, 1536), (3, 40), (17, 2048), (64, 8)])
def test_the_kernel_gives_torchs_bits(rows, inter):
    # Scales from activations near 0 to gates far past exp's range either way (silu(g) -> g, and -> -0); features
    # that end within a vector of 16 (40, 8); more rows than one thread takes (17, 64).
    torch.manual_seed(rows * inter)
    for scale in (0.01, 1.0, 4.0, 60.0, 300.0):
        gate_up = (torch.randn(rows, 2 * inter) * scale).to(torch.bfloat16)
        ours, theirs = silu_mul(gate_up), _torch_silu_mul(gate_up)
        assert ours.shape == (rows, inter) and ours.is_contiguous()
        normal = (theirs.float().abs() >= SMALLEST_NORMAL) | (theirs.float() == 0)
        assert torch.equal(ours.view(torch.int16)[normal], theirs.view(torch.int16)[normal])
        assert (ours.float()[~normal] == 0).all()  # a product below the normal range: flushed
        assert normal.float().mean() > 0.99


def test_leading_dimensions_are_kept_and_a_view_is_read_as_its_values():
    torch.manual_seed(0)
    gate_up = torch.randn(2, 5, 64).to(torch.bfloat16)
    out = silu_mul(gate_up)
    assert out.shape == (2, 5, 32)
    assert torch.equal(out, _torch_silu_mul(gate_up))
    strided = torch.randn(64, 7).to(torch.bfloat16).t()  # [7, 64], not contiguous
    assert torch.equal(silu_mul(strided), _torch_silu_mul(strided.contiguous()))


def test_bad_input_is_refused_by_name():
    ext = cpu_kernels.extension()
    with pytest.raises(RuntimeError, match="gate_up"):
        ext.silu_mul(torch.randn(2, 6))  # fp32
    with pytest.raises(RuntimeError, match="gate_up"):
        ext.silu_mul(torch.randn(2, 5).to(torch.bfloat16))  # odd width
