"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2, Qwen3 (gpt-fast-sized).

The module tree mirrors HF's names exactly (`model.layers.3.self_attn.q_proj.weight`),
so `load_state_dict` takes an HF state dict as it is and the layer-streamed loader
can write each checkpoint tensor straight into the parameter of the same name.

Weight groups and `wait_layer`. The forward pass touches the weights in groups
(weights_tool/groups.py), in order, and calls `wait_layer(group)` right before it
first reads a group:

    -1        model.embed_tokens
    0..L-1    model.layers.{i}            (layer i reads nothing else)
    L         model.norm and lm_head      (or embed_tokens again when tied)

A loader that streams weights in this order can therefore let prefill start
while later layers are still arriving: `wait_layer(i)` blocks until group i is
resident. `group_parameters(group)` names the parameters of each group.

Two ways in. `prefill` / `decode_step` / `forward` run one sequence (or B sequences in
lockstep) against the model's own static cache (`setup_cache`). `forward_rows` runs a
*batch of independent rows*, each with its own per-row cache (`new_row_cache`), its own
positions and its own number of tokens this step (a decode row 1, a prefill chunk many):
the rows' tokens are flattened into one [1, T] sequence, so every weight is read once per
step for all of them, and only attention is computed row by row (`Segment`). Both ways
share every layer's code.

Numerics follow HF: RMSNorm in fp32 then cast, RoPE tables computed in fp32 from
the positions and cast to the model dtype, logits returned as fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from actors import bf16_linear, decode_layers
from actors.arena import move_parameters_to_huge_pages
from actors.attention import Attention, AttentionSpan, Segment
from actors.kv_cache import KVCache
from actors.layers import Linear, RMSNorm, linear, silu_mul
from actors.rope import rope_inv_freq, rope_tables
from weights_tool.architecture import ModelConfig
from weights_tool.groups import EMBEDDINGS_GROUP, group_index

WaitLayer = Callable[[int], None]


@dataclass(frozen=True)
class RowInput:
    """One row of `Transformer.forward_rows`: `num_tokens` tokens from position `start_pos` of its cache."""

    caches: Sequence[KVCache]  # one per layer, from `new_row_cache`
    start_pos: int
    num_tokens: int
    needs_logits: bool = True  # a prefill chunk before the prompt's last one needs none


class MLP(nn.Module):
    fused_in = None  # bf16_linear.Fused of gate and up, once packed_weights installs it: one kernel call

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, inter, bias = config.hidden_size, config.intermediate_size, config.has_mlp_bias
        self.gate_proj = Linear(h, inter, bias=bias, dtype=dtype)
        self.up_proj = Linear(h, inter, bias=bias, dtype=dtype)
        self.down_proj = Linear(inter, h, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_in is not None and self.fused_in.kernel is bf16_linear.linear:  # bf16 rows: one kernel pass
            return self.down_proj(silu_mul(self.fused_in.joined(x)))
        if self.fused_in is not None:  # views of one new [..., 2I] tensor: overwritten in place, no more memory
            gate, up = self.fused_in(x)
            return self.down_proj(F.silu(gate, inplace=True).mul_(up))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # gate freed before up is made


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: Sequence[Segment], layer: int
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, segments, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        # `_weight` skips nn.Embedding's normal_() init.
        weight = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class Transformer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        initialise: bool = True,
    ) -> None:
        """A model with random HF-style weights; `Transformer.empty` skips the initialisation."""
        super().__init__()
        self.config = config
        # Built straight on the device with uninitialised storage (no module here runs an
        # init): a multi-GB model is not initialised only to be overwritten by the loader.
        # Not via the meta device: its first use imports sympy and torch._dynamo, a
        # second or more of every cold actor's start.
        with torch.device(device):
            self.model = Decoder(config, dtype)
            self.lm_head = (
                None if config.tie_word_embeddings
                else Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
            )
        if self.device.type == "cpu":
            move_parameters_to_huge_pages(self)
        self.requires_grad_(False)
        self.eval()
        # inv_freq: [D/2] fp32. A plain attribute, not a buffer: the state dict holds only
        # checkpoint tensors, and model.to(bfloat16) must not round the frequencies.
        self._inv_freq = rope_inv_freq(config).to(self.device)
        self.kv_caches: list[KVCache] = []
        self._position_table: torch.Tensor | None = None
        # A tied head packed (packed_weights.py) for bf16_linear.py, [V/16, D/2, 16] int32, or for
        # bf16_weight_linear.py, [V/16, D, 16] int16: the LM head's weight and, read back, the embedding table,
        # whose plain copy is then released. `packed_head_layout` is the module of its layout (`linear`, `rows_of`).
        self.packed_head: torch.Tensor | None = None
        self.packed_head_layout = bf16_linear
        # Every layer of a decode-only step in one C++ call (decode_layers.py), set where packing installs the bf16
        # kernel; None: the layers one by one (the reference the tests compare it with).
        self.decode_layers = None
        if initialise:
            self.init_weights()

    @classmethod
    def empty(
        cls, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> Transformer:
        """Parameters allocated (torch.empty) but not initialised, for a loader to fill in place."""
        return cls(config, dtype, device, initialise=False)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """HF's initialisation: normal(0, std) matrices, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `tokens` [...]: [..., D], from the pair-packed table where the head is packed."""
        if self.packed_head is None:
            return self.model.embed_tokens(tokens)
        return self.packed_head_layout.rows_of(self.packed_head, tokens)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def group_parameters(self, group: int) -> dict[str, nn.Parameter]:
        """The parameters `wait_layer(group)` guards, by HF name (see the module docstring)."""
        num_layers = self.config.num_layers
        if not EMBEDDINGS_GROUP <= group <= num_layers:
            raise ValueError(f"group must be in [-1, {num_layers}], got {group}")
        return {name: p for name, p in self.named_parameters() if group_index(name, num_layers) == group}

    # ---- cache ---------------------------------------------------------------

    def setup_cache(self, max_seq_len: int, batch_size: int = 1) -> None:
        """Allocate every layer's static KV cache for `max_seq_len` positions (prompt + max_tokens)."""
        self.drop_cache()
        self.kv_caches = self.new_row_cache(max_seq_len, batch_size)

    def new_row_cache(self, max_seq_len: int, batch_size: int = 1, is_int8: bool = False) -> list[KVCache]:
        """One KVCache per layer for `max_seq_len` positions: a batch row's own cache (`forward_rows`); 8-bit
        keys and values where `is_int8` (kv_cache.py)."""
        if max_seq_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                f"{self.config.max_position_embeddings}"
            )
        c = self.config
        return [KVCache(batch_size, max_seq_len, c.num_kv_heads, c.head_dim, self.dtype, self.device, is_int8)
                for _ in range(c.num_layers)]

    def drop_cache(self) -> None:
        """Free the KV cache memory."""
        self.kv_caches = []

    @property
    def max_seq_len(self) -> int:
        return self.kv_caches[0].max_seq_len if self.kv_caches else 0

    # ---- forward -------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, input_pos: torch.Tensor, wait_layer: WaitLayer | None = None
    ) -> torch.Tensor:
        """Logits [B, S, V] (fp32) for tokens [B, S] at consecutive positions input_pos [S].

        With a cache set up, the tokens' keys and values are written to it and they
        attend to everything cached before them (reads input_pos[0] back to the host).
        Without one, the chunk attends only to itself: a full recompute from position 0.
        """
        self._check_tokens(tokens)
        if input_pos.shape != (tokens.shape[1],):
            raise ValueError(f"input_pos must have shape [{tokens.shape[1]}], got {list(input_pos.shape)}")
        if not self.kv_caches:
            seg = Segment(0, tokens.shape[1], input_pos, self._attention_span(input_pos, None), None)
            return self._forward(tokens, [seg], input_pos, wait_layer, None)
        start_pos = int(input_pos[0])
        self._check_cache_room(tokens, start_pos)
        return self._forward(tokens, [self._cached_segment(start_pos, tokens.shape[1])], input_pos, wait_layer, None)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, wait_layer: WaitLayer | None = None) -> torch.Tensor:
        """Run the prompt tokens [B, S] from position 0 into the cache; logits [B, V] of the last position."""
        if not self.kv_caches:
            raise RuntimeError("prefill needs a KV cache: call setup_cache(max_seq_len) first")
        self._check_tokens(tokens)
        self._check_cache_room(tokens, 0)
        seg = self._cached_segment(0, tokens.shape[1])
        return self._forward(tokens, [seg], seg.input_pos, wait_layer, [tokens.shape[1] - 1])[:, 0]

    @torch.inference_mode()
    def decode_step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        """Logits [B, V] for token [B, 1] at position `pos`, attending to the cache."""
        if not self.kv_caches:
            raise RuntimeError("decode_step needs a KV cache: call setup_cache(max_seq_len) first")
        if token.dim() != 2 or token.shape[1] != 1:
            raise ValueError(f"token must have shape [B, 1], got {list(token.shape)}")
        self._check_cache_room(token, pos)
        seg = self._cached_segment(pos, 1)
        return self._forward(token, [seg], seg.input_pos, None, [0])[:, 0]

    @torch.inference_mode()
    def forward_rows(
        self, tokens: torch.Tensor, rows: Sequence[RowInput], wait_layer: WaitLayer | None = None
    ) -> torch.Tensor:
        """One step of a batch of independent rows: logits [R, V] (fp32), one per row with `needs_logits`.

        tokens: [T], the rows' tokens back to back (T = sum of num_tokens). Each row's
        tokens sit at positions [start_pos, start_pos + num_tokens) of its own cache and
        attend to what that cache holds before them; the logits are those of each row's
        last token. Every weight is read once for the whole step.
        """
        if tokens.dim() != 1 or tokens.shape[0] != sum(r.num_tokens for r in rows):
            raise ValueError(f"tokens must be [T] with T = the rows' tokens, got {list(tokens.shape)}")
        self._check_tokens(tokens.view(1, -1))
        segments, last = [], []
        offset = 0
        for row in rows:
            cache = row.caches[0]
            if row.num_tokens < 1 or row.start_pos < 0 or row.start_pos + row.num_tokens > cache.max_seq_len:
                raise ValueError(f"a row's positions [{row.start_pos}, {row.start_pos + row.num_tokens}) do not "
                                 f"fit its KV cache of {cache.max_seq_len}")
            segments.append(self._cached_segment(row.start_pos, row.num_tokens, row.caches, offset))
            offset += row.num_tokens
            if row.needs_logits:
                last.append(offset - 1)
        input_pos = segments[0].input_pos if len(segments) == 1 else torch.cat([s.input_pos for s in segments])
        return self._forward(tokens.view(1, -1), segments, input_pos, wait_layer, last)[0]

    def _forward(
        self,
        tokens: torch.Tensor,
        segments: Sequence[Segment],
        input_pos: torch.Tensor,
        wait_layer: WaitLayer | None,
        last: list[int] | None,
    ) -> torch.Tensor:
        """Logits [B, S', V] of tokens [B, S] at positions input_pos [S]; S' = len(last), or S when None."""
        rope = self.rope(input_pos)

        if wait_layer is not None:
            wait_layer(EMBEDDINGS_GROUP)
        x = self.embed(tokens)
        if wait_layer is None and self.decode_layers is not None and decode_layers.takes(x, segments, self.model.layers[0].self_attn):
            x = decode_layers.forward(self.decode_layers, x, rope, segments)  # every layer in one C++ call
        else:
            for i, layer in enumerate(self.model.layers):
                if wait_layer is not None:
                    wait_layer(i)
                x = layer(x, rope, segments, i)
        if wait_layer is not None:
            wait_layer(self.config.num_layers)
        if last is not None:
            x = x[:, last] if last != [x.shape[1] - 1] else x[:, -1:]
        x = self.model.norm(x)
        if self.lm_head is not None:  # its module: a packed weight (packed_weights.py) is used there
            return self.lm_head(x).float()
        if self.packed_head is not None:
            return self.packed_head_layout.linear(x, self.packed_head, self.config.vocab_size).float()
        return linear(x, self.model.embed_tokens.weight).float()

    def rope(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [S, D] in the model's dtype for positions input_pos [S] (actors/rope.py)."""
        if self._inv_freq.device != input_pos.device:  # the model was moved with .to()
            self._inv_freq = self._inv_freq.to(input_pos.device)
        return rope_tables(self._inv_freq, input_pos, self.dtype)

    def _cached_segment(self, start_pos: int, length: int, caches: Sequence[KVCache] | None = None,
                        offset: int = 0) -> Segment:
        input_pos = self._positions(start_pos + length)[start_pos:]
        return Segment(offset, length, input_pos, self._attention_span(input_pos, start_pos),
                       self.kv_caches if caches is None else caches)

    def _positions(self, end: int) -> torch.Tensor:
        """arange(end) on the model's device, sliced from one table built once."""
        table = self._position_table
        if table is None or table.shape[0] < end or table.device != self.device:
            table = self._position_table = torch.arange(max(end, self.config.max_position_embeddings),
                                                        device=self.device)
        return table[:end]

    def _attention_span(self, input_pos: torch.Tensor, start_pos: int | None) -> AttentionSpan:
        seq_len = input_pos.shape[0]
        window = self.config.sliding_window
        if start_pos is None:  # no cache: the chunk attends to itself
            start, end, kv_pos = 0, seq_len, input_pos
        else:
            end = start_pos + seq_len
            # The oldest position any query of this chunk may see; older keys are not even read.
            start = max(0, start_pos + 1 - window) if window is not None else 0
            kv_pos = self._positions(end)[start:]
        if seq_len == 1:  # one query sees every key in [start, end)
            return AttentionSpan(start, end, None, is_causal=False)
        if window is None and end - start == seq_len:
            return AttentionSpan(start, end, None, is_causal=True)
        # mask: [S, T], True where query i may attend to key j (causal, and within the window).
        mask = kv_pos[None, :] <= input_pos[:, None]
        if window is not None:
            mask &= kv_pos[None, :] > input_pos[:, None] - window
        return AttentionSpan(start, end, mask, is_causal=False)

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        if tokens.dim() != 2 or tokens.shape[1] == 0 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a non-empty int64 [B, S] tensor, got {tokens.dtype} {list(tokens.shape)}")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got [{lo}, {hi}]")

    def _check_cache_room(self, tokens: torch.Tensor, start_pos: int) -> None:
        bsz, seq_len = tokens.shape
        if bsz != self.kv_caches[0].batch_size:
            raise ValueError(f"batch size {bsz} does not match the cache's {self.kv_caches[0].batch_size}")
        if start_pos < 0 or start_pos + seq_len > self.max_seq_len:
            raise ValueError(
                f"positions [{start_pos}, {start_pos + seq_len}) do not fit the KV cache of {self.max_seq_len}"
            )
