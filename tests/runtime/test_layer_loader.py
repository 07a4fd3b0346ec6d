"""A model built from a `.zqs` file alone equals the one built from its HF directory."""

from __future__ import annotations

import pytest
import torch

from actors.checkpoint import load_hf_checkpoint
from actors.layer_loader import load_zqs, open_zqs, stream_zqs
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
