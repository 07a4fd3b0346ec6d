"""Building a runnable model from a `.zqs` shard file alone, its layers streamed in place.

The model is allocated empty (`Transformer.empty`) in its compute dtype and a
`LayerStream` decompresses every group straight into the parameters' storage: on the
CPU into the tensors themselves, on CUDA through pinned staging buffers and a side
stream. `wait_layer(i)` — the runtime's hook — then blocks compute on group i only.
The compute dtype is the file's, except where `compute_dtype` widens a 16-bit file to
fp32 on a CPU without native 16-bit arithmetic (actors/compute_dtype.py): then each
group's bytes land in the leading half of its fp32 parameters and are widened in place
on the loading thread before the group counts as resident, so no second copy of the
weights is ever held.

Layer 0 cannot compute before its input's embedding rows are in, but it needs only the
prompt's rows, not the table (the `small` shape's table is a quarter of its weights).
When the file stores the table raw (the packer's default) and the model is not widened
(whose table holds stored bytes until the group is in), `load_rows(prompt)` reads
just those rows and the stream loads the decoder layers first, the table after them:
layer 0 waits for one layer, not for the table plus one layer. The whole table must be
in before the first decode step (its input is a new token) and before the logits of a
tied model; callers wait on group -1 when they wait on the final group.

The stream starts as soon as the model is allocated; the tokenizer is built while the
first layers load. A warm actor (`warm_layers=N`) loads the whole table and layers
0..N-1, then holds until `stream.resume()`: its request's prompt rows are already in. With N the
number of layers it holds nothing back and loads the final group too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.compute_dtype import compute_dtype_for, widen_in_place
from actors.model import Transformer
from actors.packed_weights import pack
from actors.shard_header import open_header, read_tokenizer
from actors.tokenizer import Tokenizer
from weights_tool.architecture import ModelConfig
from weights_tool.dtypes import torch_dtype
from weights_tool.format import CODEC_RAW
from weights_tool.groups import EMBEDDINGS_GROUP
from weights_tool.layer_stream import CudaLayerStream, LayerStream
from weights_tool.reader import ShardReader

log = logging.getLogger(__name__)

EMBEDDING_TENSOR = "model.embed_tokens.weight"


@dataclass
class StreamedModel:
    """A model whose weights are still arriving; `stream.wait(i)` guards group i."""

    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer
    stream: LayerStream
    reader: ShardReader
    is_embedding_raw: bool  # the table's rows can be read one by one (see the module doc)

    def load_rows(self, token_ids: Sequence[int]) -> bool:
        """Make the embedding rows of `token_ids` resident; False if only the whole table can be.

        True at once when the table is already loaded. The rows are read unchecked (see
        `ShardReader.read_rows`); the caller waits on group -1 before it emits a token.
        """
        if self.stream.is_ready(EMBEDDINGS_GROUP):
            return True
        if not self.is_embedding_raw:
            return False
        rows = sorted(set(token_ids))
        weight = self.model.model.embed_tokens.weight  # [V, D]
        data = self.reader.read_rows(EMBEDDING_TENSOR, rows)  # [n, D * itemsize] uint8
        # The stream may be writing the same rows at the same time: the same bytes.
        if weight.device.type == "cpu":
            # Copied by numpy: this runs off the stepping thread, where a parallel torch op would form
            # a second OpenMP team that slows every later step of the actor (actors/threads.py).
            weight.detach().view(torch.uint8).numpy()[rows] = data
        else:
            index = torch.tensor(rows, dtype=torch.long, device=weight.device)
            with torch.no_grad():
                weight.index_copy_(0, index, torch.from_numpy(data).view(weight.dtype).to(weight.device))
        return True

    def wait_all(self, timeout: float | None = None) -> None:
        for i in range(-1, self.config.num_layers + 1):
            self.stream.wait(i, timeout)

    def close(self) -> None:
        self.stream.close()
        self.reader.close()


def stream_zqs(path: str | Path, *, device: str | torch.device = "cpu", num_threads: int = 2,
               warm_layers: int | None = None, compute_dtype: str = "model") -> StreamedModel:
    """Start loading `path` into a fresh model on `device`; returns once the stream has started.

    `warm_layers=N` loads the embeddings and the first N layers only, then holds (module doc).
    `compute_dtype`: a setting of actors/compute_dtype.py ("model": the file's dtype).
    """
    reader, config, dtype = open_header(path)
    try:
        device = torch.device(device)
        stored = torch_dtype(dtype)
        model = Transformer.empty(config, torch_dtype(compute_dtype_for(compute_dtype, dtype, device.type)), device)
        # The header declares exactly the model's tensors (`check_tensor_table`): each lands in its parameter.
        params = {group: model.group_parameters(group) for group in range(-1, config.num_layers + 1)}
        dests = {name: p.data for group in params.values() for name, p in group.items()}
        after_group = None
        if model.dtype != stored:  # widened: the stored bytes land in each parameter's leading half

            def after_group(group: int) -> None:
                for p in params[group].values():
                    widen_in_place(p.data, stored)

            dests = {name: t.view(-1).view(torch.uint8)[: t.numel() * stored.itemsize] for name, t in dests.items()}
        is_embedding_raw = _is_raw(reader, EMBEDDING_TENSOR) and model.dtype == stored
        layers_first = [*range(config.num_layers), EMBEDDINGS_GROUP, config.num_layers]
        order = layers_first if is_embedding_raw else None
        hold_after = None
        if warm_layers is not None:
            if not 0 <= warm_layers <= config.num_layers:
                raise ValueError(f"warm_layers must be in 0..{config.num_layers}, got {warm_layers}")
            # The table, then layers 0..N-1, in file order. Holding every layer, it holds nothing: the final
            # group (a norm) loads too, so the weights are whole and packed before a request (request_actor.py).
            order, hold_after = None, (None if warm_layers == config.num_layers else 1 + warm_layers)
        if device.type == "cuda":
            stream: LayerStream = CudaLayerStream(reader, dests, num_threads=num_threads, order=order,
                                                  hold_after=hold_after)
        else:
            # Flat byte views of the parameters: the stream writes the weights where they live.
            views = {name: t.reshape(-1).view(torch.uint8).numpy() for name, t in dests.items()}
            stream = LayerStream(reader, views, num_threads=num_threads, order=order, hold_after=hold_after,
                                 after_group=after_group)
    except BaseException:
        reader.close()
        raise
    try:
        tokenizer = read_tokenizer(reader, config)
    except BaseException:
        stream.close()
        reader.close()
        raise
    return StreamedModel(config, model, tokenizer, stream, reader, is_embedding_raw)


def load_zqs(
    path: str | Path, *, device: str | torch.device = "cpu", num_threads: int = 2, compute_dtype: str = "model",
    is_weight_packed: bool = False,
) -> tuple[Transformer, Tokenizer]:
    """Load every layer, then return the model and its tokenizer (its linear weights packed if asked: packed_weights.py)."""
    streamed = stream_zqs(path, device=device, num_threads=num_threads, compute_dtype=compute_dtype)
    try:
        streamed.wait_all()
        if streamed.model.device.type == "cuda":
            torch.cuda.synchronize(streamed.model.device)
    finally:
        streamed.close()
    if is_weight_packed:
        pack(streamed.model).install()
    return streamed.model, streamed.tokenizer


def _is_raw(reader: ShardReader, name: str) -> bool:
    t = reader.tensors[name]
    return reader.group(t.group).frames[t.frame].codec == CODEC_RAW
