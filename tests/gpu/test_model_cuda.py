"""The same model code on CUDA: logits match the CPU run (fp32 tightly, bf16 loosely)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

pytest.importorskip("transformers")

from actors.checkpoint import load_hf_checkpoint  # noqa: E402
from tests.runtime.test_model_parity import VARIANTS, VOCAB, greedy, save_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="module", params=["llama3_gqa", "mistral_window", "qwen3"])
def checkpoint_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert request.param in VARIANTS
    path = tmp_path_factory.mktemp(request.param)
    save_hf_checkpoint(request.param, path)
    return path


def _cached_logits(model, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits [steps, B, V] from prefill then decode steps over the given tokens."""
    model.setup_cache(tokens.shape[1], batch_size=tokens.shape[0])
    out = [model.prefill(tokens[:, :prompt_len])]
    for pos in range(prompt_len, tokens.shape[1]):
        out.append(model.decode_step(tokens[:, pos : pos + 1], pos))
    return torch.stack(out).cpu()


def test_fp32_cuda_matches_cpu(checkpoint_dir: Path) -> None:
    cpu, _ = load_hf_checkpoint(checkpoint_dir, dtype=torch.float32, device="cpu")
    gpu, _ = load_hf_checkpoint(checkpoint_dir, dtype=torch.float32, device="cuda")
    assert all(p.is_cuda for p in gpu.parameters())
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = cpu(tokens, torch.arange(24))
    out = gpu(tokens.cuda(), torch.arange(24, device="cuda")).cpu()
    # TF32 would loosen fp32 matmuls; the default (off) keeps them exact to rounding.
    torch.testing.assert_close(out, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)
    torch.testing.assert_close(
        _cached_logits(gpu, tokens.cuda(), 8), _cached_logits(cpu, tokens, 8), atol=1e-4 * ref.abs().max().item(),
        rtol=1e-4,
    )
    prompt = tokens[:1, :10]
    assert greedy(gpu, prompt.cuda(), 24).cpu().tolist() == greedy(cpu, prompt, 24).tolist()


def test_bf16_cuda_is_close_to_fp32_cpu(checkpoint_dir: Path) -> None:
    cpu, _ = load_hf_checkpoint(checkpoint_dir, dtype=torch.float32, device="cpu")
    gpu, _ = load_hf_checkpoint(checkpoint_dir, dtype=torch.bfloat16, device="cuda")
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    ref = _cached_logits(cpu, tokens, 8)
    out = _cached_logits(gpu, tokens.cuda(), 8)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
