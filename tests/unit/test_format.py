"""The .zqs format: pack -> unpack is bit-exact, groups decode on their own into caller buffers.

The checkpoint builders here are shared by the other shard-file tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from weights_tool import reader as reader_module
from weights_tool.architecture import CheckpointError, ModelConfig
from weights_tool.byte_group import byte_group, byte_ungroup
from weights_tool.dtypes import MODEL_DTYPES, torch_dtype
from weights_tool.format import CODEC_BYTEGROUP, CODEC_RAW, ShardFormatError
from weights_tool.groups import group_name
from weights_tool.pack import pack
from weights_tool.reader import GroupStream, ShardReader
from weights_tool.unpack import unpack

TORCH_DTYPES = {name: torch_dtype(name) for name in MODEL_DTYPES}
TOKENIZER_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"vocab": {"h\u00e9llo": 0, "\u2713": 1}}}\r\n',
    "tokenizer_config.json": '{"chat_template": "{{ messages }}", "eos_token": "</s>"}',
    "generation_config.json": '{"eos_token_id": 2}\n',
}
# What each pack option is called in the round-trip matrix.
CODEC_OPTIONS = {
    "raw": {"codec": "raw"},
    "zstd": {"byte_group": False},
    "bytegroup": {"byte_group": "always"},
}


def tiny_config(dtype: str = "float32", *, num_layers: int = 3, tie: bool = False) -> dict:
    """A Llama with deliberately odd sizes: hidden 40, intermediate 97, vocab 301."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 40,
        "intermediate_size": 97, "num_hidden_layers": num_layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 301, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 128, "tie_word_embeddings": tie, "torch_dtype": dtype,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    }


def write_checkpoint(root: Path, config: dict, *, num_shards: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """An HF checkpoint directory of normal(0, 0.02) weights; returns the tensors written."""
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[config["torch_dtype"]]
    tensors = {name: (torch.randn(shape, generator=gen) * 0.02).to(dtype)
               for name, shape in ModelConfig.from_hf(config).tensor_shapes().items()}
    names = list(tensors)
    if num_shards == 1:
        save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for k in range(num_shards):
            file = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[k::num_shards]}
            save_file(part, root / file, metadata={"format": "pt", "shard": str(k)})
            weight_map.update({n: file for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (root / "config.json").write_text(json.dumps(config, indent=2))
    for name, text in TOKENIZER_FILES.items():
        (root / name).write_bytes(text.encode("utf-8"))
    return tensors


def packed_checkpoint(tmp: Path, dtype: str = "bfloat16", *, num_shards: int = 1, **pack_kwargs) -> Path:
    write_checkpoint(tmp / "hf", tiny_config(dtype), num_shards=num_shards)
    return pack(tmp / "hf", tmp / "model.zqs", **pack_kwargs)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def read_dir(root: Path) -> dict[str, tuple[str, tuple[int, ...], bytes, str]]:
    """Every tensor of a safetensors directory: (dtype, shape, raw bytes, file name)."""
    out = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_tensor(name)
                out[name] = (str(t.dtype), tuple(t.shape), tensor_bytes(t), file.name)
    return out


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


# ---- round trip ---------------------------------------------------------------------


@pytest.mark.parametrize("codec", list(CODEC_OPTIONS))
@pytest.mark.parametrize("num_shards", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_pack_unpack_is_bit_exact(tmp_path: Path, dtype: str, num_shards: int, codec: str) -> None:
    config = tiny_config(dtype)
    write_checkpoint(tmp_path / "hf", config, num_shards=num_shards)
    zqs = pack(tmp_path / "hf", tmp_path / "model.zqs", **CODEC_OPTIONS[codec])
    out = unpack(zqs, tmp_path / "out")

    assert read_dir(out) == read_dir(tmp_path / "hf")
    assert json.loads((out / "config.json").read_text()) == config
    for name, text in TOKENIZER_FILES.items():
        assert (out / name).read_bytes() == text.encode("utf-8")
    for file in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(file, "pt") as a, safe_open(out / file.name, "pt") as b:
            assert a.metadata() == b.metadata()
    if num_shards > 1:
        src = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
        got = json.loads((out / "model.safetensors.index.json").read_text())
        assert got == src
    else:
        assert not (out / "model.safetensors.index.json").exists()

    with ShardReader(zqs) as r:
        codecs = {f.codec for g in r.groups for f in g.frames}
        r.verify()
    if codec == "raw":
        assert codecs == {CODEC_RAW}
    elif codec == "zstd":
        assert CODEC_BYTEGROUP not in codecs
    else:
        assert CODEC_BYTEGROUP in codecs


def test_reader_exposes_header(tmp_path: Path) -> None:
    zqs = packed_checkpoint(tmp_path, num_shards=2)
    config = tiny_config("bfloat16")
    with ShardReader(zqs) as r:
        assert r.config == config
        assert r.num_layers == 3
        assert r.tokenizer_files == TOKENIZER_FILES
        assert [g.name for g in r.groups] == ["embed", "layer.0", "layer.1", "layer.2", "final"]
        assert {t.name for t in r.group("embed").tensors} == {"model.embed_tokens.weight"}
        assert {t.name for t in r.group("final").tensors} == {"model.norm.weight", "lm_head.weight"}
        assert {t.name for t in r.group("layer.1").tensors} == set(ModelConfig.from_hf(config).layer_tensor_shapes(1))
        assert [group_name(i, 3) for i in (-1, 0, 2, 3)] == ["embed", "layer.0", "layer.2", "final"]
        with pytest.raises(IndexError):
            group_name(4, 3)
        with pytest.raises(KeyError, match="layer.7"):
            r.group("layer.7")


# ---- reading into caller buffers ----------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_read_layer_fills_preallocated_buffers(tmp_path: Path, dtype: str) -> None:
    tensors = write_checkpoint(tmp_path / "hf", tiny_config(dtype))
    zqs = pack(tmp_path / "hf", tmp_path / "model.zqs", byte_group="always")
    with ShardReader(zqs) as r:
        for i in range(r.num_layers):
            names = [t.name for t in r.group(f"layer.{i}").tensors]
            # fp32 into typed arrays of the tensor's shape; bf16 (no numpy dtype) into byte views of torch tensors.
            if dtype == "float32":
                into = {n: np.full(tuple(tensors[n].shape), np.nan, dtype=np.float32) for n in names}
            else:
                torch_dests = {n: torch.zeros_like(tensors[n]) for n in names}
                into = {n: t.view(torch.uint8).numpy() for n, t in torch_dests.items()}
            got = r.read_layer(i, into=into)
            for n in names:
                assert np.shares_memory(got[n], into[n])
                expected = tensor_bytes(tensors[n])
                assert got[n].tobytes() == expected
                if dtype == "bfloat16":
                    assert tensor_bytes(torch_dests[n]) == expected


def test_read_layer_touches_only_its_own_frames(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    zqs = packed_checkpoint(tmp_path, byte_group="always")
    with ShardReader(zqs) as r:
        layer0, layer1 = r.group("layer.0"), r.group("layer.1")
        spans = [(f.offset, f.end) for f in layer1.frames]
        flip_byte(zqs, layer0.frames[0].offset + layer0.frames[0].stored_size // 2)

        reads: list[tuple[int, int]] = []
        real_pread, real_preadv = os.pread, os.preadv

        def pread(fd: int, n: int, offset: int) -> bytes:
            reads.append((offset, offset + n))
            return real_pread(fd, n, offset)

        def preadv(fd: int, buffers: list, offset: int) -> int:
            reads.append((offset, offset + sum(memoryview(b).nbytes for b in buffers)))
            return real_preadv(fd, buffers, offset)

        monkeypatch.setattr(reader_module.os, "pread", pread)
        monkeypatch.setattr(reader_module.os, "preadv", preadv)
        r.read_layer(1)
        assert reads and all(any(a <= s and e <= b for a, b in spans) for s, e in reads)
        monkeypatch.undo()

        r.read_group("embed")
        r.read_group("final")
        with pytest.raises(ShardFormatError, match=r"group layer\.0 frame 0"):
            r.read_layer(0)


@pytest.mark.parametrize("codec", list(CODEC_OPTIONS))
def test_group_stream_reads_in_any_chunk_size(tmp_path: Path, codec: str) -> None:
    # Chunks that straddle tensors, frames and byte-group blocks must give the same bytes.
    zqs = packed_checkpoint(tmp_path, "float32", max_frame_bytes=20_000, **CODEC_OPTIONS[codec])
    with ShardReader(zqs) as r:
        group = r.group("layer.1")
        assert len(group.frames) > 1
        expected = b"".join(r.read_group("layer.1")[t.name].tobytes() for t in group.tensors)
        for chunk in (1, 3, 4096, 33_333):
            stream = GroupStream(r, group)
            buf, parts = np.empty(chunk, dtype=np.uint8), []
            while n := stream.readinto(buf):
                parts.append(buf[:n].tobytes())
            stream.finish()
            assert b"".join(parts) == expected


def test_destinations_are_checked_before_reading(tmp_path: Path) -> None:
    zqs = packed_checkpoint(tmp_path, "float32")
    with ShardReader(zqs) as r:
        group = r.group("layer.0")
        into = {t.name: np.empty(t.size, dtype=np.uint8) for t in group.tensors}
        victim = group.tensors[0].name
        with pytest.raises(ValueError, match=f"no destination buffer for tensor {victim}"):
            r.read_layer(0, into={n: b for n, b in into.items() if n != victim})
        with pytest.raises(ValueError, match=f"destination for {victim} holds"):
            r.read_layer(0, into={**into, victim: np.empty(group.tensors[0].size + 1, dtype=np.uint8)})
        read_only = np.empty(group.tensors[0].size, dtype=np.uint8)
        read_only.flags.writeable = False
        with pytest.raises(ValueError, match="writable"):
            r.read_layer(0, into={**into, victim: read_only})
        with pytest.raises(ValueError, match="not C-contiguous|C-contiguous"):
            r.read_layer(0, into={**into, victim: np.empty(group.tensors[0].size * 2, dtype=np.uint8)[::2]})
        # A bytearray is a writable buffer too; unrelated extra names are ignored.
        r.read_layer(0, into={**into, victim: bytearray(group.tensors[0].size), "unrelated": None})


def test_byte_group_inverts_block_by_block() -> None:
    rng = np.random.default_rng(0)
    for width in (2, 4, 8):
        for n_elements, block in ((1, 8), (1000, 64), (1001, 1024), (4096, 4096)):
            src = rng.integers(0, 256, n_elements * width, dtype=np.uint8)
            block = block // width * width
            planes = byte_group(src, width, block)
            out = np.empty_like(src)
            for start in range(0, len(src), block):
                byte_ungroup(planes[start : start + block], out[start : start + block], width)
            assert np.array_equal(out, src)
            # The last plane of each block holds the most significant byte of every element.
            first = src[: min(block, len(src))]
            m = len(first) // width
            assert np.array_equal(planes[(width - 1) * m : width * m], first[width - 1 :: width])


# ---- packing --------------------------------------------------------------------------


def test_pack_refuses_a_checkpoint_that_does_not_match_its_config(tmp_path: Path) -> None:
    config = tiny_config()
    tensors = write_checkpoint(tmp_path / "hf", config)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        pack(tmp_path / "hf", tmp_path / "model.zqs")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(97, 41)
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(CheckpointError, match="has shape"):
        pack(tmp_path / "hf", tmp_path / "model.zqs")
    assert not (tmp_path / "model.zqs").exists()


def test_pack_writes_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_checkpoint(tmp_path / "hf", tiny_config())
    out = tmp_path / "out"
    out.mkdir()
    calls = []

    def failing_encode(*args, **kwargs):
        calls.append(1)
        raise OSError("disk full")

    monkeypatch.setattr("weights_tool.pack._encode", failing_encode)
    with pytest.raises(OSError, match="disk full"):
        pack(tmp_path / "hf", out / "model.zqs")
    assert calls and list(out.iterdir()) == []


def test_frames_store_raw_when_compression_does_not_pay(tmp_path: Path) -> None:
    # Uniformly random bytes do not compress: every frame must fall back to raw.
    config = tiny_config("float32")
    root = tmp_path / "hf"
    write_checkpoint(root, config)
    rng = np.random.default_rng(0)
    noise = {n: torch.from_numpy(rng.integers(0, 2**31, tuple(s), dtype=np.int32)).view(torch.float32)
             for n, s in ModelConfig.from_hf(config).tensor_shapes().items()}
    save_file(noise, root / "model.safetensors")
    zqs = pack(root, tmp_path / "model.zqs")
    with ShardReader(zqs) as r:
        assert {f.codec for g in r.groups for f in g.frames} == {CODEC_RAW}
    assert read_dir(unpack(zqs, tmp_path / "out")) == read_dir(root)


def test_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    config = tiny_config("bfloat16", num_layers=2, tie=True)
    write_checkpoint(tmp_path / "hf", config)
    zqs = pack(tmp_path / "hf", tmp_path / "model.zqs")
    with ShardReader(zqs) as r:
        assert [t.name for t in r.group("final").tensors] == ["model.norm.weight"]
    assert read_dir(unpack(zqs, tmp_path / "out")) == read_dir(tmp_path / "hf")


# ---- the embedding table, row by row --------------------------------------------------


def test_the_embedding_table_is_stored_raw_unless_asked_to_compress(tmp_path: Path) -> None:
    raw = packed_checkpoint(tmp_path / "a", "bfloat16", byte_group="always")
    squeezed = packed_checkpoint(tmp_path / "b", "bfloat16", byte_group="always", raw_embeddings=False)
    with ShardReader(raw) as r:
        assert {f.codec for f in r.group("embed").frames} == {CODEC_RAW}
        assert r.header.packer["raw_embeddings"] is True
        assert CODEC_RAW not in {f.codec for f in r.group("layer.0").frames}  # the layers still compress
    with ShardReader(squeezed) as r:
        assert CODEC_RAW not in {f.codec for f in r.group("embed").frames}
    assert read_dir(unpack(raw, tmp_path / "out")) == read_dir(tmp_path / "a" / "hf")


def test_read_rows_returns_exactly_those_rows_and_reads_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    zqs = packed_checkpoint(tmp_path, "bfloat16")
    name = "model.embed_tokens.weight"
    with ShardReader(zqs) as r:
        table = r.read_group("embed")[name].reshape(301, -1)  # [V, D * 2 bytes]
        reads: list[int] = []
        real_preadv = os.preadv
        monkeypatch.setattr(reader_module.os, "preadv",
                            lambda fd, bufs, off: reads.append(sum(len(b) for b in bufs)) or real_preadv(fd, bufs, off))
        rows = [300, 0, 7, 7, 150]
        got = r.read_rows(name, rows)
        assert got.shape == (5, 80)
        assert [g.tobytes() for g in got] == [table[i].tobytes() for i in rows]
        assert reads == [80] * 5  # one row each, never the table
        with pytest.raises(IndexError, match="row 301"):
            r.read_rows(name, [301])
        with pytest.raises(IndexError, match="row -1"):
            r.read_rows(name, [-1])
        with pytest.raises(ValueError, match="2-D tensor in a raw frame"):
            r.read_rows("model.norm.weight", [0])
        with pytest.raises(KeyError, match="no tensor"):
            r.read_rows("model.nothing", [0])


def test_read_rows_refuses_a_compressed_table_and_a_truncated_file(tmp_path: Path) -> None:
    zqs = packed_checkpoint(tmp_path / "a", "bfloat16", raw_embeddings=False)
    with ShardReader(zqs) as r, pytest.raises(ValueError, match="zstd"):
        r.read_rows("model.embed_tokens.weight", [0])
    zqs = packed_checkpoint(tmp_path / "b", "bfloat16")
    with ShardReader(zqs) as r:
        t = r.tensors["model.embed_tokens.weight"]
        end = r.group("embed").frames[t.frame].offset + t.offset + t.size
        # Cut the file inside the table's last row, after the reader validated the header.
        os.truncate(zqs, end - 10)
        assert r.read_rows("model.embed_tokens.weight", [0]).shape == (1, 80)
        with pytest.raises(ShardFormatError, match="row 300"):
            r.read_rows("model.embed_tokens.weight", [300])
