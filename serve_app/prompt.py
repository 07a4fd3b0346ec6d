"""From a Messages API request to the runtime's prompt: every check, before any compute.

The zeroqueue ingress and the queued baseline it is measured against both call
`prompt_for`, so a request is refused the same way, in the same order, by both: a final
assistant message (prefill), sampling parameters out of range, or a prompt plus
max_tokens beyond the model's window are 400 invalid_request_error.
"""

from __future__ import annotations

from actors.engine import ContextWindowError, GenerationRequest, Message, build_prompt
from actors.sampling import SamplingError, SamplingParams
from actors.tokenizer import Tokenizer, TokenizerError
from serve_app import api, errors


def prompt_for(req: api.MessagesRequest, tokenizer: Tokenizer, max_context: int) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids (chat template applied) and the sampling parameters; raises ApiError (400)."""
    if req.is_prefill:
        raise errors.invalid_request("messages: a final assistant message (prefill) is not supported")
    try:
        sampling = SamplingParams(
            max_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
            seed=req.seed, stop_sequences=tuple(req.stop_sequences),
        )
        messages = tuple(Message(r, t) for r, t in req.flat_messages())
        prompt = build_prompt(tokenizer, GenerationRequest(messages, sampling, req.system_text()), max_context)
    except (SamplingError, ContextWindowError, TokenizerError) as e:  # TokenizerError: a template's refusal
        raise errors.invalid_request(str(e)) from None
    return prompt, sampling


def count_prompt_tokens(req: api.CountTokensRequest, tokenizer: Tokenizer) -> int:
    """What `prompt_for` would feed the model, counted; raises ApiError (400) where the template refuses."""
    messages = [{"role": r, "content": t} for r, t in req.flat_messages()]
    try:
        return len(tokenizer.encode_chat(messages, system=req.system_text()))
    except TokenizerError as e:
        raise errors.invalid_request(str(e)) from None
