"""8-bit KV caches (actors/kv_cache.py, `actor.kv_dtype: int8`): a position's keys and values within half a
quantization step of what was written, the bytes the router accounts for, the decode kernel
(csrc/decode_attention_i8.cpp) writing the bits torch's `quantize` writes and attending as SDPA over the
dequantized caches, the torch path where no kernel reads them, and an engine whose rows join and leave decoding
each request's tokens alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors import attention as attention_module
from actors import cpu_kernels
from actors.actor_config import ActorConfig
from actors.kv_cache import KVCache, dequantize, kv_cache_bytes, quantize
from actors.packed_weights import pack
from serve_app.memory import ModelNumbers, workspace_bytes
from tests.runtime.test_batch_engine import alone_and_batched
from tests.runtime.test_decode_attention import _joined, _model, _rows_step

LENGTHS = [1, 5, 17, 40, 9]  # rows' cached tokens in a step (test_decode_attention's)
needs_kernels = pytest.mark.skipif(not cpu_kernels.is_available(),
                                   reason="no AVX512-BF16/VNNI on this CPU, or the kernels could not be built")


def test_quantize_keeps_each_value_within_half_a_step_of_its_scale_and_zeros_exact():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64) * torch.rand(3, 5, 1) * 10
    x[1, 2] = 0  # a position of zeros: scale 0, values 0, no NaN
    values, scale = quantize(x)
    assert values.dtype == torch.int8 and scale.shape == (3, 5)
    assert values.abs().amax(-1)[scale > 0].eq(127).all()  # each position's largest feature takes the full range
    back = dequantize(values, scale, torch.float32)
    assert ((back - x).abs() <= scale.unsqueeze(-1) / 2 + 1e-6).all()
    assert torch.equal(back[1, 2], torch.zeros(64)) and scale[1, 2] == 0


def test_an_int8_cache_reads_back_its_positions_and_takes_the_bytes_the_router_accounts_for(tmp_path):
    torch.manual_seed(0)
    cache = KVCache(2, 10, 3, 16, torch.bfloat16, "cpu", is_int8=True)
    k, v = torch.randn(2, 3, 4, 16).bfloat16(), torch.randn(2, 3, 4, 16).bfloat16()
    cache.update(torch.tensor([1, 2, 6, 7]), k, v)
    keys, values = cache.span(0, 10)  # [2, 3, 10, 16] in bf16
    assert keys.dtype == torch.bfloat16 and keys.shape == (2, 3, 10, 16)
    for start, end in ((3, 9), (7, 8), (0, 1)):  # spans within and across tiles read what the whole span holds there
        assert all(torch.equal(part, whole[:, :, start:end]) for part, whole in zip(cache.span(start, end),
                                                                                  (keys, values), strict=True))
    for got, want in ((keys, k), (values, v)):
        step = want.float().abs().amax(-1, keepdim=True) / 127
        written = got[:, :, [1, 2, 6, 7]].float()
        # Half a quantization step, then the bf16 rounding of the dequantized value (half its unit in the last place).
        assert ((written - want.float()).abs() <= step / 2 + written.abs() * 2**-8 + 1e-6).all()
        assert got[:, :, [0, 3, 4, 5, 8, 9]].abs().max() == 0
    model, _ = _model(tmp_path, "tiny")
    config = model.config
    caches = model.new_row_cache(48, is_int8=True)
    allocated = sum(c.nbytes() for c in caches)
    assert allocated == kv_cache_bytes(config, 48, torch.bfloat16, is_int8=True)
    assert allocated == 48 * 2 * config.num_layers * config.num_kv_heads * (config.head_dim + 4)
    numbers, wide = ModelNumbers.from_config(config, "bfloat16", True), ModelNumbers.from_config(config, "bfloat16")
    assert numbers.kv_bytes_per_token * 48 == allocated < wide.kv_bytes_per_token * 48
    assert numbers.dtype_bytes == wide.dtype_bytes == 2  # activations stay in the compute dtype
    # Positions round up to the kernel's blocks of 16: 50 take 64, within what the router holds for a row of 50.
    padded = sum(c.nbytes() for c in model.new_row_cache(50, is_int8=True))
    assert padded == kv_cache_bytes(config, 50, torch.bfloat16, is_int8=True) == numbers.kv_bytes_per_token * 64
    assert padded <= numbers.kv_bytes_per_token * 50 + numbers.kv_pad_bytes
    assert workspace_bytes(numbers, 50) == workspace_bytes(wide, 50) + numbers.kv_pad_bytes and wide.kv_pad_bytes == 0


def test_the_kv_dtype_setting_is_checked():
    assert not ActorConfig().is_kv_int8 and ActorConfig(kv_dtype="int8").is_kv_int8
    with pytest.raises(ValueError, match="kv_dtype must be auto or int8"):
        ActorConfig(kv_dtype="fp8")
    with pytest.raises(ValueError, match="compiled step"):
        ActorConfig(kv_dtype="int8", is_compiled=True)


@needs_kernels
def test_the_kernel_writes_the_bits_quantize_writes_and_attends_as_sdpa_over_the_dequantized_caches():
    torch.manual_seed(0)
    ext = cpu_kernels.extension()
    # Head dims of one to eight blocks of 16; one to eight query heads a KV head (past one pass's 4, or 2 where
    # D > 64: another pass over the span); spans shorter than a block of 16 keys, ending within one, and a window.
    for d, h, h_kv in ((16, 4, 2), (64, 9, 3), (48, 1, 1), (32, 8, 2), (64, 14, 2), (128, 8, 1), (80, 6, 2)):
        lengths = [1, 5, 17, 40, 300]
        q = torch.randn(len(lengths), h, d).to(torch.bfloat16)
        k_new, v_new = (torch.randn(len(lengths), h_kv, d).to(torch.bfloat16) for _ in range(2))
        pos = [n - 1 for n in lengths]
        start = [0, 0, pos[2] - 7, 0, 0]  # row 2: a window of its last 8 positions
        caches, expected = [], []
        for r, n in enumerate(lengths):
            cache, whole = (KVCache(1, n + 3, h_kv, d, torch.bfloat16, "cpu", is_int8=True) for _ in range(2))
            k_old, v_old = torch.randn(1, h_kv, n - 1, d).bfloat16(), torch.randn(1, h_kv, n - 1, d).bfloat16()
            cache.update(torch.arange(n - 1), k_old, v_old)
            whole.update(torch.arange(n), torch.cat([k_old, k_new[r, :, None][None]], 2),
                         torch.cat([v_old, v_new[r, :, None][None]], 2))
            caches.append(cache)
            expected.append(whole)
        out = ext.decode_attention(_joined(q, k_new, v_new), h, h_kv, [c.k_cache for c in caches],
                                   [c.v_cache for c in caches], pos, start)
        for r, (cache, whole) in enumerate(zip(caches, expected, strict=True)):
            assert torch.equal(cache.k_cache, whole.k_cache) and torch.equal(cache.v_cache, whole.v_cache)
            keys, values = whole.span(start[r], pos[r] + 1)
            exact = F.scaled_dot_product_attention(q[r].double().view(1, h_kv, h // h_kv, d), keys.double(),
                                                   values.double()).reshape(h, d)
            # The query quantized to 8 bits for the keys' products: scores off by a small fraction of their scale.
            torch.testing.assert_close(out[r].double(), exact, rtol=0.02, atol=0.02)
            assert (out[r].double() - exact).abs().mean() < 4e-3


@needs_kernels
def test_the_int8_kernel_gives_the_same_bits_on_one_thread_or_two_and_refuses_what_it_cannot_read():
    torch.manual_seed(1)
    ext = cpu_kernels.extension()
    lengths, h, h_kv, d = [3, 70, 300], 9, 3, 64
    qkv = torch.randn(len(lengths), (h + 2 * h_kv) * d).to(torch.bfloat16)
    pos, start = [n - 1 for n in lengths], [0, 0, 0]

    def caches():
        torch.manual_seed(2)
        out = [KVCache(1, n, h_kv, d, torch.bfloat16, "cpu", is_int8=True) for n in lengths]
        for c, n in zip(out, lengths, strict=True):
            c.update(torch.arange(n - 1), *(torch.randn(1, h_kv, n - 1, d).bfloat16() for _ in range(2)))
        return out
    outs, threads = [], torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            cs = caches()
            outs.append(ext.decode_attention(qkv, h, h_kv, [c.k_cache for c in cs], [c.v_cache for c in cs], pos,
                                             start))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    cs = caches()
    with pytest.raises(RuntimeError, match="every one alike"):  # an int8 key cache beside a bf16 value cache
        ext.decode_attention(qkv, h, h_kv, [c.k_cache for c in cs], [c.v_cache[..., :d].bfloat16() for c in cs],
                             pos, start)
    wide = [KVCache(1, n, 1, 144, torch.bfloat16, "cpu", is_int8=True) for n in lengths]  # heads past 128 features
    with pytest.raises(RuntimeError, match="up to 128"):
        ext.decode_attention(torch.randn(3, (h + 2) * 144).bfloat16(), h, 1, [c.k_cache for c in wide],
                             [c.v_cache for c in wide], pos, start)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_caches_no_kernel_reads_go_through_sdpa_close_to_the_models_own_caches(tmp_path, dtype):
    # fp32 rows (no int8 kernel for them), and bf16 rows of a model the kernel does not serve (heads of 144
    # features): the spans dequantized to the model's dtype, through SDPA.
    model, _ = _model(tmp_path, "tiny", dtype=dtype, head_dim=16 if dtype == "float32" else 144)
    pack(model).install()
    quantized, own = _rows_step(model, LENGTHS, {}, is_int8=True), _rows_step(model, LENGTHS, {})
    scale = own.abs().max()
    torch.testing.assert_close(quantized, own, rtol=0.05, atol=0.05 * scale)
    assert (quantized.argmax(-1) == own.argmax(-1)).float().mean() >= 0.8


@needs_kernels
def test_the_kernel_over_int8_caches_gives_the_logits_of_the_torch_path(tmp_path, monkeypatch):
    model, _ = _model(tmp_path, "tiny", head_dim=64)  # RoPE in the kernel, sixteen features at a time
    pack(model).install()
    assert model.decode_layers is not None
    kernel = _rows_step(model, LENGTHS, {}, is_int8=True)
    monkeypatch.setattr(attention_module, "is_int8_served", lambda *a: False)  # every layer through SDPA instead
    torch_path = _rows_step(model, LENGTHS, {}, is_int8=True)
    assert not torch.equal(kernel, torch_path)  # two paths ran: the kernel quantizes the query, SDPA does not
    scale = torch_path.abs().max()
    torch.testing.assert_close(kernel, torch_path, rtol=0.05, atol=0.05 * scale)
    assert (kernel.argmax(-1) == torch_path.argmax(-1)).float().mean() >= 0.8


@needs_kernels
def test_an_int8_batch_whose_rows_join_and_leave_decodes_each_requests_tokens_alone(tmp_path):
    model, tokenizer = _model(tmp_path, "tiny")
    pack(model).install()
    alone, batched = alone_and_batched(model, tokenizer, is_kv_int8=True)
    assert batched == alone
    assert min(len(t) for t in alone) >= 32 and len({t for row in alone for t in row}) > 4
    in_bf16, _ = alone_and_batched(model, tokenizer)
    # 8 bits move a logit by a little: the first tokens agree with the model's own caches (what they change over a
    # longer text is benchmarks/results/kv_int8.md's to measure).
    assert all(a[:2] == b[:2] for a, b in zip(alone, in_bf16, strict=True))
