"""The batched engine on CUDA: each row's greedy tokens in a batch equal its tokens alone (fp32), eagerly and through
the compiled step (inductor with CUDA graphs over the static slabs: actors/compiled_step.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from actors.checkpoint import load_hf_checkpoint  # noqa: E402
from actors.compiled_step import CompiledDecode  # noqa: E402
from actors.engine import Engine  # noqa: E402
from actors.events import TokenEvent  # noqa: E402
from actors.sampling import SamplingParams  # noqa: E402
from actors.tokenizer import Message, Tokenizer  # noqa: E402
from weights_tool.synth import synthesize  # noqa: E402

PROMPTS = ["Hi", "Tell me about queues, please, in some detail.", "Why do tails matter to users of a service?"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize("tiny-qwen3", tmp_path_factory.mktemp("tiny-qwen3"), dtype="float32", seed=4)


@pytest.mark.parametrize("is_compiled", [False, True])
def test_rows_joining_at_different_steps_match_their_runs_alone(checkpoint: Path, is_compiled: bool) -> None:
    model, config = load_hf_checkpoint(checkpoint, dtype=torch.float32, device="cuda")
    torch.manual_seed(0)
    model.init_weights(std=0.15)  # logits far from ties, so the comparison is exact, not lucky
    compiled = CompiledDecode(model, num_slots=4, max_seq_len=128) if is_compiled else None
    if compiled is not None:
        assert compiled.compile_buckets() == 6  # (1, 2, 4 rows) x (64, 128 positions)
    engine = Engine(model, Tokenizer.from_dir(checkpoint, eos_token_ids=config.eos_token_ids), max_batch=4,
                    prefill_chunk_tokens=4, compiled=compiled)
    engine.eos_token_ids = frozenset()
    prompts = [engine.tokenizer.encode_chat([Message("user", p)]) for p in PROMPTS]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (32, 40, 36)]
    alone = [[e.token_id for e in engine.generate(p, s) if isinstance(e, TokenEvent)]
             for p, s in zip(prompts, params, strict=True)]
    got: list[list[int]] = [[], [], []]

    def sink(i):
        return lambda e: got[i].append(e.token_id) if isinstance(e, TokenEvent) else None

    engine.add(prompts[0], params[0], sink(0))
    for step in range(1000):
        if step == 2:
            engine.add(prompts[1], params[1], sink(1))
        if step == 7:
            engine.add(prompts[2], params[2], sink(2))
        if step > 7 and not engine.has_work:
            break
        engine.step()
    assert got == alone
    if compiled is None:
        assert engine.kv_bytes() == 0
    else:  # the batch's decode-only steps (and the rows alone) ran through it, compiling nothing more
        assert compiled.num_steps > 32 and compiled.num_compiles == 6 and compiled.num_free == 4


def test_int8_caches_on_cuda_decode_through_sdpa_and_a_batch_changes_no_token(checkpoint: Path) -> None:
    # No kernel reads 8-bit caches on a GPU: every step dequantizes the rows' spans (actors/kv_cache.py) on the
    # device; a row's tokens still do not depend on the rows beside it.
    model, config = load_hf_checkpoint(checkpoint, dtype=torch.float32, device="cuda")
    torch.manual_seed(0)
    model.init_weights(std=0.15)
    engine = Engine(model, Tokenizer.from_dir(checkpoint, eos_token_ids=config.eos_token_ids), max_batch=4,
                    prefill_chunk_tokens=4, is_kv_int8=True)
    engine.eos_token_ids = frozenset()
    prompts = [engine.tokenizer.encode_chat([Message("user", p)]) for p in PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    alone = [[e.token_id for e in engine.generate(p, params) if isinstance(e, TokenEvent)] for p in prompts]
    got: list[list[int]] = [[], [], []]
    for i, p in enumerate(prompts):
        engine.add(p, params, lambda e, i=i: got[i].append(e.token_id) if isinstance(e, TokenEvent) else None)
    while engine.has_work:
        engine.step()
    assert got == alone and all(len(t) == 32 for t in got)
    assert all(c.k_cache.dtype == torch.int8 for c in model.new_row_cache(8, is_int8=True))
