"""The generation API the actors call: chat messages in, a stream of text deltas out.

One `Engine` wraps one loaded model and its tokenizer and serves one request at a
time (an actor runs one request at a time). `prepare()` does every check that can
fail — sampling ranges, the chat template, the context window — before any
compute, so a bad request costs nothing. `generate()` then yields `TokenEvent`s as
tokens are sampled and ends with exactly one `FinishEvent`; a `cancel` callable
is polled between decode steps so a cancelled stream stops within one step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from actors.sampling import SamplingParams, make_generator, sample
from actors.stop_sequences import StopSequenceFilter
from actors.tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger(__name__)


class ContextWindowError(ValueError):
    """The prompt plus max_tokens does not fit the model's context window."""


@dataclass(frozen=True)
class Message:
    role: str  # "user" | "assistant"
    content: str


@dataclass(frozen=True)
class GenerationRequest:
    messages: tuple[Message, ...]
    sampling: SamplingParams
    system: str | None = None


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # text released by this token; "" while held back (split UTF-8, stop-sequence prefix)
    num_output_tokens: int
    time: float  # epoch seconds when the token was sampled


@dataclass(frozen=True)
class FinishEvent:
    stop_reason: str  # "end_turn" | "max_tokens" | "stop_sequence" | "cancelled"
    stop_sequence: str | None
    input_tokens: int
    output_tokens: int
    compute_start: float  # epoch seconds; prefill began
    first_token_time: float | None
    last_token_time: float | None


class Engine:
    def __init__(self, model, tokenizer: Tokenizer, *, max_context: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        window = model.config.max_position_embeddings
        self.max_context = min(window, max_context) if max_context else window
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(model.config.eos_token_ids)
        self.device = next(model.parameters()).device

    def prepare(self, request: GenerationRequest) -> list[int]:
        """Tokenize and validate; raises before any compute. Returns the prompt token ids."""
        return build_prompt(self.tokenizer, request, self.max_context)

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        cancel: Callable[[], bool] | None = None,
        wait_layer: Callable[[int], None] | None = None,
    ) -> Iterator[TokenEvent | FinishEvent]:
        """Stream one completion of `prompt` (token ids from `prepare`)."""
        model = self.model
        model.setup_cache(max_seq_len=len(prompt) + params.max_tokens)
        generator = make_generator(params, self.device)
        decoder = StreamDecoder(self.tokenizer)
        stops = StopSequenceFilter(params.stop_sequences)
        first_time = last_time = None
        stop_reason, stop_sequence = "max_tokens", None
        num_out = 0
        compute_start = time.time()
        try:
            tokens = torch.tensor([prompt], dtype=torch.long, device=self.device)
            logits = model.prefill(tokens, wait_layer=wait_layer)
            pos = len(prompt)
            while True:
                token = sample(logits, params, generator)  # [1]
                token_id = int(token.item())
                num_out += 1
                last_time = time.time()
                first_time = first_time or last_time
                is_eos = token_id in self.eos_token_ids
                is_last = is_eos or num_out >= params.max_tokens
                # Exactly one event per sampled token; the last one also flushes held-back text.
                piece = decoder.flush() if is_eos else decoder.push(token_id)
                if is_last and not is_eos:
                    piece += decoder.flush()
                text, matched = stops.push(piece)
                if matched is None and is_last:
                    text += stops.flush()
                yield TokenEvent(token_id, text, num_out, last_time)
                if matched is not None:
                    stop_reason, stop_sequence = "stop_sequence", matched
                    break
                if is_eos:
                    stop_reason = "end_turn"
                    break
                if is_last:
                    break
                if cancel is not None and cancel():
                    stop_reason = "cancelled"
                    break
                logits = model.decode_step(token.view(1, 1), pos)
                pos += 1
        finally:
            # The KV cache is request-sized; a hot actor must not carry it into the next request.
            model.drop_cache()
        yield FinishEvent(
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            input_tokens=len(prompt),
            output_tokens=num_out,
            compute_start=compute_start,
            first_token_time=first_time,
            last_token_time=last_time,
        )


def build_prompt(tokenizer: Tokenizer, request: GenerationRequest, max_context: int) -> list[int]:
    """The prompt token ids for `request`, refused before any compute when it cannot fit.

    Needs only the tokenizer and the context window, so the ingress can run it
    before choosing an actor.
    """
    if not request.messages:
        raise ValueError("messages must not be empty")
    prompt = tokenizer.encode_chat(_as_dicts(request.messages), system=request.system)
    need = len(prompt) + request.sampling.max_tokens
    if need > max_context:
        raise ContextWindowError(
            f"prompt is {len(prompt)} tokens and max_tokens is {request.sampling.max_tokens}: "
            f"{need} exceeds the context window of {max_context} tokens"
        )
    return prompt


def _as_dicts(messages: tuple[Message, ...]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]
