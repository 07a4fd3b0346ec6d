"""A model's tokenizer and chat template, loaded from its HF tokenizer files.

The vocabulary comes from `tokenizer.json` through the `tokenizers` library; the chat
template is rendered with jinja2 in the same sandbox, with the same globals and filters,
as `transformers`' `apply_chat_template`, so a prompt here is token-for-token the prompt
the model was trained on. Files come from a directory or, for a `.zqs` shard file that
embeds them, from a `{filename: text}` dict; nothing needs a directory.

Two details follow transformers 5 on purpose: `add_bos_token` in tokenizer_config.json is
ignored when tokenizer.json exists (its post-processor decides), and decode never applies
`clean_up_tokenization_spaces` (transformers skips it for BPE, where it corrupts text).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Message:
    """One turn of a chat, the one shape a conversation has from the API models to the template: both APIs
    build these, the engine's requests carry them, and `encode_chat` hands them to the template as the dicts
    templates are written for."""

    role: str  # "user" | "assistant"
    content: str


# Every file a tokenizer may be built from; a packer embeds whichever of these exist.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
# The named special tokens transformers hands to every template (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# A UTF-8 character is at most 4 bytes and a byte-level token holds at least one byte.
_MAX_HELD_TOKENS = 4
_REPLACEMENT_CHAR = "\ufffd"


# From this length on a text is encoded with the GIL released (see `Tokenizer.encode`).
LONG_TEXT_CHARS = 64 << 10


# transformers' marker for the end of a message to continue (its chat_template_utils): the same text,
# so a template that treats it specially does so for both.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TokenizerError(ValueError):
    """Tokenizer files that cannot be used, or a conversation the chat template refuses."""


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None,
        special_tokens: Mapping[str, str],
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        template_source: str = "chat template",
    ):
        self._backend = backend
        self.special_tokens = dict(special_tokens)  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self._template = _compile_template(chat_template, template_source) if chat_template else None

    # ---- loading -------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path, *, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Load from an HF model directory; `eos_token_ids` adds the model config's eos ids."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"{path / 'tokenizer.json'} not found")
        files = {name: (path / name).read_text(encoding="utf-8") for name in TOKENIZER_FILES if (path / name).is_file()}
        return cls.from_files(files, eos_token_ids=eos_token_ids, source=str(path))

    @classmethod
    def from_files(
        cls, files: Mapping[str, str], *, eos_token_ids: Iterable[int] = (), source: str = "embedded files"
    ) -> Tokenizer:
        """Load from `{filename: file text}` (files embedded in a shard file); `source` names them in errors."""
        if "tokenizer.json" not in files:
            raise TokenizerError(f"tokenizer.json missing from {source}")
        try:
            backend = tokenizers.Tokenizer.from_str(files["tokenizer.json"])
        except Exception as e:
            raise TokenizerError(f"tokenizer.json in {source} is not a valid tokenizer: {e}") from e
        config = _read_json(files, "tokenizer_config.json", source)
        generation = _read_json(files, "generation_config.json", source)

        special = _special_tokens(config)
        if "added_tokens_decoder" not in config:
            # transformers' legacy path: special_tokens_map.json overrides tokenizer_config.json.
            special.update(_special_tokens(_read_json(files, "special_tokens_map.json", source)))

        template, template_file = _chat_template(files, config, source)
        eos_ids = set(eos_token_ids) | set(_id_list(generation.get("eos_token_id")))
        if (eos_id := _token_id(backend, special.get("eos_token"))) is not None:
            eos_ids.add(eos_id)
        bos_id = _token_id(backend, special.get("bos_token"))
        if bos_id is None and isinstance(generation.get("bos_token_id"), int):
            bos_id = generation["bos_token_id"]
        return cls(
            backend,
            chat_template=template,
            special_tokens=special,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            template_source=f"{template_file} in {source}",
        )

    # ---- text <-> ids --------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) >= LONG_TEXT_CHARS:
            # `encode_batch` releases the GIL while it works (`encode` holds it throughout), so an
            # ingress tokenizing a long prompt on a thread keeps its event loop: the loop's worst lag
            # for a 10k-message body in benchmarks/results/parse_offload.md.
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # A model's vocabulary can be larger than its tokenizer's (padded embeddings,
        # synthetic models): ids with no token decode to nothing rather than failing.
        known = [i for i in ids if 0 <= i < self.vocab_size]
        return self._backend.decode(known, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # ---- chat ----------------------------------------------------------------

    def render_chat(
        self, messages: list[dict[str, Any]], system: str | None = None, add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text for a conversation, exactly as transformers' apply_chat_template renders it.

        `continue_final_message`: the last message (an assistant's prefill) is left open, so the
        model continues it; rendered as transformers does — its content is tagged, the template
        rendered without a generation prompt, and the text cut where the tag begins.
        """
        if continue_final_message:
            return self._render_continued(messages, system)
        if self._template is None:
            raise TokenizerError("this tokenizer has no chat template (no chat_template in tokenizer_config.json)")
        chat = [{"role": "system", "content": system}] if system is not None else []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or "content" not in message:
                raise TokenizerError(f"message {i} must be a dict with a string 'role' and a 'content'")
            # Like transformers: drop None-valued keys (templates test for presence) and copy.
            chat.append({k: v for k, v in message.items() if v is not None})
        if not chat:
            raise TokenizerError("cannot render an empty conversation")
        try:
            return self._template.render(
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except Exception as e:
            raise TokenizerError(f"chat template refused the conversation: {e}") from e

    def _render_continued(self, messages: list[dict[str, Any]], system: str | None) -> str:
        final = messages[-1].get("content") if messages and isinstance(messages[-1], Mapping) else None
        if not isinstance(final, str):
            raise TokenizerError("the final message to continue must have string content")
        tagged = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]
        rendered = self.render_chat(tagged, system=system, add_generation_prompt=False)
        if final.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
            raise TokenizerError("the chat template drops part of the final message, so it cannot be continued")
        at = rendered.rindex(CONTINUE_TAG.strip())
        # A template that strips the content's trailing space also strips the tag's: cut and strip.
        return rendered[:at] if rendered[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else rendered[:at].rstrip()

    def encode_chat(self, messages: Sequence[Message], system: str | None = None,
                    continue_final_message: bool = False) -> list[int]:
        """Prompt token ids. The template writes any BOS itself, so none is added (as apply_chat_template does)."""
        chat = [{"role": m.role, "content": m.content} for m in messages]
        text = self.render_chat(chat, system=system, continue_final_message=continue_final_message)
        return self.encode(text, add_special_tokens=False)


class StreamDecoder:
    """Token ids in, newly completed text out, for streaming.

    Each push decodes a short window of recent tokens twice (with and without the new
    ones) and releases the difference. The window keeps the token before the new text,
    so tokenizers that drop a leading space on the first token decode it correctly, and
    text ending in U+FFFD (a character split across byte-level tokens) is held back
    until the character completes.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: context for the decode, already released
        self._read = 0  # tokens before this are released

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        num_held = len(self._ids) - self._read
        # Release U+FFFD only once it cannot be a split character any more (invalid bytes).
        if len(text) <= len(prefix_text) or (text.endswith(_REPLACEMENT_CHAR) and num_held < _MAX_HELD_TOKENS):
            return ""
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Release whatever is held back (an incomplete character decodes to U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._ids.clear()
        self._prefix = self._read = 0
        return text[len(prefix_text) :] if len(text) > len(prefix_text) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


# ---- the template sandbox (mirrors transformers.utils.chat_template_utils) ----


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    # transformers refuses underscore names so a template cannot reach CPython internals.
    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes `<>&'`; HF's keeps text as written.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(template: str, source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{source}: chat template syntax error at line {e.lineno}: {e.message}") from e


# ---- file parsing --------------------------------------------------------------


def _read_json(files: Mapping[str, str], name: str, source: str) -> dict[str, Any]:
    if name not in files:
        return {}
    try:
        data = json.loads(files[name])
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{name} in {source} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{name} in {source} must hold a JSON object")
    return data


def _chat_template(files: Mapping[str, str], config: dict[str, Any], source: str) -> tuple[str | None, str]:
    # A chat_template.jinja file takes priority over the tokenizer_config.json entry (as in transformers).
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"], "chat_template.jinja"
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"tokenizer_config.json in {source}: chat_template must be a string")
    return template, "tokenizer_config.json"


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The `*_token` entries transformers passes to templates: named ones, plus model-specific strings."""
    special = {}
    for key, value in config.items():
        text = _token_text(value) if key in _NAMED_SPECIAL_TOKENS else value
        if key.endswith("_token") and isinstance(text, str):
            special[key] = text
    return special


def _token_text(value: Any) -> str | None:
    # Special tokens are stored as "<s>" or as a serialized AddedToken {"content": "<s>", ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _token_id(backend: tokenizers.Tokenizer, token: str | None) -> int | None:
    return backend.token_to_id(token) if token is not None else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []
