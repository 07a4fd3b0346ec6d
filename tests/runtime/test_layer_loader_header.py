"""A shard whose header declares tensors the model does not have is refused at open, before any allocation.

The packer keeps whatever extras a checkpoint holds, so the shards here are packed from
checkpoints that hold them; the huge one has its declared shape edited into the header
(a compressed frame may declare far more bytes than it stores).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors import layer_loader
from actors.layer_loader import stream_zqs
from actors.shard_header import open_zqs
from tests.unit.test_format_corruption import rewrite_header
from weights_tool.format import MAX_FRAME_BYTES, ShardFormatError
from weights_tool.pack import pack
from weights_tool.reader import ShardReader
from weights_tool.synth import preset_config, synthesize

INV_FREQ = "model.layers.0.self_attn.rotary_emb.inv_freq"


def _packed_with(tmp: Path, extra: dict[str, torch.Tensor], *, tie: bool = False) -> Path:
    """A float32 `tiny` Llama that also stores `extra`, each tensor in a frame of its own.

    The shard is otherwise servable (a real tokenizer, one dtype), so before the header was
    checked against the model it opened, and streaming allocated every extra as declared.
    """
    hf = synthesize(preset_config("tiny") | {"tie_word_embeddings": tie}, tmp / "hf", dtype="float32", seed=1)
    save_file(load_file(hf / "model.safetensors") | extra, hf / "model.safetensors")
    return pack(hf, tmp / "model.zqs", byte_group=False, max_frame_bytes=1)


def _declare_huge(zqs: Path, name: str) -> int:
    """Edit the header so `name` (alone in its frame) declares a 1 TiB shape; returns the declared bytes."""
    shape = [1 << 18, 1 << 20]  # F32: 4 << 38 = 1 TiB, the largest frame a header may declare
    size = 4 * shape[0] * shape[1]
    assert size == MAX_FRAME_BYTES

    def mutate(doc):
        for g in doc["groups"]:
            for t in g["tensors"]:
                if t["name"] == name:
                    assert len(g["tensors"]) > 1 and sum(u["frame"] == t["frame"] for u in g["tensors"]) == 1
                    t.update(shape=shape, size=size)
                    g["frames"][t["frame"]]["size"] = size

    rewrite_header(zqs, mutate)
    with ShardReader(zqs) as r:  # the format alone accepts it: only the model can say it is wrong
        assert r.tensors[name].size == size
    return size


def _refused(zqs: Path, name: str) -> None:
    """open_zqs and stream_zqs both refuse `zqs` naming `name`, and allocate and read nothing first."""

    def refuse(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"{what} before the header was refused")
        return fail

    pattern = rf"{zqs.name}: unexpected tensor {name.replace('.', '[.]')} "
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layer_loader.Transformer, "empty", refuse("model allocated"))
        mp.setattr(torch, "empty", refuse("buffer allocated"))
        mp.setattr(ShardReader, "read_group", refuse("frame read"))
        mp.setattr(ShardReader, "read_rows", refuse("rows read"))
        with pytest.raises(ShardFormatError, match=pattern):
            open_zqs(zqs)
        with pytest.raises(ShardFormatError, match=pattern):
            stream_zqs(zqs, num_threads=1)


def test_an_extra_rotary_buffer_is_refused_at_open(tmp_path):
    zqs = _packed_with(tmp_path, {INV_FREQ: torch.ones(8)})
    _refused(zqs, INV_FREQ)


def test_any_name_the_architecture_does_not_have_is_refused_at_open(tmp_path):
    # The packer refuses such a checkpoint, so the name is edited into a packed header.
    zqs = _packed_with(tmp_path, {INV_FREQ: torch.zeros(8)})
    name = "model.layers.0.mlp.gate_proj.bias"

    def rename(doc):
        for t in [t for g in doc["groups"] for t in g["tensors"]]:
            if t["name"] == INV_FREQ:
                t["name"] = name
        for f in doc["source"]["files"]:
            f["tensors"] = [name if n == INV_FREQ else n for n in f["tensors"]]

    rewrite_header(zqs, rename)
    _refused(zqs, name)


def test_a_stored_head_of_a_tied_model_is_refused_at_open(tmp_path):
    zqs = _packed_with(tmp_path, {"lm_head.weight": torch.ones(512, 64)}, tie=True)
    _refused(zqs, "lm_head.weight")


@pytest.mark.parametrize(("name", "tie"), [(INV_FREQ, False), ("lm_head.weight", True)])
def test_a_huge_declared_shape_is_refused_at_open_before_it_is_allocated(tmp_path, name, tie):
    # Zeros compress, so the packer stores the tensor's frame zstd (a raw frame stores every declared byte).
    extra = torch.zeros(1024) if name == INV_FREQ else torch.zeros(512, 64)
    zqs = _packed_with(tmp_path, {name: extra}, tie=tie)
    _declare_huge(zqs, name)
    _refused(zqs, name)


def test_the_fixture_shard_still_opens(tiny_zqs):
    reader, config, tokenizer = open_zqs(tiny_zqs)
    reader.close()
    assert config.num_layers == 2 and tokenizer.encode("hi")
