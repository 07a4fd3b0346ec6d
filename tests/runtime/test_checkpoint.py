"""Loading HF checkpoint directories: bad ones fail clearly before anything is allocated or computed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import actors.checkpoint as checkpoint_mod
from actors.checkpoint import load_hf_checkpoint
from tests.runtime.test_model_parity import VOCAB, save_hf_checkpoint
from weights_tool.architecture import SUPPORTED_ARCHITECTURES, CheckpointError, UnsupportedArchitectureError
from weights_tool.checkpoint import encode_safetensors_header
from weights_tool.pack import pack


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("good")
    save_hf_checkpoint("llama3_gqa", path)
    return path


@pytest.fixture
def ckpt(good_dir: Path, tmp_path: Path) -> Path:
    """A private, writable copy of a good single-file checkpoint."""
    for f in good_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


@pytest.fixture
def no_model_allocation(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records any attempt to allocate a model, which must not happen for a bad checkpoint."""
    calls: list[str] = []
    real_empty = checkpoint_mod.Transformer.empty

    def spy(*args, **kwargs):
        calls.append("allocated")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(checkpoint_mod.Transformer, "empty", spy)
    return calls


def rewrite_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_unsupported_architecture_lists_the_supported(ckpt: Path, no_model_allocation: list[str]) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_hf_checkpoint(ckpt)
    assert "GPT2LMHeadModel" in str(err.value)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)
    assert no_model_allocation == []


def test_missing_tensor_is_named(ckpt: Path, no_model_allocation: list[str]) -> None:
    rewrite_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(ckpt)
    assert no_model_allocation == []


def test_misshaped_tensor_is_named(ckpt: Path, no_model_allocation: list[str]) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(64, 64)

    rewrite_weights(ckpt, edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight has shape \[64, 64\]"):
        load_hf_checkpoint(ckpt)
    assert no_model_allocation == []


def test_unexpected_and_non_float_tensors_are_refused(ckpt: Path) -> None:
    rewrite_weights(ckpt, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.extra\.weight"):
        load_hf_checkpoint(ckpt)
    rewrite_weights(ckpt, lambda t: t.pop("model.layers.0.extra.weight"))
    rewrite_weights(ckpt, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int64)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight is stored as I64"):
        load_hf_checkpoint(ckpt)


def test_missing_weights_and_bad_files_fail_clearly(ckpt: Path) -> None:
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(CheckpointError, match="safetensors header"):
        load_hf_checkpoint(ckpt)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"pickle bytes are never loaded")
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_hf_checkpoint(ckpt)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_checkpoint(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_checkpoint(ckpt)


def test_sharded_loads_identically_to_single_file(good_dir: Path, tmp_path: Path) -> None:
    save_hf_checkpoint("llama3_gqa", tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    assert not (tmp_path / "model.safetensors").exists()
    sharded, _ = load_hf_checkpoint(tmp_path)
    single, _ = load_hf_checkpoint(good_dir)
    single_state = single.state_dict()
    for name, tensor in sharded.state_dict().items():
        assert torch.equal(tensor, single_state[name]), name
    tokens = torch.randint(0, VOCAB, (1, 12))
    assert torch.equal(sharded(tokens, torch.arange(12)), single(tokens, torch.arange(12)))


def test_sharded_index_problems_are_named(tmp_path: Path, no_model_allocation: list[str]) -> None:
    save_hf_checkpoint("llama3_gqa", tmp_path, max_shard_size="40KB")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    other = index["weight_map"]["model.embed_tokens.weight"]
    assert shard != other

    index["weight_map"]["model.layers.1.mlp.down_proj.weight"] = other
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"model\.layers\.1\.mlp\.down_proj\.weight in {other}"):
        load_hf_checkpoint(tmp_path)

    index["weight_map"]["model.layers.1.mlp.down_proj.weight"] = "../outside.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="invalid shard file"):
        load_hf_checkpoint(tmp_path)

    index["weight_map"]["model.layers.1.mlp.down_proj.weight"] = shard
    index_path.write_text(json.dumps(index))
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"missing shard file.*{shard}"):
        load_hf_checkpoint(tmp_path)
    assert no_model_allocation == []


def test_dtype_defaults_to_the_checkpoint_and_can_be_cast(good_dir: Path, tmp_path: Path) -> None:
    hf_model = save_hf_checkpoint("qwen2", tmp_path / "fp32")
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    bf16, config = load_hf_checkpoint(tmp_path / "bf16")
    assert config.dtype == "bfloat16"
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    up, _ = load_hf_checkpoint(tmp_path / "bf16", dtype=torch.float32)
    assert {p.dtype for p in up.parameters()} == {torch.float32}
    name = "model.layers.0.self_attn.q_proj.bias"
    assert torch.equal(up.state_dict()[name], bf16.state_dict()[name].float())


def test_the_packer_refuses_the_same_bad_index_the_loader_does(tmp_path: Path) -> None:
    # One reader of checkpoint directories: a tensor stored in a shard the index does not list it in.
    save_hf_checkpoint("llama3_gqa", tmp_path, max_shard_size="40KB")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))
    for read in (load_hf_checkpoint, lambda path: pack(path, tmp_path / "model.zqs")):
        with pytest.raises(CheckpointError, match=r"holds tensor model\.norm\.weight, which .* does not list"):
            read(tmp_path)


def test_tensors_at_unaligned_offsets_load_exactly(good_dir: Path, tmp_path: Path) -> None:
    # safetensors does not align tensors: 3 bytes of U8 first put every fp32 weight at an odd offset.
    tensors = {"model.rotary_emb.inv_freq": torch.arange(3, dtype=torch.uint8),
               **{n: t.clone() for n, t in load_file(good_dir / "model.safetensors").items()}}
    names = {torch.uint8: "U8", torch.float32: "F32"}
    head, _ = encode_safetensors_header(((n, names[t.dtype], tuple(t.shape)) for n, t in tensors.items()), None)
    for f in good_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(head)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
    assert load_file(tmp_path / "model.safetensors").keys() == tensors.keys()
    unaligned, _ = load_hf_checkpoint(tmp_path)
    aligned, _ = load_hf_checkpoint(good_dir)
    expected = aligned.state_dict()
    for name, tensor in unaligned.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
