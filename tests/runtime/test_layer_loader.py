"""A model built from a `.zqs` file alone equals the one built from its HF directory."""

from __future__ import annotations

import pytest
import torch

from actors.checkpoint import load_hf_checkpoint
from actors.layer_loader import load_zqs, stream_zqs
from actors.shard_header import open_zqs
from weights_tool.format import ShardFormatError
from weights_tool.pack import pack
from weights_tool.reader import ShardReader
from weights_tool.synth import synthesize


@pytest.mark.parametrize(
    ("preset", "dtype", "codec"),
    [("tiny", "float32", "zstd"), ("tiny", "bfloat16", "zstd"), ("tiny-qwen3", "float16", "raw"),
     ("tiny-qwen2", "bfloat16", "zstd")],
)
def test_zqs_model_gives_the_logits_of_the_hf_directory(tmp_path, preset, dtype, codec):
    hf = synthesize(preset, tmp_path / "hf", dtype=dtype, seed=2)
    zqs = pack(hf, tmp_path / "m.zqs", codec=codec)
    ref, _ = load_hf_checkpoint(hf)
    model, tokenizer = load_zqs(zqs)
    assert model.dtype == ref.dtype
    for name, p in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name
    tokens = torch.tensor([tokenizer.encode("The queue is the enemy of the tail.")])
    pos = torch.arange(tokens.shape[1])
    assert torch.equal(model(tokens, pos), ref(tokens, pos))


def test_open_reads_the_header_only(tmp_path, tiny_zqs):
    # Corrupt the last frame: opening must not notice, reading that group must.
    data = bytearray(tiny_zqs.read_bytes())
    with ShardReader(tiny_zqs) as reader:
        last = reader.group("final").frames[-1]
    data[last.offset + last.stored_size // 2] ^= 0xFF
    bad = tmp_path / "bad.zqs"
    bad.write_bytes(bytes(data))
    reader, config, tokenizer = open_zqs(bad)
    reader.close()
    assert config.num_layers == 2 and tokenizer.encode("hi")
    streamed = stream_zqs(bad)
    try:
        streamed.stream.wait(0, timeout=30)  # earlier groups are fine
        with pytest.raises(ShardFormatError, match="final"):
            streamed.stream.wait(config.num_layers, timeout=30)
    finally:
        streamed.close()


def test_streamed_model_computes_layer_by_layer(tiny_zqs):
    streamed = stream_zqs(tiny_zqs)
    seen = []

    def wait_layer(i: int) -> None:
        streamed.stream.wait(i, timeout=30)
        seen.append(i)

    try:
        model = streamed.model
        model.setup_cache(32)
        model.prefill(torch.tensor([[1, 2, 3]]), wait_layer=wait_layer)
    finally:
        streamed.close()
    assert seen == [-1, 0, 1, 2]


def _loaded_prefill(zqs, text: str) -> tuple[list[int], torch.Tensor]:
    """The prompt for `text` and its prefill logits on the model loaded whole, the reference."""
    model, tokenizer = load_zqs(zqs)
    prompt = tokenizer.encode(text)
    model.setup_cache(64)
    return prompt, model.prefill(torch.tensor([prompt]))


def _prefill_logits(streamed, prompt: list[int]) -> torch.Tensor:
    """Prefill as the request actor does: the prompt's rows (when it can), layer i after group i."""
    is_rows_ready = streamed.load_rows(prompt)
    num_layers = streamed.config.num_layers

    def wait_layer(i: int) -> None:
        if i == -1 and is_rows_ready:
            return
        streamed.stream.wait(i, timeout=30)
        if i == num_layers:
            streamed.stream.wait(-1, timeout=30)

    streamed.model.setup_cache(64)
    return streamed.model.prefill(torch.tensor([prompt]), wait_layer=wait_layer)


def test_a_raw_table_streams_layers_first_and_its_rows_give_the_same_logits(tiny_zqs):
    prompt, expected = _loaded_prefill(tiny_zqs, "Rows first, then the table.")
    streamed = stream_zqs(tiny_zqs, num_threads=1)
    try:
        assert streamed.is_embedding_raw
        got = _prefill_logits(streamed, prompt)
        times = streamed.stream.ready_times()
    finally:
        streamed.close()
    assert torch.equal(got, expected)
    num_layers = streamed.config.num_layers
    assert sorted(times, key=times.get) == [*range(num_layers), -1, num_layers]


def test_a_compressed_table_is_loaded_whole_and_first(tiny_zqs_compressed_embeddings):
    zqs = tiny_zqs_compressed_embeddings
    prompt, expected = _loaded_prefill(zqs, "The whole table first.")
    streamed = stream_zqs(zqs, num_threads=1)
    try:
        assert not streamed.is_embedding_raw
        assert not streamed.load_rows(prompt) or streamed.stream.is_ready(-1)
        got = _prefill_logits(streamed, prompt)
        times = streamed.stream.ready_times()
    finally:
        streamed.close()
    assert torch.equal(got, expected)
    assert min(times, key=times.get) == -1


def test_a_tokenizer_that_fails_after_the_stream_started_stops_it(tiny_zqs, monkeypatch):
    import threading

    from actors import layer_loader
    from weights_tool.layer_stream import THREAD_NAME

    def broken(reader, config):
        raise ValueError("bad tokenizer")

    monkeypatch.setattr(layer_loader, "read_tokenizer", broken)
    with pytest.raises(ValueError, match="bad tokenizer"):
        stream_zqs(tiny_zqs)
    assert not [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]
