"""A GGUF file's tokenizer metadata (`tokenizer.ggml.*`) -> HF `tokenizer.json` + `tokenizer_config.json`.

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary, the merges, each token's
type and the special token ids as metadata. The reference for turning them back into a
tokenizer is transformers' GGUF loader (transformers/integrations/gguf/
gguf_tokenizer_mapping.py, then `TokenizersBackend.__init__`), and the runtime must see
the ids transformers sees, so this builds the same `tokenizers` pipeline step by step:

1. Byte-level BPE over the file's tokens and merges, tokens spelled in GPT-2's byte
   alphabet (a token with any other character is re-spelled byte by byte), no unk token.
2. ByteLevel pre-tokenizer (GPT-2's split regex), or, for the `tokenizer.ggml.pre` names
   transformers knows, that vocabulary's split regex followed by a regex-free ByteLevel.
3. Added tokens: CONTROL tokens as special (a control token outside the byte alphabet is a
   llama.cpp mislabel and skipped), USER_DEFINED tokens as plain added tokens, then the
   named bos/eos/unk/pad tokens as special where not added yet. Added tokens are matched
   whole, so `<|im_start|>` is one id.
4. A TemplateProcessing post-processor that adds bos / eos as `add_bos_token` /
   `add_eos_token` say (the chat template writes them itself; `encode_chat` adds none).

Only byte-level ("gpt2") vocabularies are converted. Sentencepiece ("llama"), unigram
("t5") and the others are refused by name: their normalizer, byte fallback and prefix-space
rules would need a converter of their own to give transformers' ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from weights_tool.architecture import CheckpointError

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)
# llama.cpp's token types (llama_token_type in llama.h).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
# The named special tokens, in the order transformers adds them, and their GGUF id keys.
_NAMED_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}

# Split regexes by `tokenizer.ggml.pre`, as transformers' GGUF_PRE_TOKENIZER_SPLITS has them;
# any other name keeps GPT-2's own regex inside the ByteLevel pre-tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def tokenizer_files(metadata: Mapping[str, Any]) -> dict[str, str]:
    """`tokenizer.json` and `tokenizer_config.json` (as text) for a GGUF file's metadata."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise CheckpointError("GGUF file has no tokenizer (metadata tokenizer.ggml.model is missing)")
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise CheckpointError(
            f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE: "
            f"{', '.join(SUPPORTED_TOKENIZER_MODELS)}); sentencepiece ('llama') vocabularies are not converted"
        )
    tokens = _string_list(metadata, "tokenizer.ggml.tokens")
    merges = _string_list(metadata, "tokenizer.ggml.merges")
    token_types = _token_types(metadata, len(tokens))
    special = _named_special_tokens(metadata, tokens)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))

    backend = _byte_level_bpe(tokens, merges, metadata.get("tokenizer.ggml.pre"))
    _add_tokens(backend, tokens, token_types, special)
    backend.post_processor = _post_processor(backend, special, add_bos, add_eos)

    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                              "add_bos_token": add_bos, "add_eos_token": add_eos}
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        if not isinstance(template, str):
            raise CheckpointError("GGUF metadata tokenizer.chat_template is not a string")
        config["chat_template"] = template
    return {"tokenizer.json": backend.to_str(), "tokenizer_config.json": json.dumps(config, indent=2)}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: bytes that print stay, the others move above U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    num_moved = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + num_moved)
            num_moved += 1
    return table


# ---- the pipeline ------------------------------------------------------------------


def _byte_level_bpe(tokens: list[str], merge_lines: list[str], pre: Any) -> tokenizers.Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A later duplicate spelling wins, as in transformers' dict comprehension.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): i
        for i, token in enumerate(tokens)
    }
    merges = []
    for line in merge_lines:
        pair = tuple(line.split(" "))
        if len(pair) != 2:
            raise CheckpointError(f"GGUF merge {line!r} is not two tokens separated by one space")
        merges.append(pair)
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                         end_of_word_suffix="", fuse_unk=False)
    except Exception as e:  # tokenizers raises its own exception type for a merge of unknown tokens
        raise CheckpointError(f"GGUF tokenizer vocabulary and merges do not fit together: {e}") from e
    backend = tokenizers.Tokenizer(bpe)
    split = PRE_TOKENIZER_SPLITS.get(pre) if isinstance(pre, str) else None
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_tokens(backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int],
                special: dict[str, str]) -> None:
    alphabet = set(bytes_to_unicode().values())
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types, strict=True) if kind == TOKEN_TYPE_CONTROL and set(t) <= alphabet]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=True)
    user_defined = [AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, token_types, strict=True) if kind == TOKEN_TYPE_USER_DEFINED and t in vocab]
    backend.add_tokens(user_defined)
    # transformers then adds every named special token that is not an added token yet.
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    named = []
    for text in special.values():
        if text not in added and text not in named:
            named.append(text)
    backend.add_tokens([AddedToken(t, normalized=False, special=True) for t in named])


def _post_processor(backend: tokenizers.Tokenizer, special: dict[str, str], add_bos: bool,
                    add_eos: bool) -> processors.TemplateProcessing:
    bos, eos = special.get("bos_token") if add_bos else None, special.get("eos_token") if add_eos else None
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    special_tokens = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special_tokens)


# ---- metadata ---------------------------------------------------------------------------


def _string_list(metadata: Mapping[str, Any], key: str) -> list[str]:
    value = metadata.get(key)
    if value is None:
        raise CheckpointError(f"GGUF file lacks required metadata {key}")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"GGUF metadata {key} is not an array of strings")
    return value


def _token_types(metadata: Mapping[str, Any], num_tokens: int) -> list[int]:
    value = metadata.get("tokenizer.ggml.token_type")
    if value is None:
        return [1] * num_tokens  # every token NORMAL: nothing is added
    if not isinstance(value, list) or len(value) != num_tokens or not all(isinstance(v, int) for v in value):
        raise CheckpointError(f"GGUF metadata tokenizer.ggml.token_type must be {num_tokens} integers, one per token")
    return value


def _named_special_tokens(metadata: Mapping[str, Any], tokens: list[str]) -> dict[str, str]:
    special = {}
    for name, key in _NAMED_SPECIAL_TOKENS.items():
        token_id = metadata.get(key)
        if token_id is None:
            continue
        if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
            raise CheckpointError(f"GGUF metadata {key}={token_id!r} is not a token id (vocabulary of {len(tokens)})")
        special[name] = tokens[token_id]
    return special
