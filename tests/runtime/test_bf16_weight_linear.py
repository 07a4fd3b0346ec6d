"""The AVX2 kernel for fp32 models over bf16 weights (actors/bf16_weight_linear.py): the widened weight's
products up to fp32 summation order, for any row count (tiles of 1 to 6 rows, prompt chunks of many),
any output count, with and without a bias; the layout as documented; only weights of bf16 values packed; a
tied table's rows read back bit for bit; a widened bf16 model packed by `auto` decodes the plain fp32 model's
greedy tokens in batches whose rows join and leave, in half the weight memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors import bf16_linear, bf16_weight_linear, cpu_kernels
from actors.checkpoint import load_hf_checkpoint
from actors.layers import Linear
from actors.packed_weights import pack
from tests.runtime.test_batch_engine import join_and_leave_tokens
from tests.runtime.test_decode_attention_f32 import widened_model
from weights_tool.synth import synthesize

pytestmark = pytest.mark.skipif(cpu_kernels.avx2_extension() is None,
                                reason="no AVX2 kernels here: the CPU lacks AVX2/FMA, has AVX512-BF16, or no build")


def _bf16_values(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16).float()  # fp32 holding bf16 values, as a widened bf16 file


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 15, 16, 33, 130])
@pytest.mark.parametrize("out_features,in_features", [(160, 96), (17, 34), (576, 1536), (300, 64)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_the_products_are_the_widened_weights_up_to_summation_order(rows, out_features, in_features, has_bias):
    torch.manual_seed(rows * out_features)
    w = _bf16_values(out_features, in_features)
    bias = torch.randn(out_features) if has_bias else None
    x = torch.randn(1, rows, in_features)  # [1, T, hidden], as forward_rows feeds it
    got = bf16_weight_linear.linear(x, bf16_weight_linear.pack(w), out_features, bias)
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert got.shape == (1, rows, out_features) and got.dtype == torch.float32
    # fp32 sums of unit-scale products: F.linear's own fp32 output is held to the same bound.
    for y in (got, F.linear(x, w, bias)):
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-4 * in_features ** 0.5)


def test_a_non_contiguous_input_gives_the_same_products():
    w = _bf16_values(48, 64)
    x = torch.randn(5, 128)[:, ::2]  # [5, 64], stride 2
    packed = bf16_weight_linear.pack(w)
    assert torch.equal(bf16_weight_linear.linear(x, packed, 48), bf16_weight_linear.linear(x.contiguous(), packed, 48))


def test_the_layout_holds_each_input_features_16_columns_in_the_unpacks_order():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)  # small integers: exact in bf16
    packed = bf16_weight_linear.pack(w)
    assert packed.shape == (2, 3, 16) and packed.dtype == torch.int16  # 20 columns padded to 32
    values = (packed.to(torch.int32) << 16).view(torch.float32)  # [N/16, K, 16]
    for n in range(32):
        position = bf16_weight_linear.LANE_ORDER.index(n % 16)
        for k in range(3):
            assert values[n // 16, k, position] == (w[n, k] if n < 20 else 0)


def test_only_weights_of_bf16_values_are_packed_and_others_refused_by_name():
    assert bf16_weight_linear.is_packable(_bf16_values(4, 4))
    assert not bf16_weight_linear.is_packable(torch.randn(4, 4))  # fp32 values: narrowing would round them
    assert not bf16_weight_linear.is_packable(torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 values"):
        bf16_weight_linear.pack(torch.randn(4, 4))


@pytest.mark.parametrize("rows", [1, 2, 5, 64])
def test_the_kernel_splits_over_torchs_threads_and_a_rows_outputs_do_not_depend_on_the_others(rows):
    # Each output is summed over k in one order, one FMA at a time, whatever the tile or the thread that takes its
    # column block: the same bits on one thread or two, and a row's outputs the same alone as in a batch.
    assert cpu_kernels.avx2_extension().is_parallel()
    w = _bf16_values(1536, 576)
    x = torch.randn(rows, 576)
    packed, threads = bf16_weight_linear.pack(w), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = bf16_weight_linear.linear(x, packed, 1536)
        torch.set_num_threads(2)
        assert torch.equal(bf16_weight_linear.linear(x, packed, 1536), alone)
    finally:
        torch.set_num_threads(threads)
    for r in range(rows):
        assert torch.equal(bf16_weight_linear.linear(x[r: r + 1], packed, 1536), alone[r: r + 1])


def test_joined_projections_give_each_members_bits():
    torch.manual_seed(5)
    ws = [_bf16_values(n, 96) for n in (64, 32, 32)]
    biases = [torch.randn(n) for n in (64, 32, 32)]
    x = torch.randn(3, 96)
    fused = bf16_linear.fuse([bf16_weight_linear.pack(w) for w in ws], [64, 32, 32], biases, bf16_weight_linear.linear)
    for got, w, b in zip(fused(x), ws, biases, strict=True):
        assert torch.equal(got, bf16_weight_linear.linear(x, bf16_weight_linear.pack(w), w.shape[0], b))


@pytest.mark.parametrize("tied", [True, False])
def test_a_widened_bf16_model_packed_by_auto_decodes_the_plain_fp32_models_tokens(tmp_path, tied):
    model, tokenizer = widened_model(tmp_path, "tiny", tie_word_embeddings=tied)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    table = model.model.embed_tokens.weight.detach().clone()
    plain = join_and_leave_tokens(model, tokenizer)
    plain_bytes = sum(m.weight.nbytes for m in linears) + (table.nbytes if tied else 0)
    packed = pack(model)
    assert packed.kernel == "bf16_weights" and (packed.head is not None) == tied  # a tied head packed too
    assert packed.nbytes_packed() <= plain_bytes // 2 + 16 * 4 * sum(m.in_features for m in linears)  # N padded
    packed.install()
    assert all(m.weight.numel() == 0 for m in linears)
    assert join_and_leave_tokens(model, tokenizer) == plain
    assert min(len(t) for t in plain) >= 32 and len({t for row in plain for t in row}) > 4
    if tied:  # the embedding rows read back from the packed head, bit for bit
        every = torch.arange(model.config.vocab_size).view(4, -1)
        assert torch.equal(model.embed(every).view(-1, table.shape[1]), table)


def test_an_fp32_file_stays_plain(tmp_path):
    path = synthesize("tiny", tmp_path, dtype="float32", seed=3)
    model, _ = load_hf_checkpoint(path)
    assert pack(model).kernel != "bf16_weights"  # its values are not bf16: narrowing would change the model
