"""`check_tensor_table`: a shard may declare exactly its config's tensors, at their shapes, in one float dtype."""

from __future__ import annotations

import pytest

from tests.unit.test_format import tiny_config
from weights_tool.architecture import ModelConfig
from weights_tool.dtypes import SAFETENSORS_SIZES
from weights_tool.format import ShardFormatError, TensorEntry
from weights_tool.groups import group_of
from weights_tool.tensor_table import check_tensor_table


def _entry(name: str, shape: tuple[int, ...], dtype: str = "BF16") -> TensorEntry:
    size = SAFETENSORS_SIZES[dtype]
    for d in shape:
        size *= d
    return TensorEntry(name, dtype, shape, group_of(name), 0, 0, size)


def _table(config: ModelConfig, dtype: str = "BF16") -> list[TensorEntry]:
    return [_entry(n, s, dtype) for n, s in config.tensor_shapes().items()]


@pytest.mark.parametrize(("dtype", "model_dtype"), [("F32", "float32"), ("BF16", "bfloat16"), ("F16", "float16")])
def test_the_expected_tensors_give_the_model_dtype(dtype, model_dtype):
    for tie in (False, True):
        config = ModelConfig.from_hf(tiny_config(tie=tie))
        assert check_tensor_table(config, _table(config, dtype)) == model_dtype


@pytest.mark.parametrize(("name", "shape", "why"), [
    ("model.layers.0.self_attn.rotary_emb.inv_freq", (5,), "computed from the config"),
    ("model.layers.1.mlp.extra.weight", (40,), "not a tensor of this LlamaForCausalLM with 3 layers"),
    ("model.norm.bias", (40,), "not a tensor"),
    # A huge declared size is refused by name, before anything could be sized from it.
    ("model.layers.2.self_attn.rotary_emb.inv_freq", (1 << 20, 1 << 18), "computed from the config"),
])
def test_a_tensor_the_architecture_does_not_have_is_refused_by_name(name, shape, why):
    config = ModelConfig.from_hf(tiny_config())
    with pytest.raises(ShardFormatError, match=rf"unexpected tensor {name} \(.*\): .*{why}"):
        check_tensor_table(config, [*_table(config), _entry(name, shape)])


def test_a_stored_head_of_a_tied_model_is_refused():
    config = ModelConfig.from_hf(tiny_config(tie=True))
    with pytest.raises(ShardFormatError, match=r"unexpected tensor lm_head\.weight .*ties the word embeddings"):
        check_tensor_table(config, [*_table(config), _entry("lm_head.weight", (301, 40))])


def test_a_mis_shaped_or_missing_tensor_is_refused_by_name():
    config = ModelConfig.from_hf(tiny_config())
    table = _table(config)
    wrong = [t if t.name != "model.layers.1.mlp.up_proj.weight" else _entry(t.name, (97, 41)) for t in table]
    with pytest.raises(ShardFormatError, match=r"model\.layers\.1\.mlp\.up_proj\.weight declares shape \[97, 41\], "
                                               r"the config expects \[97, 40\]"):
        check_tensor_table(config, wrong)
    with pytest.raises(ShardFormatError, match=r"tensor lm_head\.weight is missing"):
        check_tensor_table(config, [t for t in table if t.name != "lm_head.weight"])


def test_the_weights_share_one_float_dtype():
    config = ModelConfig.from_hf(tiny_config())
    table = _table(config)
    mixed = [t if t.name != "model.norm.weight" else _entry(t.name, t.shape, "F32") for t in table]
    with pytest.raises(ShardFormatError, match=r"model\.norm\.weight is stored as F32 but .* as BF16"):
        check_tensor_table(config, mixed)
    with pytest.raises(ShardFormatError, match=r"is stored as I32; weights must be one of F32, BF16, F16"):
        check_tensor_table(config, _table(config, "I32"))
