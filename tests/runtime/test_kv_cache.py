"""The static KV cache: incremental decoding equals recomputing the whole prefix."""

from __future__ import annotations

import pytest
import torch

from actors.kv_cache import KVCache, kv_cache_bytes
from actors.layers import linear
from actors.model import RowInput, Transformer
from weights_tool.architecture import ModelConfig

VOCAB = 256


def make_config(**overrides) -> ModelConfig:
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        **overrides,
    }
    return ModelConfig.from_hf(hf)


CONFIGS = {
    "gqa": make_config(),
    "sliding_window": make_config(architectures=["MistralForCausalLM"], sliding_window=5),
    "qk_norm": make_config(architectures=["Qwen3ForCausalLM"], head_dim=24),
}


def make_model(config: ModelConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> Transformer:
    """Random weights with logits far from flat; the same seed gives the same weights in any dtype."""
    torch.manual_seed(seed)
    model = Transformer(config)
    model.init_weights(std=0.15)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.add_(0.2 * torch.randn_like(param))
    return model.to(dtype)


def decode_all(model: Transformer, tokens: torch.Tensor, prompt_len: int) -> list[torch.Tensor]:
    """Logits [B, V] after each prefix tokens[:, :n], n = prompt_len .. S, via prefill then decode steps."""
    model.setup_cache(tokens.shape[1], batch_size=tokens.shape[0])
    out = [model.prefill(tokens[:, :prompt_len])]
    for pos in range(prompt_len, tokens.shape[1]):
        out.append(model.decode_step(tokens[:, pos : pos + 1], pos))
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decode_equals_full_recompute(name: str) -> None:
    config = CONFIGS[name]
    cached_model, full_model = make_model(config), make_model(config)
    prompt_len, total = 7, 24
    tokens = torch.randint(0, VOCAB, (2, total), generator=torch.Generator().manual_seed(1))
    steps = decode_all(cached_model, tokens, prompt_len)
    assert len(steps) == total - prompt_len + 1
    for i, logits in enumerate(steps):
        end = prompt_len + i
        # No cache on this model: the forward recomputes the whole prefix from scratch.
        ref = full_model(tokens[:, :end], torch.arange(end))[:, -1]
        assert ref.abs().max() > 1.0
        torch.testing.assert_close(logits, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gqa", "sliding_window"])
def test_chunked_prefill_through_forward_equals_one_prefill(name: str) -> None:
    model = make_model(CONFIGS[name])
    tokens = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    model.setup_cache(32)
    whole = model.prefill(tokens)
    model.setup_cache(32)  # fresh caches: the chunks below write positions 0.. again
    model(tokens[:, :8], torch.arange(8))
    last = model(tokens[:, 8:], torch.arange(8, 20))[:, -1]
    torch.testing.assert_close(last, whole, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["gqa", "sliding_window"])
def test_half_precision_is_finite_and_close_to_fp32(name: str, dtype: torch.dtype) -> None:
    config = CONFIGS[name]
    tokens = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(3))
    ref = torch.stack(decode_all(make_model(config), tokens, 6))
    low = torch.stack(decode_all(make_model(config, dtype), tokens, 6))
    assert low.dtype == torch.float32, "logits are returned in fp32 whatever the model dtype"
    assert torch.isfinite(low).all()
    scale = ref.abs().max().item()
    assert (low - ref).abs().max().item() < 0.05 * scale
    # Greedy choices mostly agree; the odd near-tie may flip in half precision.
    assert (low.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("shape", [(1, 1, 96), (96,), (3, 96)])
def test_single_row_bf16_linear_equals_f_linear(shape: tuple[int, ...]) -> None:
    """The decode fast path (gemv for one bf16 row on CPU) computes what F.linear does."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=gen).bfloat16()
    weight = torch.randn(40, 96, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16()
    out = linear(x, weight, bias)
    ref = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.02)


def test_moving_the_model_keeps_rope_in_fp32() -> None:
    config = CONFIGS["gqa"]
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6))
    moved = make_model(config).to(torch.bfloat16)
    built = Transformer.empty(config, torch.bfloat16)  # rope computed afresh, weights cast on load
    built.load_state_dict(make_model(config).state_dict())
    assert moved.dtype == torch.bfloat16 and moved._inv_freq.dtype == torch.float32
    torch.testing.assert_close(moved(tokens, torch.arange(12)), built(tokens, torch.arange(12)))


def test_cpu_parameters_are_separate_page_aligned_views_of_one_arena() -> None:
    model = Transformer.empty(CONFIGS["qk_norm"])
    spans = sorted((p.data_ptr(), p.data_ptr() + p.nbytes) for p in model.parameters())
    assert all(start % 4096 == 0 for start, _ in spans)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False))
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1


def test_kv_cache_update_writes_at_positions() -> None:
    cache = KVCache(batch_size=1, max_seq_len=8, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    k = torch.randn(1, 2, 3, 4)
    v = torch.randn(1, 2, 3, 4)
    cache.update(torch.tensor([2, 3, 4]), k, v)
    k_all, v_all = cache.span(0, 8)
    assert k_all.shape == (1, 2, 8, 4)
    torch.testing.assert_close(k_all[:, :, 2:5], k)
    torch.testing.assert_close(v_all[:, :, 2:5], v)
    assert k_all[:, :, :2].abs().sum() == 0 and k_all[:, :, 5:].abs().sum() == 0


def test_kv_cache_bytes_is_what_setup_cache_allocates() -> None:
    config = CONFIGS["gqa"]
    model = Transformer.empty(config, torch.bfloat16)
    model.setup_cache(48, batch_size=3)
    allocated = sum(cache.nbytes() for cache in model.kv_caches)
    assert allocated == kv_cache_bytes(config, 48, torch.bfloat16, batch_size=3)
    assert allocated == 2 * config.num_layers * 3 * config.num_kv_heads * 48 * config.head_dim * 2
    model.drop_cache()
    assert model.kv_caches == [] and model.max_seq_len == 0


def test_cache_bounds_fail_clearly() -> None:
    model = make_model(CONFIGS["gqa"])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.setup_cache(129)
    with pytest.raises(RuntimeError, match="setup_cache"):
        model.prefill(torch.zeros(1, 4, dtype=torch.long))
    model.setup_cache(8)
    with pytest.raises(ValueError, match="do not fit"):
        model.prefill(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="batch size"):
        model.prefill(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids"):
        model.prefill(torch.full((1, 4), VOCAB, dtype=torch.long))
    model.prefill(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="do not fit"):
        model.decode_step(torch.zeros(1, 1, dtype=torch.long), 8)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_rows_equals_each_row_alone(name: str) -> None:
    """Rows at different positions, decoding and prefilling in one step, each get their own logits."""
    config = CONFIGS[name]
    model = make_model(config)
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, VOCAB, (1, n), generator=gen) for n in (9, 17, 4)]
    alone = []
    for seq in seqs:  # reference: each sequence on its own static cache, one token at a time after 3
        model.setup_cache(seq.shape[1])
        out = [model.prefill(seq[:, :3])]
        out += [model.decode_step(seq[:, p : p + 1], p) for p in range(3, seq.shape[1])]
        alone.append(torch.cat(out))  # [n - 2, V]: logits after each prefix of length 3..n
    model.drop_cache()
    caches = [model.new_row_cache(s.shape[1]) for s in seqs]
    # Row 0 prefills all 9 at once, row 1 a chunk of 5 then 7 then single tokens, row 2 joins late.
    got: list[list[torch.Tensor]] = [[], [], []]
    steps = [  # per step: (row, start, count) for the rows taking part
        [(0, 0, 9), (1, 0, 5)],
        [(1, 5, 7)],
        [(1, 12, 1), (2, 0, 3)],
        [(1, 13, 1), (2, 3, 1)],
    ]
    for step in steps:
        tokens = torch.cat([seqs[r][0, s : s + n] for r, s, n in step])
        inputs = [RowInput(caches[r], s, n) for r, s, n in step]
        logits = model.forward_rows(tokens, inputs)
        assert logits.shape == (len(step), VOCAB)
        for (r, _, _), row_logits in zip(step, logits, strict=True):
            got[r].append(row_logits)
    # Each row's logits after prefix length p equal the alone run's.
    torch.testing.assert_close(got[0][0], alone[0][9 - 3], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(got[1]), alone[1][[5 - 3, 12 - 3, 13 - 3, 14 - 3]], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(got[2]), alone[2][[0, 1]], atol=2e-5, rtol=1e-5)


def test_forward_rows_skips_logits_a_prefill_chunk_does_not_need_and_checks_room() -> None:
    model = make_model(CONFIGS["gqa"])
    caches = [model.new_row_cache(8), model.new_row_cache(8)]
    tokens = torch.arange(6)
    logits = model.forward_rows(tokens, [RowInput(caches[0], 0, 4, needs_logits=False), RowInput(caches[1], 0, 2)])
    assert logits.shape == (1, VOCAB)
    with pytest.raises(ValueError, match="do not fit"):
        model.forward_rows(torch.arange(5), [RowInput(caches[0], 4, 5)])
    with pytest.raises(ValueError, match="tokens must be"):
        model.forward_rows(torch.arange(3), [RowInput(caches[0], 0, 2)])
    row_bytes = sum(c.nbytes() for c in caches[0])
    assert row_bytes == kv_cache_bytes(CONFIGS["gqa"], 8, torch.float32)
