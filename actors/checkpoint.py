"""Loading an HF checkpoint directory: `config.json` plus safetensors weights.

Everything is validated before the model is allocated or anything computes: the
config parses into a supported `ModelConfig`, the weight files exist, and every
tensor's name, shape and dtype (read from the safetensors headers alone, by
`weights_tool.checkpoint`) match what the config needs. The weights are then copied
from the memory-mapped files into the model's parameters, cast to its dtype — never
through `torch.load` or pickle, whose bytes can execute code.

Layout: a single `model.safetensors`, or `model.safetensors.index.json` whose
`weight_map` names the shard file of every tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from actors.model import Transformer
from weights_tool.architecture import CheckpointError, ModelConfig
from weights_tool.checkpoint import Weights, read_config, read_weights
from weights_tool.dtypes import MODEL_DTYPE_OF, SAFETENSORS_SIZES, model_dtype, torch_dtype

log = logging.getLogger(__name__)


def validate_checkpoint(path: str | Path) -> tuple[ModelConfig, Weights]:
    """Config and weight files of a checkpoint that is known to be loadable; raises CheckpointError if not."""
    config = ModelConfig.from_hf(read_config(path))
    weights = read_weights(path)
    config.check_tensors({name: t.shape for name, t in weights.tensors.items()})
    for name in config.tensor_shapes():
        stored = weights.tensors[name].dtype
        if stored not in MODEL_DTYPE_OF:
            raise CheckpointError(f"tensor {name} is stored as {stored}; supported: {', '.join(MODEL_DTYPE_OF)}")
    return config, weights


def _read_tensors(config: ModelConfig, weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """Each of the config's tensors in its stored dtype and shape, a view of its mapped file."""
    # Copy-on-write: torch wants writable memory, and nothing here writes to it.
    views = weights.tensor_bytes(mode="c")
    for name in config.tensor_shapes():
        t = weights.tensors[name]
        data = views[name]
        if t.start % SAFETENSORS_SIZES[t.dtype]:  # the format does not align tensors; a copy is aligned
            data = data.copy()
        yield name, torch.from_numpy(data).view(torch_dtype(MODEL_DTYPE_OF[t.dtype])).view(t.shape)


def load_hf_checkpoint(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> tuple[Transformer, ModelConfig]:
    """Build a Transformer from an HF checkpoint directory.

    dtype defaults to the checkpoint's own (`torch_dtype` / `dtype` in config.json);
    any of fp32, bf16, fp16 may be asked for and the weights are cast.
    """
    config, weights = validate_checkpoint(path)
    dtype = torch_dtype(config.dtype if dtype is None else model_dtype(dtype))
    model = Transformer.empty(config, dtype, device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in _read_tensors(config, weights):
            params.pop(name).copy_(tensor)
    if params:  # unreachable while the model mirrors ModelConfig.tensor_shapes(); guards against drift
        raise CheckpointError(f"model parameters left unloaded: {', '.join(sorted(params))}")
    log.info("loaded %s (%s, %d layers) as %s on %s", path, config.architecture, config.num_layers, dtype, device)
    return model, config
