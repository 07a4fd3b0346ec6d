"""Loading an HF checkpoint directory: `config.json` plus safetensors weights.

Everything is validated before the model is allocated or anything computes: the
config parses into a supported `ModelConfig`, the weight files exist, and every
tensor's name, shape and dtype (read from the safetensors headers alone) match
what the config needs. Weights are read with `safetensors.safe_open` only —
never `torch.load` or pickle, whose bytes can execute code.

Layout: a single `model.safetensors`, or `model.safetensors.index.json` whose
`weight_map` names the shard file of every tensor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from actors.model import Transformer
from weights_tool.architecture import CheckpointError, ModelConfig

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives and what its header says about it."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "F32", "BF16", "F16"


def read_checkpoint_config(path: str | Path) -> ModelConfig:
    """The parsed `config.json` of a checkpoint directory."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} not found: a checkpoint directory needs a config.json")
    return ModelConfig.from_hf(_read_json(config_path))


def read_checkpoint_index(path: str | Path) -> dict[str, TensorEntry]:
    """Every stored tensor's file, shape and dtype, from the safetensors headers only."""
    root = Path(path)
    index_path, single_path = root / INDEX_FILE, root / SINGLE_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no 'weight_map' of tensor name -> shard file")
        shard_names = sorted(set(weight_map.values()))
        for shard in shard_names:
            # A shard name is a plain file name next to the index, never a path out of the directory.
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise CheckpointError(f"{index_path} names an invalid shard file {shard!r}")
        missing = [s for s in shard_names if not (root / s).is_file()]
        if missing:
            raise CheckpointError(f"{index_path} references missing shard file(s): {', '.join(missing)}")
        headers = {shard: _read_header(root / shard) for shard in shard_names}
        entries = {}
        for name, shard in weight_map.items():
            if name not in headers[shard]:
                raise CheckpointError(f"{index_path} places tensor {name} in {shard}, which does not hold it")
            entries[name] = headers[shard][name]
        return entries
    if single_path.is_file():
        return _read_header(single_path)
    raise CheckpointError(
        f"{root} holds neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors weights are loaded)"
    )


def validate_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, TensorEntry]]:
    """Config and tensor table of a checkpoint that is known to be loadable; raises CheckpointError if not."""
    config = read_checkpoint_config(path)
    entries = read_checkpoint_index(path)
    config.check_tensors({name: entry.shape for name, entry in entries.items()})
    for name in config.tensor_shapes():
        if entries[name].dtype not in _STORED_DTYPES:
            raise CheckpointError(
                f"tensor {name} is stored as {entries[name].dtype}; supported: {', '.join(_STORED_DTYPES)}"
            )
    return config, entries


def _read_tensors(config: ModelConfig, entries: dict[str, TensorEntry]) -> Iterator[tuple[str, torch.Tensor]]:
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for name in config.tensor_shapes():
            file = entries[name].file
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            yield name, handles[file].get_tensor(name)


def load_hf_checkpoint(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> tuple[Transformer, ModelConfig]:
    """Build a Transformer from an HF checkpoint directory.

    dtype defaults to the checkpoint's own (`torch_dtype` / `dtype` in config.json);
    any of fp32, bf16, fp16 may be asked for and the weights are cast.
    """
    config, entries = validate_checkpoint(path)
    dtype = dtype or _TORCH_DTYPES[config.dtype]
    if dtype not in _TORCH_DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(_TORCH_DTYPES)}")
    model = Transformer.empty(config, dtype, device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in _read_tensors(config, entries):
            params.pop(name).copy_(tensor)
    if params:  # unreachable while the model mirrors ModelConfig.tensor_shapes(); guards against drift
        raise CheckpointError(f"model parameters left unloaded: {', '.join(sorted(params))}")
    log.info("loaded %s (%s, %d layers) as %s on %s", path, config.architecture, config.num_layers, dtype, device)
    return model, config


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _read_header(file: Path) -> dict[str, TensorEntry]:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            out = {}
            for name in f.keys():
                view = f.get_slice(name)
                out[name] = TensorEntry(file, tuple(view.get_shape()), view.get_dtype())
            return out
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read safetensors header of {file}: {e}") from None
