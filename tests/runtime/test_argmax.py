"""Greedy sampling's argmax kernel (csrc/argmax.cpp through actors/sampling.py's `greedy`): torch's argmax for
every row, the first index on a tie, masked (-inf) logits never picked, rows of any width."""

from __future__ import annotations

import pytest
import torch

from actors import cpu_kernels
from actors.sampling import greedy

pytestmark = pytest.mark.skipif(not cpu_kernels.is_available(),
                                reason="no AVX512-BF16 on this CPU, or the kernels could not be built")


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 100, 32000, 49152])
def test_the_kernel_picks_torchs_argmax_for_every_row(vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(7, vocab)
    logits[1] = 3.0  # every logit equal: the first
    logits[2, vocab // 2:] = 50.0  # a tie at the top: the first of the tied
    logits[3] = float("-inf")  # every token masked: token 0, as torch
    logits[4, -1] = 1e9  # the last lane of a partial block
    logits[5, : vocab - 1] = float("-inf")  # all but the last masked
    assert torch.equal(cpu_kernels.extension().argmax_rows(logits), logits.argmax(-1))


def test_greedy_takes_the_kernel_where_it_is_loaded_and_torch_elsewhere():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    assert cpu_kernels.extension() is not None and cpu_kernels.loaded() is not None
    assert torch.equal(greedy(logits), logits.argmax(-1))
    strided = logits[:, ::2]  # not contiguous: torch's argmax
    assert torch.equal(greedy(strided), strided.argmax(-1))
    assert torch.equal(greedy(logits.double()), logits.argmax(-1))


def test_bad_logits_are_refused_by_name():
    ext = cpu_kernels.extension()
    for bad in (torch.randn(3), torch.randn(2, 4).double(), torch.randn(2, 0)):
        with pytest.raises(RuntimeError, match="logits: contiguous fp32"):
            ext.argmax_rows(bad)
