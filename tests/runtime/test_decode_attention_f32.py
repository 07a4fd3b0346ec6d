"""Batched decode attention for fp32 models on AVX2 CPUs (csrc/decode_attention_f32.cpp through
actors/attention.py): every decoding row of an fp32 batch attends in one call per layer; the same logits as the
rows one by one through SDPA, to fp32 summation order, for GQA, sliding-window and QK-norm models, with prompt
chunks in the same step; through the joined projection with RoPE in the kernel too; the kernel within fp32
rounding of the exact attention; an fp32 batch whose rows join and leave decodes each request's tokens alone."""

from __future__ import annotations

import pytest
import torch

from actors import cpu_kernels
from actors.attention import Attention, batch_decode_attention
from actors.checkpoint import load_hf_checkpoint
from actors.packed_weights import pack
from actors.tokenizer import Tokenizer
from tests.runtime.test_batch_engine import alone_and_batched
from tests.runtime.test_decode_attention import _joined, _rows_step
from weights_tool.synth import preset_config, synthesize

pytestmark = pytest.mark.skipif(cpu_kernels.avx2_extension() is None,
                                reason="no AVX2 kernels here: the CPU lacks AVX2/FMA, has AVX512-BF16, or no build")


def widened_model(tmp_path, preset: str, **overrides):
    """A tiny random bf16 model computed in fp32, as on a CPU without bf16 arithmetic; greedy tokens varied."""
    cfg = preset_config(preset) | overrides
    path = synthesize(cfg, tmp_path / preset, dtype="bfloat16", seed=3)
    model, config = load_hf_checkpoint(path)
    torch.manual_seed(0)
    model.init_weights(std=0.15)
    model.to(torch.bfloat16)
    model.to(torch.float32)  # bf16 values, widened: what the AVX2 kernels pack
    return model, Tokenizer.from_dir(path, eos_token_ids=config.eos_token_ids)


@pytest.mark.parametrize("preset, overrides", [
    ("tiny", {}),  # GQA: 4 query heads on 2 KV heads, head_dim 16
    ("tiny-mistral", {"sliding_window": 8}),  # rows past the window read only its last 8 keys
    ("tiny-qwen3", {}),  # QK-norm, head_dim 32
])
def test_batched_decode_attention_gives_the_row_by_row_logits(tmp_path, preset, overrides):
    model, _ = widened_model(tmp_path, preset, **overrides)
    assert cpu_kernels.avx2_loaded() is not None
    lengths = [1, 5, 17, 40, 9]
    for chunks in ({}, {2: 6}):  # every row decodes; or row 2 feeds a 6-token prompt chunk in the same step
        batch_decode_attention(model)
        batched = _rows_step(model, lengths, chunks)
        batch_decode_attention(model, False)
        row_by_row = _rows_step(model, lengths, chunks)
        torch.testing.assert_close(batched, row_by_row, rtol=1e-4, atol=1e-4)  # fp32: summation order only
        assert torch.equal(batched.argmax(-1), row_by_row.argmax(-1))


@pytest.mark.parametrize("preset, overrides", [("tiny", {}), ("tiny-mistral", {"sliding_window": 8})])
def test_a_step_of_decoding_rows_through_the_joined_projection_and_the_kernels_rope_gives_the_same_logits(
        tmp_path, preset, overrides):
    model, _ = widened_model(tmp_path, preset, **overrides)
    packed = pack(model)
    assert packed.kernel == "bf16_weights"
    packed.install()
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    assert all(a.fused_in is not None and a.is_decode_batched for a in attentions)
    lengths = [1, 5, 17, 40, 9]
    joined = _rows_step(model, lengths, {})
    for a in attentions:
        a.fused_in = None  # RoPE in torch then, and the separate projections (views of the joined packs)
    separate = _rows_step(model, lengths, {})
    torch.testing.assert_close(joined, separate, rtol=1e-4, atol=1e-4)  # RoPE's products rounded in another order


def test_the_kernel_caches_each_rows_new_key_and_attends_within_fp32_rounding_of_the_exact_sum():
    torch.manual_seed(0)
    ext = cpu_kernels.avx2_extension()
    for d, h, h_kv in ((16, 4, 2), (64, 9, 3), (72, 2, 1), (128, 8, 8)):
        lengths = [1, 5, 17, 40, 300]
        q = torch.randn(len(lengths), h, d)
        k_new, v_new = (torch.randn(len(lengths), h_kv, d) for _ in range(2))
        k_caches = [torch.randn(1, h_kv, n + 3, d) for n in lengths]
        v_caches = [torch.randn(1, h_kv, n + 3, d) for n in lengths]
        before = [(k.clone(), v.clone()) for k, v in zip(k_caches, v_caches, strict=True)]
        pos = [n - 1 for n in lengths]
        start = [0, 0, pos[2] - 7, 0, 0]  # row 2: a window of its last 8 positions
        out = ext.decode_attention_f32(_joined(q, k_new, v_new), h, h_kv, k_caches, v_caches, pos, start)
        for r, (k0, v0) in enumerate(before):
            k0[0, :, pos[r]], v0[0, :, pos[r]] = k_new[r], v_new[r]
            assert torch.equal(k_caches[r], k0) and torch.equal(v_caches[r], v0)  # only position pos[r] written
            keys, values = (c[0, :, start[r]: pos[r] + 1].double() for c in (k0, v0))  # [H_kv, T, D]
            queries = q[r].double().view(h_kv, h // h_kv, d)
            exact = torch.softmax(queries @ keys.transpose(1, 2) / d ** 0.5, -1) @ values
            torch.testing.assert_close(out[r].double(), exact.reshape(h, d), rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused_by_name():
    ext = cpu_kernels.avx2_extension()
    caches = [torch.zeros(1, 1, 4, 8)]
    with pytest.raises(RuntimeError, match="positions outside the cache"):
        ext.decode_attention_f32(torch.zeros(1, 24), 1, 1, caches, [torch.zeros(1, 1, 4, 8)], [4], [0])
    with pytest.raises(RuntimeError, match="fp32"):
        ext.decode_attention_f32(torch.zeros(1, 24, dtype=torch.bfloat16), 1, 1, caches, caches, [0], [0])


def test_an_fp32_batch_whose_rows_join_and_leave_decodes_each_requests_tokens_alone(tmp_path):
    # The linear kernel sums every output in one order for any row count, and attention is per row: batching
    # changes no token.
    model, tokenizer = widened_model(tmp_path, "tiny")
    pack(model).install()
    assert all(layer.self_attn.is_decode_batched for layer in model.model.layers)
    alone, batched = alone_and_batched(model, tokenizer)
    assert batched == alone
    assert min(len(t) for t in alone) >= 32 and len({t for row in alone for t in row}) > 4
