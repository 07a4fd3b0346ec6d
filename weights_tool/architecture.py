"""What a Llama-family checkpoint is, read from its HF `config.json`.

`ModelConfig` is the one parsed, validated description of a model that every
other part uses: the runtime builds layers from it, the loaders check tensor
names and shapes against `tensor_shapes()`, the synthesiser writes checkpoints
from it, and the router accounts memory with `weight_bytes()` and
`kv_bytes_per_token()`.

Tensor names are HF's own (`model.layers.3.self_attn.q_proj.weight`), so a
checkpoint, a `.zqs` file and the runtime's state dict all speak one language.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weights_tool.dtypes import MODEL_DTYPE_BYTES

KV_INT8_SCALE_BYTES = 4  # an 8-bit KV cache's fp32 scale, one a position and KV head
KV_INT8_POSITION_MULTIPLE = 16  # an 8-bit cache's positions, rounded up to its kernel's blocks of 16 keys

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class CheckpointError(ValueError):
    """A checkpoint that cannot be served as it is; the message names what is wrong."""


class UnsupportedArchitectureError(CheckpointError):
    pass


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only: wavelengths between the two bounds are smoothly interpolated.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    has_qkv_bias: bool
    has_o_bias: bool
    has_mlp_bias: bool
    has_qk_norm: bool
    sliding_window: int | None
    dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse an HF config.json dict, refusing what the runtime cannot run exactly."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise CheckpointError(f"config.json lacks required field {e.args[0]!r}") from None
        num_kv = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        if num_heads % num_kv:
            raise CheckpointError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}"
            )
        if min(hidden, num_heads, num_layers, vocab, inter, head_dim) <= 0:
            raise CheckpointError("config.json has a non-positive size field")
        if cfg.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported hidden_act {cfg['hidden_act']!r}; supported: silu")

        theta, scaling = _parse_rope(cfg)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            # Qwen2/3 configs carry a sliding_window that is only live when switched on.
            sliding = sliding if cfg.get("use_sliding_window", False) else None
        if sliding is not None and arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            raise CheckpointError("Qwen use_sliding_window=true is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(x) for x in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
        if dtype not in MODEL_DTYPE_BYTES:
            raise CheckpointError(f"unsupported dtype {dtype!r}; supported: {', '.join(MODEL_DTYPE_BYTES)}")
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            has_qkv_bias=is_qwen2 or attention_bias,
            has_o_bias=attention_bias and not is_qwen2,
            has_mlp_bias=bool(cfg.get("mlp_bias", False)),
            has_qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(sliding) if sliding is not None else None,
            dtype=dtype,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hf_config=dict(cfg),
        )

    # ---- tensors -------------------------------------------------------------

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of this config must hold, by HF name, in load order."""
        h = self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            shapes.update(self.layer_tensor_shapes(i))
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def layer_tensor_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        h, d, inter = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        p = f"model.layers.{i}."
        s: dict[str, tuple[int, ...]] = {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if self.has_qkv_bias:
            s[p + "self_attn.q_proj.bias"] = (q,)
            s[p + "self_attn.k_proj.bias"] = (kv,)
            s[p + "self_attn.v_proj.bias"] = (kv,)
        if self.has_o_bias:
            s[p + "self_attn.o_proj.bias"] = (h,)
        if self.has_mlp_bias:
            s[p + "mlp.gate_proj.bias"] = (inter,)
            s[p + "mlp.up_proj.bias"] = (inter,)
            s[p + "mlp.down_proj.bias"] = (h,)
        if self.has_qk_norm:
            s[p + "self_attn.q_norm.weight"] = (d,)
            s[p + "self_attn.k_norm.weight"] = (d,)
        return s

    def check_tensors(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Raise CheckpointError naming the first missing, mis-shaped or unexpected tensor."""
        expected = self.tensor_shapes()
        for name, shape in expected.items():
            if name not in shapes:
                raise CheckpointError(f"checkpoint is missing tensor {name} (expected shape {list(shape)})")
            if tuple(shapes[name]) != shape:
                raise CheckpointError(
                    f"tensor {name} has shape {list(shapes[name])}, expected {list(shape)}"
                )
        # Tied checkpoints sometimes also store lm_head; it is ignored, everything else is an error.
        extra = [n for n in shapes if n not in expected and not n.endswith("rotary_emb.inv_freq")
                 and not (n == "lm_head.weight" and self.tie_word_embeddings)]
        if extra:
            raise CheckpointError(f"checkpoint has unexpected tensor {extra[0]}")

    # ---- accounting ----------------------------------------------------------

    def num_params(self) -> int:
        total = 0
        for shape in self.tensor_shapes().values():
            n = 1
            for dim in shape:
                n *= dim
            total += n
        return total

    def weight_bytes(self, dtype: str | None = None) -> int:
        return self.num_params() * MODEL_DTYPE_BYTES[dtype or self.dtype]

    def kv_bytes_per_token(self, dtype: str | None = None, is_int8: bool = False) -> int:
        # k and v, every layer: [H_kv, D] each, in `dtype` (the model's), or 8-bit with an fp32 scale a head
        # (actors/kv_cache.py, the actors' `kv_dtype: int8`).
        if is_int8:
            return 2 * self.num_layers * self.num_kv_heads * (self.head_dim + KV_INT8_SCALE_BYTES)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * MODEL_DTYPE_BYTES[dtype or self.dtype]


def _arch_from_model_type(model_type: Any) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }.get(str(model_type), str(model_type))


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files write
    # `rope_theta` + `rope_scaling`. Both appear on real checkpoints.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, RopeScaling()
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )
