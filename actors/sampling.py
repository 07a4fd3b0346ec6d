"""Token sampling with the Anthropic Messages API's knobs.

Order of the logits processors is HF's (temperature, then top_k, then top_p), so a
seeded run here and `transformers`' sampling filter the same candidates.
temperature == 0 means greedy. A seed makes sampling reproducible: the random
draws come from a private `torch.Generator`, never the global RNG.

Two knobs benchmark clients send (vLLM's extensions): `min_tokens` keeps the end-of-turn
tokens out of the first `min_tokens` samples (their logits are masked, so the model says
something else instead), and `ignore_eos` makes an end-of-turn token an ordinary one, so
exactly `max_tokens` are generated. Stop sequences still end a row either way.
"""

from __future__ import annotations

import torch

from actors import cpu_kernels

# The settings live in a torch-free module; importers of actors.sampling find them here too.
from actors.sampling_params import MAX_TEMPERATURE, SamplingError, SamplingParams

__all__ = ["MAX_TEMPERATURE", "SamplingError", "SamplingParams", "greedy", "make_generator", "mask_tokens", "sample",
           "top_p_filter"]


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    if params.is_greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick the next token for each row. logits: [B, V] fp32 -> [B] int64."""
    if params.is_greedy:
        return greedy(logits)
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        logits = top_p_filter(logits, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    # Exponential-race sampling (argmax of p / Exp(1)) draws exactly from `probs`
    # without multinomial's cumulative-sum pass.
    q = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return greedy(probs / q)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token, the first on a tie. logits: [B, V] fp32 -> [B] int64. Through the actors'
    kernel where it is loaded (csrc/argmax.cpp: one call for every row; ~6 against torch's ~28 us for a row of
    32,000, timed by hand)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous()
            and (ext := cpu_kernels.loaded())):
        return ext.argmax_rows(logits)
    return logits.argmax(dim=-1)


def mask_tokens(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """`logits` with `token_ids` made impossible. logits: [B, V]; token_ids: [K] int64 (all < V)."""
    return logits.index_fill(-1, token_ids, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    # Keep the smallest set of tokens whose probability mass reaches top_p (HF's rule:
    # drop a token when the mass of strictly more likely tokens already exceeds top_p).
    sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= (1.0 - top_p)
    drop_sorted[..., -1:] = False  # always keep the most likely token
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
