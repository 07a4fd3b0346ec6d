"""The tensors a `.zqs` file may declare to a loader: exactly those its config's architecture expects.

`parse_header` checks a header against its file (offsets, sizes, tiling), not against the
model: a compressed frame may declare up to MAX_FRAME_BYTES decompressed from a few stored
bytes, and a tensor in it any shape that tiles it. A loader allocates every declared tensor
before it reads a byte, so a tensor the model does not use (a rotary `inv_freq` buffer, a
tied model's `lm_head.weight`, any other name) would be allocated at whatever size its
header claims. Checking the table against `ModelConfig.tensor_shapes()` first bounds every
allocation by the model's own size, and fails a corrupt shard at open, naming the tensor.

This is stricter than `ModelConfig.check_tensors`, which lets an HF checkpoint directory
carry such extras: there they are skipped unread, here they would be allocated.
"""

from __future__ import annotations

from collections.abc import Iterable

from weights_tool.architecture import ModelConfig
from weights_tool.dtypes import MODEL_DTYPE_OF
from weights_tool.format import ShardFormatError, TensorEntry


def check_tensor_table(config: ModelConfig, tensors: Iterable[TensorEntry]) -> str:
    """The model dtype ("bfloat16", ...) of a table that is exactly `config`'s tensors.

    Every declared tensor must be one `config` expects, with exactly the expected shape;
    every expected tensor must be declared; all must share one of F32/BF16/F16, the dtype
    the model is built in. Otherwise ShardFormatError naming the first tensor at fault.
    Reads nothing but its arguments.
    """
    expected = config.tensor_shapes()
    declared: dict[str, TensorEntry] = {}
    for t in tensors:
        shape = expected.get(t.name)
        if shape is None:
            raise ShardFormatError(
                f"unexpected tensor {t.name} (group {t.group}, {t.dtype} {list(t.shape)}): "
                f"{_why_unexpected(t.name, config)}"
            )
        if tuple(t.shape) != shape:
            raise ShardFormatError(f"tensor {t.name} declares shape {list(t.shape)}, the config expects {list(shape)}")
        declared[t.name] = t
    for name, shape in expected.items():
        if name not in declared:
            raise ShardFormatError(f"tensor {name} is missing (the config expects shape {list(shape)})")
    first = declared[next(iter(expected))]
    if first.dtype not in MODEL_DTYPE_OF:
        raise ShardFormatError(f"tensor {first.name} is stored as {first.dtype}; weights must be one of "
                               f"{', '.join(MODEL_DTYPE_OF)}")
    for t in declared.values():
        if t.dtype != first.dtype:
            raise ShardFormatError(f"tensor {t.name} is stored as {t.dtype} but {first.name} as {first.dtype}; "
                                   f"the weights must share one dtype")
    return MODEL_DTYPE_OF[first.dtype]


def _why_unexpected(name: str, config: ModelConfig) -> str:
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return "the config ties the word embeddings, so the output head is the embedding table and is not stored"
    if name.endswith("rotary_emb.inv_freq"):
        return "rotary frequencies are computed from the config, never loaded"
    return f"not a tensor of this {config.architecture} with {config.num_layers} layers"
