"""Decode steps through `torch.compile`: static KV slabs, buckets of rows and positions, compilations counted.

Where `actor.is_compiled` is on, the engine gives each joining row a slot of this module's static KV slabs (one
pair per layer, [num_slots + 1, H_kv, max_seq_len, D]; the last slot is the padding rows') when one is free and the
row's prompt + max_tokens fits; the row's caches are then views of its slot (`KVCache` over the slab's [1, ...]
slice), so its prompt chunks run eagerly into the same memory. A step in which every row decodes one token from a
slot runs through `CompiledDecode.decode`:

- the rows are padded to the next **row bucket** (padding rows read and write the padding slot only), and every
  row's keys are read up to the next **position bucket** past the furthest row's position, masked per row (causal,
  and the sliding window's lower edge). A step's shapes are therefore one of len(row_buckets) x len(position
  buckets), each one compilation, and the compiled graph (fullgraph: no Python in it) holds every layer of the step:
  the projections, RoPE, the slab writes, attention, the MLP and the head.
- `compile_buckets()` compiles (or, from inductor's cache on disk, loads) each bucket up to a row and position
  count, on the stepping thread before the actor is ready; a step whose bucket has not been compiled runs eagerly
  (`is_compiled_for`), so no request pays a compilation. `num_compiles` counts the backend's compilations: dynamo
  guards may recompile on anything else, and a test holds that count to the buckets.

The backend is inductor; on CUDA with its CUDA graphs (`triton.cudagraphs`): the slabs are static addresses
(`mark_static_address`) and the step's other inputs are small index tensors, which is what lets a captured graph
replay. The compiled step computes what the eager one does, in another order of float operations: fp32 greedy
tokens are the same (tested), bits are not promised.

It reads the model's plain weights: packed ones (actors/packed_weights.py) are the actors' own kernels, which
inductor cannot see into, so a compiled actor does not pack. On a CPU where those kernels run they are the faster
step (benchmarks/results/engine_*.md, the compiled rows); `is_compiled` is off there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from actors.kv_cache import KVCache
from actors.packed_weights import packed_kernel_of
from actors.rope import apply_rope

log = logging.getLogger(__name__)

MIN_POSITION_BUCKET = 64  # the smallest span read: shorter ones cost little and would multiply compilations


def powers_of_two(first: int, last: int) -> tuple[int, ...]:
    """first, 2 first, 4 first, ... below `last`, then `last` itself (which need not be a power of two)."""
    out, n = [], first
    while n < last:
        out.append(n)
        n *= 2
    return (*out, last)


def bucket_of(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n, or None when n is past the last."""
    return next((b for b in buckets if b >= n), None)


class CompiledDecode:
    """A model's decode step compiled over static KV slabs, for up to `num_slots` rows of `max_seq_len` positions."""

    def __init__(self, model, num_slots: int, max_seq_len: int) -> None:
        if packed_kernel_of(model) is not None:  # packing packs every linear, the head and the layer loop with them
            raise ValueError("a compiled step reads the model's plain weights: compile before packing, or not at all")
        if num_slots < 1 or not 1 <= max_seq_len <= model.config.max_position_embeddings:
            raise ValueError(f"need num_slots >= 1 and 1 <= max_seq_len <= the model's "
                             f"{model.config.max_position_embeddings}, got {num_slots}, {max_seq_len}")
        self.model = model
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        # Buckets: 1, 2, 4, ... rows up to the slots; 64, 128, ... positions up to the slabs' (MIN_POSITION_BUCKET).
        self.row_buckets = powers_of_two(1, num_slots)
        self.position_buckets = powers_of_two(MIN_POSITION_BUCKET, max_seq_len)
        c = model.config
        shape = (num_slots + 1, c.num_kv_heads, max_seq_len, c.head_dim)
        # k, v slabs: [N + 1, H_kv, S, D] per layer; slot N is written and read by padding rows only.
        self._slabs = [(torch.zeros(shape, dtype=model.dtype, device=model.device),
                        torch.zeros(shape, dtype=model.dtype, device=model.device)) for _ in range(c.num_layers)]
        if model.device.type == "cuda":
            for k, v in self._slabs:  # a captured CUDA graph replays on these very buffers
                torch._dynamo.mark_static_address(k)
                torch._dynamo.mark_static_address(v)
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._key_positions = torch.arange(max_seq_len, device=model.device)
        self._compiled_buckets: set[tuple[int, int]] = set()
        self.num_compiles = 0
        self.num_steps = 0  # steps `decode` ran (compile_buckets' runs not counted)
        # Dynamo keeps at most `recompile_limit` versions of a compiled region (then fails, with fullgraph): every
        # bucket, with room for guards that fail on something else (the tests hold num_compiles to the buckets).
        # Isolated: another instance's versions (another model's slabs) are not this one's.
        limit = 2 * len(self.row_buckets) * len(self.position_buckets)
        self._step = torch.compile(self._decode, backend=self._backend, dynamic=False, fullgraph=True,
                                   recompile_limit=limit, isolate_recompiles=True)

    # ---- slots -------------------------------------------------------------------------------

    def claim(self, num_positions: int) -> tuple[int, list[KVCache]] | None:
        """A free slot for a row of `num_positions` (prompt + max_tokens) and its caches (views of the slot), or
        None: every slot is taken, or the row is longer than the slabs."""
        if num_positions > self.max_seq_len or not self._free:
            return None
        slot = self._free.pop()
        return slot, [KVCache.over(k[slot : slot + 1], v[slot : slot + 1]) for k, v in self._slabs]

    def release(self, slot: int) -> None:
        """The slot's row has left: another may take it (its stale keys are masked out by position)."""
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not a claimed slot of {self.num_slots}")
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def kv_bytes(self) -> int:
        """Bytes the slabs hold, allocated once whatever the rows use."""
        return sum(k.nbytes + v.nbytes for k, v in self._slabs)

    # ---- steps -------------------------------------------------------------------------------

    def bucket(self, num_rows: int, max_position: int) -> tuple[int, int] | None:
        """The (rows, positions) bucket of a step of `num_rows` rows whose furthest new token is at `max_position`."""
        rows, positions = bucket_of(num_rows, self.row_buckets), bucket_of(max_position + 1, self.position_buckets)
        return None if rows is None or positions is None else (rows, positions)

    def is_compiled_for(self, num_rows: int, max_position: int) -> bool:
        return self.bucket(num_rows, max_position) in self._compiled_buckets

    def compile_buckets(self, max_rows: int | None = None, max_positions: int | None = None) -> int:
        """Compile every bucket up to `max_rows` rows and `max_positions` positions (None: all); returns how many
        compilations that took (0 where inductor's cache on disk or an earlier call had them). Runs each bucket once
        on the padding slot, so it must run where steps run (the stepping thread, between steps)."""
        before = self.num_compiles
        top_rows = bucket_of(min(max_rows or self.num_slots, self.num_slots), self.row_buckets)
        top_positions = bucket_of(min(max_positions or self.max_seq_len, self.max_seq_len), self.position_buckets)
        rows = [b for b in self.row_buckets if b <= top_rows]
        positions = [b for b in self.position_buckets if b <= top_positions]
        for r in rows:
            for p in positions:
                if (r, p) not in self._compiled_buckets:
                    with torch.inference_mode():  # as steps run: a guard on the mode would recompile each bucket
                        self._run((r, p), [], [], [])  # every row a padding row
                    self._compiled_buckets.add((r, p))
        log.info("compiled decode step: %d buckets ready (%d compilations)", len(self._compiled_buckets),
                 self.num_compiles - before)
        return self.num_compiles - before

    def decode(self, tokens: Sequence[int], slots: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Logits [R, V] (fp32) of each row's token at its position, attending to its slot; writes each new key and
        value there. The caller checks `is_compiled_for` first (an uncompiled bucket would compile here)."""
        self.num_steps += 1
        return self._run(self.bucket(len(tokens), max(positions)), tokens, slots, positions)[: len(tokens)]

    def _run(self, bucket: tuple[int, int], tokens: Sequence[int], slots: Sequence[int],
             positions: Sequence[int]) -> torch.Tensor:
        """The compiled step on the rows padded to the bucket: logits [bucket rows, V]."""
        rows, span = bucket
        pad = rows - len(tokens)
        # Padding rows: token 0 at position 0 of the padding slot, whose logits are dropped. One tensor, one copy
        # to the device; its rows are views of one layout in every call, so no guard on strides differs.
        index = torch.tensor([[*tokens, *[0] * pad], [*slots, *[self.num_slots] * pad], [*positions, *[0] * pad]],
                             dtype=torch.long, device=self.model.device)
        return self._step(index[0], index[1], index[2], self._key_positions[:span])

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        from torch._inductor.compile_fx import compile_fx

        self.num_compiles += 1
        return compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": self.model.device.type == "cuda"})

    def _decode(self, tokens: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                key_pos: torch.Tensor) -> torch.Tensor:
        """The traced step. tokens, slots, pos: [R]; key_pos: [P], the positions every row's keys are read at."""
        model, c = self.model, self.model.config
        num_rows, num_heads, num_kv, d = tokens.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        x = model.embed(tokens).unsqueeze(1)  # [R, 1, hidden]: each row a sequence of one token
        cos, sin = model.rope(pos)  # [R, D]
        rope = (cos[:, None, None, :], sin[:, None, None, :])  # [R, 1, 1, D]: over heads and the one token
        visible = key_pos[None, :] <= pos[:, None]  # [R, P]: causal; stale keys of a slot's last row are past pos
        if c.sliding_window is not None:
            visible &= key_pos[None, :] > pos[:, None] - c.sliding_window
        mask = visible[:, None, None, :]  # [R, 1, 1, P]: the same for every head and grouped query
        span = key_pos.shape[0]
        for layer, (k_slab, v_slab) in zip(model.model.layers, self._slabs, strict=True):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = _linear(attn.q_proj, h).view(num_rows, 1, num_heads, d)
            k = _linear(attn.k_proj, h).view(num_rows, 1, num_kv, d)
            v = _linear(attn.v_proj, h).view(num_rows, 1, num_kv, d)
            if attn.q_norm is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            # q: [R, H, 1, D]; k, v: [R, H_kv, 1, D]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = apply_rope(q, rope), apply_rope(k, rope)
            k_slab[slots, :, pos] = k[:, :, 0]  # [R, H_kv, D] at (slot, position) of each row
            v_slab[slots, :, pos] = v[:, :, 0]
            keys = k_slab[:, :, :span].index_select(0, slots)  # [R, H_kv, P, D]
            values = v_slab[:, :, :span].index_select(0, slots)
            # A KV head's G query heads as G queries of that head: [R, H_kv, G, D], as the eager step groups them.
            grouped = q.reshape(num_rows, num_kv, num_heads // num_kv, d)
            y = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
            h = x + _linear(attn.o_proj, y.reshape(num_rows, 1, num_heads * d))
            mlp = layer.mlp
            m = layer.post_attention_layernorm(h)
            x = h + _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, m)) * _linear(mlp.up_proj, m))
        x = model.model.norm(x[:, 0])  # [R, hidden]
        head = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
        return F.linear(x, head).float()


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # F.linear itself: the eager `linear`'s one-row kernel choice times kernels in Python, which a graph cannot hold.
    return F.linear(x, module.weight, module.bias)
