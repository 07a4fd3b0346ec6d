"""Our runtime against `transformers` itself, on random-weight checkpoints of every supported variant.

Each variant is built with transformers' own config and model classes, given
weights that make every feature matter (a non-trivial init std, norm weights
away from 1, biases away from 0), written with `save_pretrained` and loaded back
with `load_hf_checkpoint`. The helpers here are shared by the other runtime tests.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from actors.checkpoint import load_hf_checkpoint  # noqa: E402
from actors.model import Transformer  # noqa: E402
from weights_tool.architecture import ModelConfig, RopeScaling  # noqa: E402

VOCAB = 300
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    vocab_size=VOCAB,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,  # greedy generation runs its full length on both sides
    attn_implementation="eager",  # HF's reference attention math
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the test's short sequences exercise all three frequency bands.
    "original_max_position_embeddings": 64,
}
SLIDING_WINDOW = 6

# name -> (config class, model class, config kwargs)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama2": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_gqa": (
        "LlamaConfig", "LlamaForCausalLM",
        {"num_key_value_heads": 2, "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE},
    ),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "llama_linear_rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {"type": "linear", "factor": 4.0}}),
    "llama_biases": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "mistral_window": (
        "MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2, "sliding_window": SLIDING_WINDOW},
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 32}),
}


def build_hf_model(variant: str, seed: int = 0) -> Any:
    """A random-weight transformers model of `variant` whose every weight matters."""
    config_cls, model_cls, kwargs = VARIANTS[variant]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**_COMMON, **kwargs)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn_like(param))
    return model


def save_hf_checkpoint(variant: str, out_dir: Path, **save_kwargs: Any) -> Any:
    model = build_hf_model(variant)
    model.save_pretrained(out_dir, **save_kwargs)
    return model


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    """Equal up to fp32 rounding, relative to the logit scale."""
    scale = ref.abs().max().item()
    diff = (ours.float() - ref.float()).abs().max().item()
    assert diff <= rel * max(scale, 1.0), f"max |diff| {diff:.3g} vs logit scale {scale:.3g}"


def greedy(model: Transformer, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Our prefill + decode_step loop; prompt [1, S] -> generated tokens [max_new_tokens]."""
    model.setup_cache(prompt.shape[1] + max_new_tokens)
    token = model.prefill(prompt).argmax(-1, keepdim=True)  # [1, 1]
    out = [token]
    for pos in range(prompt.shape[1], prompt.shape[1] + max_new_tokens - 1):
        token = model.decode_step(token, pos).argmax(-1, keepdim=True)
        out.append(token)
    model.drop_cache()
    return torch.cat(out, dim=1)[0]


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_hf_checkpoint(request.param, path)
    model, config = load_hf_checkpoint(path)
    return request.param, hf_model, model, config


def test_logits_match_transformers(checkpoint) -> None:
    _, hf_model, model, _ = checkpoint
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(tokens).logits
    ours = model(tokens, torch.arange(tokens.shape[1]))
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert ref.std() > 0.3, "logits too flat for the comparison to mean anything"
    assert_logits_close(ours, ref)


def test_greedy_generation_matches_transformers(checkpoint) -> None:
    _, hf_model, model, _ = checkpoint
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    max_new_tokens = 40
    with torch.no_grad():
        ref = hf_model.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0)
    ours = greedy(model, prompt, max_new_tokens)
    assert ours.tolist() == ref[0, prompt.shape[1]:].tolist()
    assert len(set(ours.tolist())) > 3, "degenerate generation proves little"


def test_state_dict_uses_hf_names(checkpoint) -> None:
    _, hf_model, _, config = checkpoint
    model = Transformer.empty(config)
    hf_state = hf_model.state_dict()
    if config.tie_word_embeddings:
        hf_state.pop("lm_head.weight", None)  # transformers lists the tied alias
    model.load_state_dict(hf_state, strict=True)
    assert set(model.state_dict()) == set(config.tensor_shapes())


@pytest.mark.parametrize(
    ("variant", "change"),
    [
        ("mistral_window", {"sliding_window": None}),
        ("llama3_gqa", {"rope_scaling": RopeScaling()}),
        ("llama_linear_rope", {"rope_scaling": RopeScaling()}),
    ],
)
def test_parity_tests_are_sensitive(variant: str, change: dict[str, Any]) -> None:
    """Dropping the feature under test changes the logits far beyond the parity tolerance."""
    hf_model = build_hf_model(variant)
    config = ModelConfig.from_hf(hf_model.config.to_dict())
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    logits = {}
    for name, cfg in (("as is", config), ("changed", dataclasses.replace(config, **change))):
        model = Transformer.empty(cfg)
        model.load_state_dict(hf_model.state_dict())
        logits[name] = model(tokens, torch.arange(24))
    assert (logits["as is"] - logits["changed"]).abs().max() > 1e-3


def test_wait_layer_groups_in_order_and_layers_read_only_their_own(checkpoint) -> None:
    """Stream the weights in through wait_layer onto a model of NaNs: any early read would poison the logits."""
    _, hf_model, model, config = checkpoint
    streamed = Transformer.empty(config)
    for param in streamed.parameters():
        param.fill_(float("nan"))
    weights = model.state_dict()
    calls: list[int] = []

    def wait_layer(group: int) -> None:
        calls.append(group)
        for name, param in streamed.group_parameters(group).items():
            param.copy_(weights[name])

    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    streamed.setup_cache(16)
    logits = streamed.prefill(tokens, wait_layer=wait_layer)
    assert calls == list(range(-1, config.num_layers + 1))
    with torch.no_grad():
        ref = hf_model(tokens).logits[:, -1]
    assert_logits_close(logits, ref)


def test_groups_partition_the_parameters(checkpoint) -> None:
    _, _, model, config = checkpoint
    names = [n for g in range(-1, config.num_layers + 1) for n in model.group_parameters(g)]
    assert sorted(names) == sorted(config.tensor_shapes())
    with pytest.raises(ValueError, match="group"):
        model.group_parameters(config.num_layers + 1)
