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

from dataclasses import dataclass

import torch

from actors.stop_sequences import MAX_STOP_SEQUENCE_CHARS, MAX_STOP_SEQUENCES


class SamplingError(ValueError):
    """Sampling parameters out of range; raised before any compute."""


MAX_TEMPERATURE = 2.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_sequences: tuple[str, ...] = ()
    min_tokens: int = 0  # no end-of-turn token is sampled before this many tokens
    ignore_eos: bool = False  # an end-of-turn token does not end the row: exactly max_tokens are made

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], "
                                f"got {self.min_tokens!r}")
        # The APIs bound it further: Anthropic's to [0, 1], OpenAI's to [0, 2].
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise SamplingError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if len(self.stop_sequences) > MAX_STOP_SEQUENCES:
            raise SamplingError(f"at most {MAX_STOP_SEQUENCES} stop_sequences are allowed")
        for s in self.stop_sequences:
            if not s or len(s) > MAX_STOP_SEQUENCE_CHARS:
                raise SamplingError(
                    f"each stop sequence must have 1 to {MAX_STOP_SEQUENCE_CHARS} characters, got {s!r}"
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


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
        return logits.argmax(dim=-1)
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
    return (probs / q).argmax(dim=-1)


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
