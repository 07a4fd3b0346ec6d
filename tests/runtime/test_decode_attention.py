"""Batched decode attention (csrc/decode_attention.cpp through actors/attention.py): every decoding row of a
bf16 batch attends in one call per layer; the same logits as the rows one by one through SDPA, to bf16
rounding, for GQA, sliding-window and QK-norm models, with prompt chunks in the same step; the kernel within
one rounding of the exact attention, and no further from it than SDPA's bf16 path (which is the further); a
bf16 batch whose rows join and leave decodes each request's tokens alone."""

from __future__ import annotations

import pytest
import torch

from actors import cpu_kernels
from actors.attention import Attention, batch_decode_attention
from actors.checkpoint import load_hf_checkpoint
from actors.model import RowInput
from actors.packed_weights import pack
from actors.tokenizer import Tokenizer
from tests.runtime.test_batch_engine import alone_and_batched
from weights_tool.synth import preset_config, synthesize

pytestmark = pytest.mark.skipif(not cpu_kernels.is_available(),
                                reason="no AVX512-BF16 on this CPU, or the kernels could not be built")


def _model(tmp_path, preset: str, dtype: str = "bfloat16", **overrides):
    cfg = preset_config(preset) | overrides
    path = synthesize(cfg, tmp_path / preset, dtype=dtype, seed=3)
    model, config = load_hf_checkpoint(path)
    torch.manual_seed(0)
    model.init_weights(std=0.15)  # wide enough that greedy tokens vary
    return model, Tokenizer.from_dir(path, eos_token_ids=config.eos_token_ids)


def _joined(q, k_new, v_new):
    """q [R, H, D], k_new and v_new [R, H_kv, D] -> the kernel's qkv [R, (H + 2 H_kv) D]."""
    return torch.cat([t.reshape(t.shape[0], -1) for t in (q, k_new, v_new)], dim=1)


def _rows_step(model, lengths: list[int], chunk_rows: dict[int, int], is_int8: bool = False):
    """One forward_rows step over rows with `lengths` tokens cached (and `chunk_rows[i]` prompt tokens fed for
    row i instead of one), after filling each cache the same way (8-bit caches where `is_int8`); logits [R, V]."""
    torch.manual_seed(1)
    rows, tokens = [], []
    for i, n in enumerate(lengths):
        caches = model.new_row_cache(n + 16, is_int8=is_int8)
        prompt = torch.randint(0, model.config.vocab_size, (n,))
        model.forward_rows(prompt, [RowInput(caches, 0, n, needs_logits=False)])  # fill the cache
        fed = chunk_rows.get(i, 1)
        rows.append(RowInput(caches, n, fed))
        tokens.append(torch.randint(0, model.config.vocab_size, (fed,)))
    return model.forward_rows(torch.cat(tokens), rows)


@pytest.mark.parametrize("preset, overrides", [
    ("tiny", {}),  # GQA: 4 query heads on 2 KV heads, head_dim 16
    ("tiny-mistral", {"sliding_window": 8}),  # rows past the window read only its last 8 keys
    ("tiny-qwen3", {}),  # QK-norm, head_dim 32
])
def test_batched_decode_attention_gives_the_row_by_row_logits(tmp_path, preset, overrides):
    model, _ = _model(tmp_path, preset, **overrides)
    assert cpu_kernels.extension() is not None and cpu_kernels.loaded() is not None
    lengths = [1, 5, 17, 40, 9]
    for chunks in ({}, {2: 6}):  # every row decodes; or row 2 feeds a 6-token prompt chunk in the same step
        batch_decode_attention(model)
        batched = _rows_step(model, lengths, chunks)
        batch_decode_attention(model, False)
        row_by_row = _rows_step(model, lengths, chunks)
        # bf16 activations: each path rounds its attention output once, in another summation order.
        torch.testing.assert_close(batched, row_by_row, rtol=0.05, atol=0.05)
        assert (batched.argmax(-1) == row_by_row.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("preset, overrides", [
    ("tiny", {}),  # head_dim 16: RoPE one feature at a time
    ("tiny", {"head_dim": 64}),  # each half of a head whole blocks of 16: RoPE sixteen features at a time
    ("tiny-mistral", {"sliding_window": 8}),
])
def test_a_step_of_decoding_rows_through_the_joined_projection_and_the_kernels_rope_gives_the_same_logits(
        tmp_path, preset, overrides):
    # Packed for the actors' kernels, q, k and v are one joined projection, and where every token of a step decodes
    # the kernel applies RoPE itself (rope.py's bf16 roundings, in C++): the same bits as the separate projections
    # with RoPE in torch, which the step takes where q, k and v are not joined.
    model, _ = _model(tmp_path, preset, **overrides)
    pack(model).install()
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    assert all(a.fused_in is not None for a in attentions)
    lengths = [1, 5, 17, 40, 9]
    joined = _rows_step(model, lengths, {})
    for a in attentions:
        a.fused_in = None  # the members' packed weights are views of the joined ones: they still compute alone
    separate = _rows_step(model, lengths, {})
    assert torch.equal(joined, separate)


def test_the_kernel_caches_each_rows_new_key_and_attends_within_one_rounding_of_the_exact_sum():
    torch.manual_seed(0)
    ext = cpu_kernels.extension()
    # Head dims with a last half-pair of 16 features (16, 80) and past one block of 64 (80, 128); query heads per KV
    # head past one pass's 4 (G = 5: two passes over the span); past 128 features (144: all the scores, then the
    # values); spans shorter than a block of 16 keys, and ending within one.
    for d, h, h_kv in ((16, 4, 2), (64, 9, 3), (80, 10, 2), (128, 8, 8), (144, 4, 2)):
        lengths = [1, 5, 17, 40, 300]
        q = torch.randn(len(lengths), h, d).to(torch.bfloat16)
        k_new, v_new = (torch.randn(len(lengths), h_kv, d).to(torch.bfloat16) for _ in range(2))
        k_caches = [torch.randn(1, h_kv, n + 3, d).to(torch.bfloat16) for n in lengths]
        v_caches = [torch.randn(1, h_kv, n + 3, d).to(torch.bfloat16) for n in lengths]
        before = [(k.clone(), v.clone()) for k, v in zip(k_caches, v_caches, strict=True)]
        pos = [n - 1 for n in lengths]
        start = [0, 0, pos[2] - 7, 0, 0]  # row 2: a window of its last 8 positions
        out = ext.decode_attention(_joined(q, k_new, v_new), h, h_kv, k_caches, v_caches, pos, start)  # [R, H, D]
        for r, (k0, v0) in enumerate(before):
            k0[0, :, pos[r]], v0[0, :, pos[r]] = k_new[r], v_new[r]
            assert torch.equal(k_caches[r], k0) and torch.equal(v_caches[r], v0)  # only position pos[r] written
            keys, values = (c[0, :, start[r]: pos[r] + 1].double() for c in (k0, v0))  # [H_kv, T, D]
            queries = q[r].double().view(h_kv, h // h_kv, d)
            exact = torch.softmax(queries @ keys.transpose(1, 2) / d ** 0.5, -1) @ values
            # fp32 sums rounded to bf16 once: within half a bf16 step (2^-8) of the exact value, and a hair.
            torch.testing.assert_close(out[r].double(), exact.reshape(h, d), rtol=2**-8, atol=2e-3)
            # The row-by-row path it replaces, on the same bf16 inputs, is no closer to exact.
            sdpa = torch.nn.functional.scaled_dot_product_attention(
                q[r].view(1, h_kv, h // h_kv, d), k0[:, :, start[r]: pos[r] + 1], v0[:, :, start[r]: pos[r] + 1])
            error = (out[r].double() - exact.reshape(h, d)).abs().max()
            assert error <= (sdpa.double().reshape(h, d) - exact.reshape(h, d)).abs().max()


def test_the_one_pass_kernel_rescales_its_sums_where_a_later_block_holds_the_largest_score():
    # One pass keeps a running max: scores rising block by block rescale everything summed before each block, and
    # one key far above the rest at the end leaves the earlier blocks' weights ~0. Against the exact softmax, for
    # one pass (G 3, D 64; G 1, D 48), two passes of the heads (G 5, D 64; G 3, D 128) and the scores first (D 144).
    torch.manual_seed(2)
    ext = cpu_kernels.extension()
    for d, h, h_kv in ((64, 9, 3), (48, 1, 1), (64, 10, 2), (128, 3, 1), (144, 2, 1)):
        n = 100
        q = torch.randn(1, h, d).to(torch.bfloat16)
        k_new, v_new = (torch.randn(1, h_kv, d).to(torch.bfloat16) for _ in range(2))
        direction = q[0].float().view(h_kv, h // h_kv, d).mean(1)  # [H_kv, D]: a key along it scores high for all
        rising = torch.linspace(-2, 2, n)[None, :, None] * direction[:, None, :]  # [H_kv, n, D]
        spiked = torch.randn(h_kv, n, d) * 0.1
        spiked[:, -2] = 8 * direction
        for keys in (rising, spiked):
            k_cache = keys.unsqueeze(0).to(torch.bfloat16)
            v_cache = torch.randn(1, h_kv, n, d).to(torch.bfloat16)
            k0, v0 = k_cache.clone(), v_cache.clone()
            out = ext.decode_attention(_joined(q, k_new, v_new), h, h_kv, [k_cache], [v_cache], [n - 1], [0])
            k0[0, :, n - 1], v0[0, :, n - 1] = k_new[0], v_new[0]
            exact = torch.softmax(q[0].double().view(h_kv, h // h_kv, d) @ k0[0].double().transpose(1, 2) / d ** 0.5,
                                  -1) @ v0[0].double()
            torch.testing.assert_close(out[0].double(), exact.reshape(h, d), rtol=2**-8, atol=2e-3)


def test_the_kernel_gives_the_same_bits_on_one_thread_or_two():
    torch.manual_seed(1)
    lengths, h, h_kv, d = [3, 70, 300], 9, 3, 64
    q = torch.randn(len(lengths), h, d).to(torch.bfloat16)
    k_new, v_new = (torch.randn(len(lengths), h_kv, d).to(torch.bfloat16) for _ in range(2))
    caches = [torch.randn(1, h_kv, n, d).to(torch.bfloat16) for n in lengths for _ in range(2)]
    pos, start = [n - 1 for n in lengths], [0, 0, 0]
    outs, threads = [], torch.get_num_threads()
    try:
        for n in (1, 2):  # each (row, KV head) is one piece of work, summed alike on whichever thread takes it
            torch.set_num_threads(n)
            k_caches, v_caches = [c.clone() for c in caches[::2]], [c.clone() for c in caches[1::2]]
            outs.append(cpu_kernels.extension().decode_attention(_joined(q, k_new, v_new), h, h_kv, k_caches, v_caches,
                                                                 pos, start))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_a_bf16_batch_whose_rows_join_and_leave_decodes_each_requests_tokens_alone(tmp_path):
    # With the kernels, a row's products do not depend on the other rows (the linear kernel sums each output in
    # the same order for any row count; attention is per row): bf16 batching changes no token.
    model, tokenizer = _model(tmp_path, "tiny")
    pack(model).install()
    assert cpu_kernels.loaded() is not None  # packing loaded the kernels and switched the batched path on
    assert all(layer.self_attn.is_decode_batched for layer in model.model.layers)
    alone, batched = alone_and_batched(model, tokenizer)
    assert batched == alone
    assert min(len(t) for t in alone) >= 32 and len({t for row in alone for t in row}) > 4
