"""`chat_prompt`: the one path from either API's request to the runtime's prompt, every check before compute."""

from __future__ import annotations

import json

import pytest

from actors.tokenizer import Message, Tokenizer
from serve_app.errors import ApiError
from serve_app.prompt import chat_prompt
from weights_tool.synth import CHAT_TEMPLATE, SPECIAL_TOKENS, tokenizer_json

MAX_CONTEXT = 64


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    config = json.dumps({"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[5]})
    return Tokenizer.from_files({"tokenizer.json": tokenizer_json(512), "tokenizer_config.json": config,
                                 "chat_template.jinja": CHAT_TEMPLATE})


def test_no_max_tokens_means_the_rest_of_the_context_window(tokenizer):
    prompt, sampling = chat_prompt([Message("user", "hi")], None, tokenizer, MAX_CONTEXT, max_tokens=None)
    assert sampling.max_tokens == MAX_CONTEXT - len(prompt) > 0


def test_a_prompt_that_fills_the_window_leaves_no_room_and_is_refused(tokenizer):
    with pytest.raises(ApiError) as e:
        chat_prompt([Message("user", "word " * 200)], None, tokenizer, MAX_CONTEXT, max_tokens=None)
    assert e.value.status == 400 and "context window" in e.value.message


def test_a_final_assistant_message_is_continued_not_closed(tokenizer):
    prefilled, _ = chat_prompt([Message("user", "hi"), Message("assistant", "Sure")], None, tokenizer, MAX_CONTEXT, max_tokens=4)
    closed, _ = chat_prompt([Message("user", "hi"), Message("assistant", "Sure"), Message("user", "ok")], None, tokenizer, MAX_CONTEXT,
                            max_tokens=4)
    assert tokenizer.decode(prefilled, skip_special_tokens=False).endswith("<|assistant|>\nSure")
    assert closed[:len(prefilled)] == prefilled  # the closed turn goes on where the prefill stops


@pytest.mark.parametrize("kwargs, naming", [
    ({"max_tokens": 4, "temperature": 2.5}, "temperature"),
    ({"max_tokens": None, "top_p": 0.0}, "top_p"),  # checked before the template runs for the window
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_sampling_parameters_are_a_400_naming_them(tokenizer, kwargs, naming):
    with pytest.raises(ApiError) as e:
        chat_prompt([Message("user", "hi")], None, tokenizer, MAX_CONTEXT, **kwargs)
    assert e.value.status == 400 and naming in e.value.message


def test_a_prefill_ending_in_whitespace_is_refused_as_anthropic_refuses_it(tokenizer):
    with pytest.raises(ApiError) as e:
        chat_prompt([Message("user", "hi"), Message("assistant", "Sure ")], None, tokenizer, MAX_CONTEXT, max_tokens=4)
    assert e.value.status == 400 and "whitespace" in e.value.message
