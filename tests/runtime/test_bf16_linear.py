"""The bf16 linear kernel (actors/bf16_linear.py): F.linear's products up to one rounding, for any row
count and any output count (a partial last block of 16 columns), with and without a bias, a residual added as
torch adds it; the pair layout
exactly as documented; a tied table's rows read back from its pairs bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors import bf16_linear, cpu_kernels
from actors.checkpoint import load_hf_checkpoint
from actors.layers import RMSNorm, fuse_rms_norms
from actors.packed_weights import pack
from weights_tool.synth import preset_config, synthesize

pytestmark = pytest.mark.skipif(not cpu_kernels.is_available(),
                                reason="no AVX512-BF16 on this CPU, or the kernel could not be built")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 33])
@pytest.mark.parametrize("out_features,in_features", [(160, 96), (17, 34), (576, 1536)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_the_products_are_f_linears_up_to_one_rounding(rows, out_features, in_features, has_bias):
    torch.manual_seed(rows * out_features)
    w = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16) if has_bias else None
    x = torch.randn(1, rows, in_features).to(torch.bfloat16)  # [1, T, hidden], as forward_rows feeds it
    got = bf16_linear.linear(x, bf16_linear.pack(w), out_features, bias)
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert got.shape == (1, rows, out_features) and got.dtype == torch.bfloat16
    # Summed in fp32 and rounded to bf16 once: within one bf16 step (2^-7 relative) of the exact sum, plus
    # fp32's own summation error on unit-scale data; F.linear's bf16 output is held to the same bound.
    for y in (got, F.linear(x, w, bias)):
        torch.testing.assert_close(y.double(), exact, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_a_residual_is_added_as_torch_adds_it_to_the_product(rows):
    # The decode layers' `h = x + o_proj(y)` in the kernel's epilogue: the product rounded to bf16, the residual
    # added in fp32 and rounded again, torch's bf16 add of the two; a partial last block of columns (40).
    torch.manual_seed(rows)
    w = torch.randn(40, 64).to(torch.bfloat16)
    bias = torch.randn(40).to(torch.bfloat16)
    x, residual = torch.randn(rows, 64).to(torch.bfloat16), torch.randn(rows, 40).to(torch.bfloat16)
    packed = bf16_linear.pack(w)
    got = cpu_kernels.extension().bf16_linear(x, packed, 40, bias, residual)
    assert torch.equal(got, residual + bf16_linear.linear(x, packed, 40, bias))
    with pytest.raises(RuntimeError, match="residual"):
        cpu_kernels.extension().bf16_linear(x, packed, 40, bias, residual[:, :39].contiguous())


def test_a_non_contiguous_input_gives_the_same_products():
    w = torch.randn(48, 64).to(torch.bfloat16)
    x = torch.randn(5, 128).to(torch.bfloat16)[:, ::2]  # [5, 64], stride 2
    packed = bf16_linear.pack(w)
    assert torch.equal(bf16_linear.linear(x, packed, 48), bf16_linear.linear(x.contiguous(), packed, 48))


def test_the_layout_holds_pairs_of_input_features_for_16_columns():
    w = torch.arange(20 * 6, dtype=torch.float32).view(20, 6).to(torch.bfloat16)  # exact in bf16
    packed = bf16_linear.pack(w)
    assert packed.shape == (2, 3, 16) and packed.dtype == torch.int32  # 20 columns padded to 32
    pairs = packed.view(torch.bfloat16).view(2, 3, 16, 2)  # [N/16, K/2, 16, 2]
    for n in range(32):
        for p in range(3):
            want = w[n, 2 * p: 2 * p + 2] if n < 20 else torch.zeros(2, dtype=torch.bfloat16)
            assert torch.equal(pairs[n // 16, p, n % 16], want)


def test_bad_weights_are_refused_by_name():
    with pytest.raises(ValueError, match="K even"):
        bf16_linear.pack(torch.zeros(4, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        bf16_linear.pack(torch.zeros(4, 4))


def test_a_tied_tables_rows_come_back_from_its_pairs_and_the_plain_table_is_released(tmp_path):
    cfg = preset_config("tiny") | {"tie_word_embeddings": True}
    model, _ = load_hf_checkpoint(synthesize(cfg, tmp_path, dtype="bfloat16", seed=3))
    table = model.model.embed_tokens.weight.detach().clone()  # [V, D]
    tokens = torch.arange(model.config.vocab_size).view(4, -1)
    want = model.embed(tokens)
    x = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    head = F.linear(x, table)
    pack(model).install()
    assert model.packed_head is not None and model.model.embed_tokens.weight.numel() == 0
    assert torch.equal(model.embed(tokens), want) and torch.equal(want.view(-1, table.shape[1]), table)
    torch.testing.assert_close(bf16_linear.linear(x, model.packed_head, model.config.vocab_size).double(),
                               head.double(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_the_kernel_splits_over_torchs_threads_and_gives_the_same_bits(rows):
    # Built with OpenMP, or at::parallel_for runs one thread whatever torch.set_num_threads says; each
    # output block is summed in the same order on whichever thread takes it.
    assert cpu_kernels.extension().is_parallel()
    w = torch.randn(1536, 576).to(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    packed, threads = bf16_linear.pack(w), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = bf16_linear.linear(x, packed, 1536)
        torch.set_num_threads(2)
        assert torch.equal(bf16_linear.linear(x, packed, 1536), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 7, 576), (1, 3, 9, 64), (130, 40), (2, 17)])
def test_the_rms_norm_kernel_rounds_as_hf_does_in_bf16(shape):
    # HF: normalised in fp32, rounded to bf16, scaled by the bf16 weight and rounded again. The kernel sums the
    # squares in another order, so a normalised value may round to the neighbouring bf16 where it sits on a tie.
    torch.manual_seed(len(shape))
    norm = RMSNorm(shape[-1], 1e-5, torch.bfloat16)
    norm.weight.copy_(torch.randn(shape[-1]))
    x = (torch.randn(shape) * 3).to(torch.bfloat16)
    hf = norm(x)
    fuse_rms_norms(norm)
    fused = norm(x)
    assert fused.dtype == torch.bfloat16 and fused.shape == x.shape
    torch.testing.assert_close(fused.float(), hf.float(), rtol=2**-7, atol=0)
    assert (fused == hf).float().mean() > 0.99
    fused_rows = norm(x.transpose(-1, -2).contiguous().transpose(-1, -2))  # not contiguous: torch's ops, the same
    assert torch.equal(fused_rows, hf)


def test_joined_projections_give_each_members_bits_and_are_refused_where_a_block_would_be_padded():
    torch.manual_seed(5)
    ws = [torch.randn(n, 96).to(torch.bfloat16) for n in (64, 32, 32)]
    biases = [torch.randn(n).to(torch.bfloat16) for n in (64, 32, 32)]
    x = torch.randn(3, 96).to(torch.bfloat16)
    fused = bf16_linear.fuse([bf16_linear.pack(w) for w in ws], [64, 32, 32], biases)
    for got, w, b in zip(fused(x), ws, biases, strict=True):
        assert torch.equal(got, bf16_linear.linear(x, bf16_linear.pack(w), w.shape[0], b))
    assert bf16_linear.fuse([bf16_linear.pack(w) for w in ws[:2]], [64, 32], [biases[0], None]) is None
    assert bf16_linear.fuse([bf16_linear.pack(torch.randn(20, 96).to(torch.bfloat16))] * 2, [20, 20], [None, None]) is None
