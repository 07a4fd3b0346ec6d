"""Weight groups: which tensors load together, by name and by the runtime's number.

A model's tensors fall into L + 2 groups, in file and load order, each known by a
name (the `.zqs` header's) and an index (the runtime's `wait_layer`):

    name        index   tensors (HF names)
    embed       -1      model.embed_tokens.*
    layer.i     i       model.layers.i.*          (layer i reads nothing else)
    final       L       everything else: model.norm.*, lm_head.*

A tensor's group follows from its name alone, so the packer, the shard reader and the
runtime's parameters all agree on it.
"""

from __future__ import annotations

import re

EMBED = "embed"
FINAL = "final"
EMBEDDINGS_GROUP = -1  # the embeddings' index; the final group's is num_layers

_LAYER_NAME_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EMBED_PREFIX = "model.embed_tokens."


def layer_index(tensor_name: str) -> int | None:
    """The decoder layer a tensor belongs to, or None for embeddings, final norm and lm_head."""
    m = _LAYER_NAME_RE.match(tensor_name)
    return int(m.group(1)) if m else None


def group_index(tensor_name: str, num_layers: int) -> int:
    """The runtime's number of a tensor's group: -1, 0..L-1 or L."""
    i = layer_index(tensor_name)
    if i is not None:
        return i
    return EMBEDDINGS_GROUP if tensor_name.startswith(_EMBED_PREFIX) else num_layers


def group_of(tensor_name: str) -> str:
    """The name of a tensor's group."""
    i = layer_index(tensor_name)
    if i is not None:
        return f"layer.{i}"
    return EMBED if tensor_name.startswith(_EMBED_PREFIX) else FINAL


def group_names(num_layers: int) -> list[str]:
    return [EMBED, *(f"layer.{i}" for i in range(num_layers)), FINAL]


def group_name(index: int, num_layers: int) -> str:
    """The name of group `index` (-1..num_layers) of a model of `num_layers` layers."""
    if not EMBEDDINGS_GROUP <= index <= num_layers:
        raise IndexError(f"group index {index} outside -1..{num_layers}")
    return EMBED if index == EMBEDDINGS_GROUP else FINAL if index == num_layers else f"layer.{index}"
