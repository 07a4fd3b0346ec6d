"""A `.zqs` file's header, read and validated without torch: what the ingress needs of a model (its config and
tokenizer) and what the loader checks before it allocates anything. No frame is touched."""

from __future__ import annotations

from pathlib import Path

from actors.tokenizer import Tokenizer
from weights_tool.architecture import ModelConfig
from weights_tool.format import ShardFormatError
from weights_tool.reader import ShardReader
from weights_tool.tensor_table import check_tensor_table


def open_zqs(path: str | Path) -> tuple[ShardReader, ModelConfig, Tokenizer]:
    """Read and validate the header only: config, tokenizer and tensor table."""
    reader, config, _ = open_header(path)
    try:
        tokenizer = read_tokenizer(reader, config)
    except BaseException:
        reader.close()
        raise
    return reader, config, tokenizer


def open_header(path: str | Path) -> tuple[ShardReader, ModelConfig, str]:
    """The validated header: reader, config, and the dtype the file stores."""
    reader = ShardReader(path)
    try:
        config = ModelConfig.from_hf(reader.config)
        # Before anything is allocated: a declared tensor the model does not have, or one
        # of another shape, would be allocated at whatever size the header claims.
        try:
            dtype = check_tensor_table(config, reader.tensors.values())
        except ShardFormatError as e:
            raise ShardFormatError(f"{reader.path}: {e}") from None
    except BaseException:
        reader.close()
        raise
    return reader, config, dtype


def read_tokenizer(reader: ShardReader, config: ModelConfig) -> Tokenizer:
    return Tokenizer.from_files(reader.tokenizer_files, eos_token_ids=config.eos_token_ids, source=str(reader.path))
