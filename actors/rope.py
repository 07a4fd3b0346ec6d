"""Rotary position embedding as HF computes it: inverse frequencies with the checkpoint's
scaling (none, linear, llama3), cos / sin tables in fp32 cast to the model dtype, and the
rotation itself as one fused multiply-add.
"""

from __future__ import annotations

import torch

from weights_tool.architecture import ModelConfig, RopeScaling


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] in fp32, with the checkpoint's rope scaling applied (as HF)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, those between interpolated.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(
    inv_freq: torch.Tensor, input_pos: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [S, D] for the positions, computed in fp32 and cast like HF.

    The sin table's first half is negated so that rotate_half(x) * sin becomes
    roll(x) * signed_sin: one kernel instead of slice, negate and concatenate.
    """
    freqs = input_pos[:, None].float() * inv_freq[None, :]  # [S, D/2]
    cos = freqs.cos()
    sin = freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # x: [B, H, S, D]; cos, signed_sin: [S, D]
    cos, signed_sin = rope
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)
