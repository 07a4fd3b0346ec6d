"""A chat request and its prompt: every check the ingress makes before any compute, torch-free.

The ingress builds the prompt (chat template, context window) before it chooses an actor, and the
engine checks the same way for the requests it is handed directly (the CLI, tests, calibration).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from actors.sampling_params import SamplingParams
from actors.tokenizer import Message, Tokenizer


class ContextWindowError(ValueError):
    """The prompt plus max_tokens does not fit the model's context window."""


@dataclass(frozen=True)
class GenerationRequest:
    messages: tuple[Message, ...]
    sampling: SamplingParams
    system: str | None = None


def build_prompt(tokenizer: Tokenizer, request: GenerationRequest, max_context: int) -> list[int]:
    """The prompt token ids for `request`, refused before any compute when it cannot fit.

    Needs only the tokenizer and the context window, so the ingress can run it
    before choosing an actor.
    """
    prompt = encode_turns(tokenizer, request.messages, request.system)
    check_context_window(len(prompt), request.sampling.max_tokens, max_context)
    return prompt


def encode_turns(tokenizer: Tokenizer, messages: Sequence[Message], system: str | None) -> list[int]:
    """The conversation's prompt token ids, chat template applied; no context window checked (count_tokens)."""
    if not messages:
        raise ValueError("messages must not be empty")
    # A trailing assistant message is a prefill: the answer continues it.
    return tokenizer.encode_chat(messages, system=system, continue_final_message=messages[-1].role == "assistant")


def check_context_window(prompt_tokens: int, max_tokens: int, max_context: int) -> None:
    """Raise ContextWindowError unless the prompt plus max_tokens fits the context window."""
    need = prompt_tokens + max_tokens
    if need > max_context:
        raise ContextWindowError(
            f"prompt is {prompt_tokens} tokens and max_tokens is {max_tokens}: "
            f"{need} exceeds the context window of {max_context}"
        )
