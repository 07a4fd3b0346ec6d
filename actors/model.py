"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2, Qwen3 (gpt-fast-sized).

The module tree mirrors HF's names exactly (`model.layers.3.self_attn.q_proj.weight`),
so `load_state_dict` takes an HF state dict as it is and the layer-streamed loader
can write each checkpoint tensor straight into the parameter of the same name.

Weight groups and `wait_layer`. The forward pass touches the weights in groups,
in order, and calls `wait_layer(group)` right before it first reads a group:

    -1        model.embed_tokens
    0..L-1    model.layers.{i}            (layer i reads nothing else)
    L         model.norm and lm_head      (or embed_tokens again when tied)

A loader that streams weights in this order can therefore let prefill start
while later layers are still arriving: `wait_layer(i)` blocks until group i is
resident. `group_parameters(group)` names the parameters of each group.

Numerics follow HF: RMSNorm in fp32 then cast, RoPE tables computed in fp32 from
the positions and cast to the model dtype, logits returned as fp32.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from actors.kv_cache import KVCache
from actors.rope import apply_rope, rope_inv_freq, rope_tables
from weights_tool.architecture import ModelConfig, layer_index

WaitLayer = Callable[[int], None]
EMBEDDINGS_GROUP = -1
_HUGE_PAGE = 2 << 20
_PARAM_ALIGN = 4096


@dataclass(frozen=True)
class AttentionSpan:
    """What every layer's attention reads in one forward: keys at cached positions [start, end), masked so."""

    start: int
    end: int
    mask: torch.Tensor | None  # [S, T] bool, True where query i may attend to key j; None: all of them
    is_causal: bool  # queries and keys are the same positions: SDPA's built-in causal mask


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except for a single bf16 row on the CPU (decode at batch 1).

    There torch's GEMM path reads the weight at about 2/3 of the speed of its gemv
    kernel, and decoding is bound by reading weights, so `mv` decodes ~1.4x faster
    with the same fp32 accumulation. fp32 and fp16 are fastest through F.linear.
    """
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() == x.shape[-1]:
        y = torch.mv(weight, x.reshape(-1))
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], -1)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameter names) through `linear`, created uninitialised."""

    def reset_parameters(self) -> None:
        """Leave the weights as allocated: a loader or `init_weights` writes them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # As HF: normalise in fp32, cast back, then scale in the model dtype.
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = Linear(h, self.num_heads * d, bias=config.has_qkv_bias, dtype=dtype)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=config.has_qkv_bias, dtype=dtype)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=config.has_qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.num_heads * d, h, bias=config.has_o_bias, dtype=dtype)
        # Qwen3: RMSNorm over head_dim of each q and k head, before RoPE.
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype) if config.has_qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype) if config.has_qk_norm else None
        self.is_gqa = self.num_heads != self.num_kv_heads

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        span: AttentionSpan,
        input_pos: torch.Tensor,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        # x: [B, S, hidden]
        bsz, seq_len, _ = x.shape
        q = self.q_proj(x).view(bsz, seq_len, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(bsz, seq_len, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(bsz, seq_len, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # q: [B, H, S, D]; k, v: [B, H_kv, S, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if kv_cache is not None:
            k_all, v_all = kv_cache.update(input_pos, k, v)
            # k, v: [B, H_kv, T, D], the cached positions this chunk may attend to.
            k, v = k_all[:, :, span.start : span.end], v_all[:, :, span.start : span.end]
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=span.mask, is_causal=span.is_causal, enable_gqa=self.is_gqa
        )
        return self.o_proj(y.transpose(1, 2).reshape(bsz, seq_len, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, inter, bias = config.hidden_size, config.intermediate_size, config.has_mlp_bias
        self.gate_proj = Linear(h, inter, bias=bias, dtype=dtype)
        self.up_proj = Linear(h, inter, bias=bias, dtype=dtype)
        self.down_proj = Linear(inter, h, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        span: AttentionSpan,
        input_pos: torch.Tensor,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, span, input_pos, kv_cache)
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
            self._move_parameters_to_huge_pages()
        self.requires_grad_(False)
        self.eval()
        # inv_freq: [D/2] fp32. A plain attribute, not a buffer: the state dict holds only
        # checkpoint tensors, and model.to(bfloat16) must not round the frequencies.
        self._inv_freq = rope_inv_freq(config).to(self.device)
        self.kv_caches: list[KVCache] = []
        self._positions: torch.Tensor | None = None
        if initialise:
            self.init_weights()

    def _move_parameters_to_huge_pages(self) -> None:
        """Re-home every (still unwritten) parameter in one arena backed by 2 MB pages.

        Decoding streams every weight once per token; on 4 KB pages that walk costs a
        TLB miss every 4 KB, which on a virtualised host (nested page tables) made
        decode 1.5-2.4x slower in this project's benchmark. Each parameter stays its
        own tensor (a view), so loaders and load_state_dict still write it in place.
        The first, never-touched allocations are freed without having become resident.
        """
        params = [(module, name, p) for module in self.modules() for name, p in module._parameters.items()
                  if p is not None]
        sizes = [-(-p.nbytes // _PARAM_ALIGN) * _PARAM_ALIGN for _, _, p in params]
        arena = huge_page_arena(sum(sizes))
        offset = 0
        for (module, name, p), size in zip(params, sizes, strict=True):
            view = arena[offset : offset + p.nbytes].view(p.dtype).view(p.shape)
            module._parameters[name] = nn.Parameter(view, requires_grad=False)
            offset += size

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
        out = {}
        for name, param in self.named_parameters():
            i = layer_index(name)
            if i is not None:
                g = i
            elif name.startswith("model.embed_tokens."):
                g = EMBEDDINGS_GROUP
            else:
                g = num_layers
            if g == group:
                out[name] = param
        return out

    # ---- cache ---------------------------------------------------------------

    def setup_cache(self, max_seq_len: int, batch_size: int = 1) -> None:
        """Allocate every layer's static KV cache for `max_seq_len` positions (prompt + max_tokens)."""
        if max_seq_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                f"{self.config.max_position_embeddings}"
            )
        self.drop_cache()
        c = self.config
        self.kv_caches = [
            KVCache(batch_size, max_seq_len, c.num_kv_heads, c.head_dim, self.dtype, self.device)
            for _ in range(c.num_layers)
        ]
        self._positions = torch.arange(max_seq_len, device=self.device)

    def reset_cache(self) -> None:
        """Forget the cached sequence but keep the buffers for the next request of the same size."""
        for cache in self.kv_caches:
            cache.k_cache.zero_()
            cache.v_cache.zero_()

    def drop_cache(self) -> None:
        """Free the KV cache memory."""
        self.kv_caches = []
        self._positions = None

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
        start_pos = int(input_pos[0]) if self.kv_caches else None
        if start_pos is not None:
            self._check_cache_room(tokens, start_pos)
        return self._forward(tokens, input_pos, start_pos, wait_layer, last_only=False)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, wait_layer: WaitLayer | None = None) -> torch.Tensor:
        """Run the prompt tokens [B, S] from position 0 into the cache; logits [B, V] of the last position."""
        if not self.kv_caches:
            raise RuntimeError("prefill needs a KV cache: call setup_cache(max_seq_len) first")
        self._check_tokens(tokens)
        self._check_cache_room(tokens, 0)
        input_pos = self._positions[: tokens.shape[1]]
        return self._forward(tokens, input_pos, 0, wait_layer, last_only=True)[:, 0]

    @torch.inference_mode()
    def decode_step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        """Logits [B, V] for token [B, 1] at position `pos`, attending to the cache."""
        if not self.kv_caches:
            raise RuntimeError("decode_step needs a KV cache: call setup_cache(max_seq_len) first")
        if token.dim() != 2 or token.shape[1] != 1:
            raise ValueError(f"token must have shape [B, 1], got {list(token.shape)}")
        self._check_cache_room(token, pos)
        return self._forward(token, self._positions[pos : pos + 1], pos, None, last_only=True)[:, 0]

    def _forward(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        start_pos: int | None,
        wait_layer: WaitLayer | None,
        last_only: bool,
    ) -> torch.Tensor:
        span = self._attention_span(input_pos, start_pos)
        if self._inv_freq.device != input_pos.device:  # the model was moved with .to()
            self._inv_freq = self._inv_freq.to(input_pos.device)
        rope = rope_tables(self._inv_freq, input_pos, self.dtype)

        if wait_layer is not None:
            wait_layer(EMBEDDINGS_GROUP)
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            if wait_layer is not None:
                wait_layer(i)
            cache = self.kv_caches[i] if start_pos is not None else None
            x = layer(x, rope, span, input_pos, cache)
        if wait_layer is not None:
            wait_layer(self.config.num_layers)
        if last_only:
            x = x[:, -1:]
        x = self.model.norm(x)
        head = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return linear(x, head).float()

    def _attention_span(self, input_pos: torch.Tensor, start_pos: int | None) -> AttentionSpan:
        seq_len = input_pos.shape[0]
        window = self.config.sliding_window
        if start_pos is None:  # no cache: the chunk attends to itself
            start, end, kv_pos = 0, seq_len, input_pos
        else:
            end = start_pos + seq_len
            # The oldest position any query of this chunk may see; older keys are not even read.
            start = max(0, start_pos + 1 - window) if window is not None else 0
            kv_pos = self._positions[start:end]
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


def huge_page_arena(nbytes: int) -> torch.Tensor:
    """nbytes of CPU memory, 2 MB aligned, advised to be backed by transparent huge pages.

    A private anonymous mmap (a shared one would be shmem, which THP skips): nothing
    is resident until written. Where the kernel has no transparent huge pages the
    advice is a no-op and ordinary pages are used.
    """
    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(buf, dtype=torch.uint8)  # keeps buf alive
    skip = -arena.data_ptr() % _HUGE_PAGE
    return arena[skip : skip + nbytes]
