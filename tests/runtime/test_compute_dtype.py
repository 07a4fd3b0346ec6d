"""A 16-bit file computed in fp32: the widened weights are the stored values exactly, however they stream."""

from __future__ import annotations

import pytest
import torch

from actors.compute_dtype import widen_in_place
from actors.layer_loader import load_zqs, stream_zqs
from weights_tool.pack import pack
from weights_tool.synth import synthesize


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 2, 3, 4095, 4097, 8192, 100_003])
def test_widening_in_place_gives_the_stored_values_exactly(stored, numel):
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(stored)
    t = torch.full((numel,), float("nan"))
    t.view(torch.uint8)[: numel * 2].copy_(values.view(torch.uint8))  # what the loader writes
    widen_in_place(t, stored)
    assert torch.equal(t, values.float())


@pytest.fixture(scope="module")
def bf16_zqs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16")
    hf = synthesize("tiny-qwen3", tmp / "hf", dtype="bfloat16", seed=4)  # GQA and QK-norm
    return pack(hf, tmp / "m.zqs", codec="zstd")


def test_a_widened_model_holds_the_files_weights_and_computes_as_their_fp32_copy(bf16_zqs):
    exact, tokenizer = load_zqs(bf16_zqs)
    widened, _ = load_zqs(bf16_zqs, compute_dtype="float32")
    assert exact.dtype == torch.bfloat16 and widened.dtype == torch.float32
    for name, p in exact.state_dict().items():
        assert torch.equal(widened.state_dict()[name], p.float()), name
    tokens = torch.tensor([tokenizer.encode("The queue is the enemy of the tail.")])
    pos = torch.arange(tokens.shape[1])
    assert torch.equal(widened(tokens, pos), exact.float()(tokens, pos))


def test_a_warm_widened_stream_holds_then_widens_the_rest_and_never_reads_rows_alone(bf16_zqs):
    streamed = stream_zqs(bf16_zqs, warm_layers=1, compute_dtype="float32")
    try:
        streamed.stream.wait(-1, timeout=30)
        streamed.stream.wait(0, timeout=30)
        assert not streamed.stream.is_ready(1)  # held until a request resumes it
        # The table holds stored bytes until its group is widened: no row is read on its own.
        assert not streamed.is_embedding_raw
        streamed.stream.resume()
        streamed.wait_all(timeout=30)
    finally:
        streamed.close()
    exact, _ = load_zqs(bf16_zqs)
    for name, p in exact.state_dict().items():
        assert torch.equal(streamed.model.state_dict()[name], p.float()), name


def test_auto_widens_on_a_cpu_without_native_bf16_only(bf16_zqs, monkeypatch):
    import actors.compute_dtype as cd

    for is_native, expected in [(False, torch.float32), (True, torch.bfloat16)]:
        monkeypatch.setattr(cd, "cpu_computes_natively", lambda dtype, n=is_native: n)
        model, _ = load_zqs(bf16_zqs, compute_dtype="auto")
        assert model.dtype == expected


@pytest.mark.parametrize(("setting", "scale"), [("float32", 2), ("model", 1)])
def test_the_ingress_accounts_the_actors_compute_dtype_not_the_files(bf16_zqs, setting, scale):
    from actors.actor_config import ActorConfig
    from serve_app.config import ModelSpec
    from serve_app.loaded_model import load_model
    from weights_tool.architecture import ModelConfig
    from weights_tool.reader import ShardReader

    with ShardReader(bf16_zqs) as reader:
        config = ModelConfig.from_hf(reader.config)
    spec = ModelSpec(id="m", zqs_path=str(bf16_zqs), demo_preset=None, demo_dir="", display_name="m", max_context=None)
    loaded = load_model(spec, ActorConfig(compute_dtype=setting))
    widened, _ = load_zqs(bf16_zqs, compute_dtype=setting)
    # What the policy reserves is what the actor's model holds.
    assert loaded.numbers.weight_bytes == sum(p.nbytes for p in widened.parameters()) == scale * config.weight_bytes()
    assert loaded.numbers.kv_bytes_per_token == scale * config.kv_bytes_per_token()
    assert loaded.numbers.kv_bytes_per_token == widened.new_row_cache(1)[0].nbytes() * config.num_layers


def test_warm_actors_hold_every_layer_where_the_actors_pack_their_weights(bf16_zqs):
    """Packing waits for every weight: a warm actor holding fewer layers would compute its first request with the
    plain weights and pack beside it. Where nothing is packed, the derived N stands."""
    from actors.actor_config import ActorConfig
    from actors.cold_start import warm_layers
    from serve_app.config import ModelSpec
    from serve_app.loaded_model import load_model
    from weights_tool.architecture import ModelConfig
    from weights_tool.reader import ShardReader

    with ShardReader(bf16_zqs) as reader:
        config = ModelConfig.from_hf(reader.config)
    spec = ModelSpec(id="m", zqs_path=str(bf16_zqs), demo_preset=None, demo_dir="", display_name="m", max_context=None)
    plain = ActorConfig(is_weight_packed=False, warm_prompt_tokens=4096)  # a long prompt: derived N < L
    derived = warm_layers(config, plain.initial_load_bytes_per_s, plain.prefill_flops_per_s, plain.warm_prompt_tokens)
    assert load_model(spec, plain).warm_layers == derived
    assert load_model(spec, ActorConfig(warm_prompt_tokens=4096)).warm_layers == config.num_layers
    assert load_model(spec, ActorConfig(num_gpus=1, warm_prompt_tokens=4096)).warm_layers == derived
    assert load_model(spec, ActorConfig(warm_layers=1)).warm_layers == 1  # stated: as stated
