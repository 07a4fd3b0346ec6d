"""The tokenizer and chat template against transformers' own apply_chat_template."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from actors.tokenizer import Message, StreamDecoder, Tokenizer, TokenizerError
from weights_tool.synth import SPECIAL_TOKENS, tokenizer_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2.5-Instruct's template (ChatML, default system prompt, tool branches), verbatim.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Exercises the sandbox's extras: tojson (no HTML escaping), namespace, loop controls,
# strftime_now, dict(), the {% generation %} tag, and whitespace control.
FEATURES_TEMPLATE = """{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    [{{ message['role'] }}] {{ message | tojson }} {{ dict(n=ns.count) | tojson(indent=1) }}
    {% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}{% endif %}
{% endfor %}
year={{ strftime_now('%Y') }} eos={{ eos_token }}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}
"""

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CONVERSATION = [
    {"role": "user", "content": "  Hello there, how are you? <b>&amp;</b>  "},
    {"role": "assistant", "content": "Très bien, merci! 日本語 🦀"},
    {"role": "user", "content": "Tell me about queues.\nTwo lines."},
]


def _backend(specials: list[str], bos: str | None) -> HFBackend:
    tok = HFBackend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["Hello there, how are you? Tell me about queues. Très bien, merci!"] * 20, trainer)
    if bos is not None:  # like Llama 3: encode(add_special_tokens=True) prepends BOS
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def _write_dir(path: Path, *, template: str, specials: list[str], bos: str | None, eos: str,
               generation_eos: list[str] = ()) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    backend = _backend(specials, bos)
    (path / "tokenizer.json").write_text(backend.to_str())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": eos,
              "bos_token": bos, "clean_up_tokenization_spaces": True}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_eos:
        ids = [backend.token_to_id(t) for t in generation_eos]
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return path


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory) -> Path:
    return _write_dir(tmp_path_factory.mktemp("llama3"), template=LLAMA3_TEMPLATE, specials=LLAMA3_SPECIALS,
                      bos="<|begin_of_text|>", eos="<|eot_id|>", generation_eos=["<|end_of_text|>", "<|eot_id|>"])


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return _write_dir(tmp_path_factory.mktemp("qwen"), template=QWEN25_TEMPLATE, specials=CHATML_SPECIALS,
                      bos=None, eos="<|im_end|>")


@pytest.fixture(scope="module")
def features_dir(tmp_path_factory) -> Path:
    return _write_dir(tmp_path_factory.mktemp("features"), template=FEATURES_TEMPLATE, specials=CHATML_SPECIALS,
                      bos=None, eos="<|im_end|>")


@pytest.fixture(scope="module")
def synthetic() -> Tokenizer:
    return Tokenizer.from_files({"tokenizer.json": tokenizer_json(512)})


def as_messages(chat: list[dict]) -> list[Message]:
    """The dicts transformers' templates take, as the Messages `encode_chat` takes."""
    return [Message(m["role"], m["content"]) for m in chat]


def _hf(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@pytest.mark.parametrize("template_dir", ["llama3_dir", "qwen_dir", "features_dir"])
@pytest.mark.parametrize("system", [None, "You are terse. Use <tags> & \"quotes\"."])
@pytest.mark.parametrize("num_turns", [1, 3])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(request, template_dir, system, num_turns, add_generation_prompt):
    path = request.getfixturevalue(template_dir)
    ours, hf = Tokenizer.from_dir(path), _hf(path)
    messages = CONVERSATION[:num_turns]
    hf_messages = ([{"role": "system", "content": system}] if system is not None else []) + messages

    text = ours.render_chat(messages, system=system, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = hf.apply_chat_template(hf_messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                 return_dict=False)
    if add_generation_prompt:
        assert ours.encode_chat(as_messages(messages), system=system) == ids


@pytest.mark.parametrize("template_dir", ["llama3_dir", "qwen_dir", "features_dir"])
@pytest.mark.parametrize("system", [None, "Answer in JSON."])
@pytest.mark.parametrize("prefill", ["{", "The label is", "Sure: «x»"])
def test_a_final_assistant_message_is_continued_as_transformers_continues_it(request, template_dir, system,
                                                                             prefill):
    path = request.getfixturevalue(template_dir)
    ours, hf = Tokenizer.from_dir(path), _hf(path)
    messages = [*CONVERSATION[:1], {"role": "assistant", "content": prefill}]
    hf_messages = ([{"role": "system", "content": system}] if system is not None else []) + messages

    text = ours.render_chat(messages, system=system, continue_final_message=True)
    assert text == hf.apply_chat_template(hf_messages, tokenize=False, continue_final_message=True)
    assert text.endswith(prefill)  # the prompt ends inside the assistant's turn: the answer continues it
    assert ours.encode_chat(as_messages(messages), system=system, continue_final_message=True) == hf.apply_chat_template(
        hf_messages, tokenize=True, continue_final_message=True, return_dict=False)


def test_a_template_that_drops_the_final_message_cannot_continue_it(synthetic):
    files = {"tokenizer.json": tokenizer_json(512),
             "chat_template.jinja": "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}"
                                    "{% endfor %}"}
    tok = Tokenizer.from_files(files)
    with pytest.raises(TokenizerError, match="cannot be continued"):
        tok.render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
                        continue_final_message=True)


def test_encode_chat_has_one_bos(llama3_dir):
    tok = Tokenizer.from_dir(llama3_dir)
    ids = tok.encode_chat(as_messages(CONVERSATION), system="sys")
    assert ids[0] == tok.bos_token_id
    assert ids.count(tok.bos_token_id) == 1
    # The post-processor adds BOS only when asked, as transformers' encode does.
    assert tok.encode("Hello", add_special_tokens=True) == [tok.bos_token_id] + tok.encode("Hello")


def test_render_chat_uses_the_template_file_in_newer_layouts(tmp_path, qwen_dir):
    files = {name: (qwen_dir / name).read_text() for name in ("tokenizer.json", "tokenizer_config.json")}
    files["chat_template.jinja"] = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
    tok = Tokenizer.from_files(files)
    assert tok.render_chat([{"role": "user", "content": "hi"}], system="s") == "system:s;user:hi;"


def test_encode_decode_round_trip_unicode(llama3_dir):
    tok = Tokenizer.from_dir(llama3_dir)
    text = "Grüße aus Zürich — 東京 🦀🚀 ½ x²\n\ttabs , and spaces ."
    assert tok.decode(tok.encode(text)) == text
    # clean_up_tokenization_spaces is set, and transformers (like us) ignores it for BPE.
    assert _hf(llama3_dir).decode(tok.encode(text), skip_special_tokens=True) == text
    with_special = tok.encode("<|eot_id|>done")
    assert tok.decode(with_special) == "done"
    assert tok.decode(with_special, skip_special_tokens=False) == "<|eot_id|>done"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40))
def test_stream_decoder_reproduces_full_decode(synthetic, text):
    # A special token's text encodes to the special token, which decoding skips.
    assume(not any(special in text for special in SPECIAL_TOKENS))
    ids = synthetic.encode(text)
    decoder = StreamDecoder(synthetic)
    streamed = "".join(decoder.push(i) for i in ids) + decoder.flush()
    assert streamed == synthetic.decode(ids) == text


def test_stream_decoder_holds_back_split_characters(synthetic):
    ids = synthetic.encode("a🦀")  # the crab is not in the corpus: four byte tokens
    assert len(ids) == 5
    decoder = StreamDecoder(synthetic)
    assert [decoder.push(i) for i in ids] == ["a", "", "", "", "🦀"]
    assert decoder.flush() == ""


def test_stream_decoder_releases_invalid_bytes(synthetic):
    lone_byte = synthetic.token_to_id("ÿ")  # byte 0xFF never occurs in UTF-8
    ids = [lone_byte] * 6 + synthetic.encode("ok")
    decoder = StreamDecoder(synthetic)
    pushed = [decoder.push(i) for i in ids]
    assert pushed[:4] == ["", "", "", "\ufffd" * 4]  # held at most four tokens, not to the end
    assert "".join(pushed) + decoder.flush() == synthetic.decode(ids) == "\ufffd" * 6 + "ok"


def test_stream_decoder_skips_special_tokens_and_flushes_partial(synthetic):
    decoder = StreamDecoder(synthetic)
    crab = synthetic.encode("🦀")
    assert "".join(decoder.push(i) for i in synthetic.encode("hi")) == "hi"
    assert decoder.push(5) == ""  # <|end|>
    assert [decoder.push(i) for i in crab[:2]] == ["", ""]
    assert decoder.flush() == "\ufffd"


def test_decode_skips_ids_the_tokenizer_lacks(synthetic):
    ids = synthetic.encode("hello")
    assert synthetic.decode([600, 100_000, -1, *ids, 131_072]) == "hello"


def test_eos_and_bos_ids_are_gathered(llama3_dir):
    tok = Tokenizer.from_dir(llama3_dir, eos_token_ids=[399])
    ids = {t: tok.token_to_id(t) for t in LLAMA3_SPECIALS}
    assert tok.eos_token_ids == frozenset({ids["<|eot_id|>"], ids["<|end_of_text|>"], 399})
    assert tok.bos_token_id == ids["<|begin_of_text|>"]
    assert tok.vocab_size == len(_hf(llama3_dir))


def test_legacy_special_tokens_map_and_added_token_dicts(tmp_path):
    tok_json = tokenizer_json(512)
    config = {"eos_token": {"content": "<|end_of_text|>", "lstrip": False}, "chat_template": "{{ eos_token }}"}
    files = {"tokenizer.json": tok_json, "tokenizer_config.json": json.dumps(config)}
    assert Tokenizer.from_files(files).eos_token_ids == frozenset({1})
    files["special_tokens_map.json"] = json.dumps({"eos_token": "<|end|>"})
    tok = Tokenizer.from_files(files)
    assert tok.eos_token_ids == frozenset({5})
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "<|end|>"


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="tokenizer.json missing from shard.zqs"):
        Tokenizer.from_files({"tokenizer_config.json": "{}"}, source="shard.zqs")


def test_broken_files_name_the_file(synthetic):
    tok_json = tokenizer_json(512)
    with pytest.raises(TokenizerError, match="tokenizer_config.json in x.zqs is not valid JSON"):
        Tokenizer.from_files({"tokenizer.json": tok_json, "tokenizer_config.json": "{"}, source="x.zqs")
    with pytest.raises(TokenizerError, match="tokenizer.json in x.zqs is not a valid tokenizer"):
        Tokenizer.from_files({"tokenizer.json": "{}"}, source="x.zqs")
    broken = json.dumps({"chat_template": "{% for m in messages %}{{ m }"})
    with pytest.raises(TokenizerError, match="tokenizer_config.json in x.zqs: chat template syntax error"):
        Tokenizer.from_files({"tokenizer.json": tok_json, "tokenizer_config.json": broken}, source="x.zqs")
    with pytest.raises(TokenizerError, match="chat_template.jinja"):
        Tokenizer.from_files({"tokenizer.json": tok_json, "chat_template.jinja": "{% if %}"})


def test_template_errors_become_tokenizer_errors():
    template = ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('must start with user') }}"
                "{% endif %}{{ messages.append(1) }}")
    tok = Tokenizer.from_files({"tokenizer.json": tokenizer_json(512),
                                "tokenizer_config.json": json.dumps({"chat_template": template})})
    with pytest.raises(TokenizerError, match="must start with user"):
        tok.render_chat([{"role": "assistant", "content": "x"}])
    with pytest.raises(TokenizerError, match="unsafe"):  # the sandbox is immutable
        tok.render_chat([{"role": "user", "content": "x"}])
    underscore = Tokenizer.from_files({"tokenizer.json": tokenizer_json(512),
                                       "chat_template.jinja": "{% set ns = namespace(_x=1) %}"})
    with pytest.raises(TokenizerError, match="underscore"):
        underscore.render_chat([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="message 0 must be a dict"):
        tok.render_chat([{"content": "no role"}])
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_files({"tokenizer.json": tokenizer_json(512)}).render_chat([{"role": "user", "content": ""}])


def test_strftime_now_is_today():
    tok = Tokenizer.from_files({"tokenizer.json": tokenizer_json(512),
                                "chat_template.jinja": "{{ strftime_now('%Y-%m-%d') }}"})
    before = datetime.date.today().isoformat()
    rendered = tok.render_chat([{"role": "user", "content": ""}])
    assert rendered in (before, datetime.date.today().isoformat())


def test_a_long_text_encodes_to_the_same_ids_on_the_gil_free_path(tiny_zqs):
    from actors.shard_header import open_zqs
    from actors.tokenizer import LONG_TEXT_CHARS

    reader, _, tokenizer = open_zqs(tiny_zqs)
    reader.close()
    text = "naïve café  digits 12345 — " * (LONG_TEXT_CHARS // 20)
    assert len(text) >= LONG_TEXT_CHARS
    assert tokenizer.encode(text) == tokenizer._backend.encode(text, add_special_tokens=False).ids
