"""From an API request to the runtime's prompt: every check, before any compute.

Both APIs (the Messages API in api.py, OpenAI's Chat Completions in openai_api.py) and the
queued baseline call `chat_prompt`, so a request is refused the same way, in the same
order, by all: sampling parameters out of range, a template's refusal, or a prompt plus
max_tokens beyond the model's window are 400 invalid_request_error.

A final assistant message is a prefill, as in Anthropic's API: the prompt ends inside
that message (transformers' `continue_final_message=True`), and the answer holds only its
continuation. Clients use it to force a format, e.g. a prefill of `{` for a JSON object.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.chat import ContextWindowError, GenerationRequest, build_prompt, encode_turns
from actors.sampling_params import SamplingError, SamplingParams
from actors.tokenizer import Message, Tokenizer, TokenizerError
from serve_app import api, errors


def chat_prompt(messages: Sequence[Message], system: str | None, tokenizer: Tokenizer, max_context: int,
                *, max_tokens: int | None, **sampling: Any) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids (chat template applied) and the sampling parameters; raises ApiError (400).

    `sampling` holds `SamplingParams`' other fields (temperature, top_k, ...; stop_sequences as a sequence).
    `max_tokens=None` (OpenAI's default) is the rest of the context window after the prompt.
    """
    try:
        if messages and messages[-1].role == "assistant" and messages[-1].content != messages[-1].content.rstrip():
            # As Anthropic's API: the continuation would start after whitespace the template may drop.
            raise TokenizerError("messages: a final assistant message must not end with whitespace")
        params = sampling | {"stop_sequences": tuple(sampling.get("stop_sequences", ()))}
        turns = tuple(messages)
        if max_tokens is None:
            # Checks the parameters before the template runs; min_tokens against the rest, after it.
            probe = SamplingParams(max_tokens=1, **(params | {"min_tokens": 0}))
            prompt = build_prompt(tokenizer, GenerationRequest(turns, probe, system), max_context)
            return prompt, SamplingParams(max_tokens=max_context - len(prompt), **params)
        limited = SamplingParams(max_tokens=max_tokens, **params)
        return build_prompt(tokenizer, GenerationRequest(turns, limited, system), max_context), limited
    except (SamplingError, ContextWindowError, TokenizerError) as e:  # TokenizerError: a template's refusal
        raise errors.invalid_request(str(e)) from None


def prompt_for(req: api.MessagesRequest, tokenizer: Tokenizer, max_context: int) -> tuple[list[int], SamplingParams]:
    """`chat_prompt` for a Messages API request."""
    return chat_prompt(req.turns(), req.system_text(), tokenizer, max_context, max_tokens=req.max_tokens,
                       temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
                       stop_sequences=req.stop_sequences)


def count_prompt_tokens(req: api.CountTokensRequest, tokenizer: Tokenizer) -> int:
    """What `prompt_for` would feed the model, counted; raises ApiError (400) where the template refuses."""
    try:
        return len(encode_turns(tokenizer, req.turns(), req.system_text()))
    except TokenizerError as e:
        raise errors.invalid_request(str(e)) from None
