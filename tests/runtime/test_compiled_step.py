"""Decode steps through torch.compile (actors/compiled_step.py) against the eager steps, the parity reference: the
same fp32 greedy tokens for one row and for a batch whose rows join and leave, for GQA, sliding-window, QK-norm and
biased tied models; compilations bounded by the buckets and counted; no step compiles on a request's path; rows
the slabs cannot hold, and their steps, stay eager; slots come back whatever ends a row."""

from __future__ import annotations

import pytest
import torch

from actors.compiled_step import CompiledDecode, bucket_of, powers_of_two
from actors.engine import Engine
from actors.packed_weights import is_packable, pack
from actors.sampling import SamplingParams
from tests.runtime import test_batch_engine
from tests.runtime.test_batch_engine import PROMPTS, alone, join_and_leave_tokens, prompt_ids
from tests.runtime.test_decode_attention import _model

parts = test_batch_engine.parts  # the batch tests' fp32 tiny model (a module-scoped fixture)


def _fp32_model(tmp_path, preset: str, **overrides):
    model, tokenizer = _model(tmp_path, preset, **overrides)
    return model.to(torch.float32), tokenizer


def _engine(model, tokenizer, compiled: CompiledDecode | None) -> Engine:
    engine = Engine(model, tokenizer, max_batch=8, prefill_chunk_tokens=7, compiled=compiled)
    engine.eos_token_ids = frozenset()  # every row runs to max_tokens
    return engine


def test_buckets_are_powers_of_two_ended_by_the_limit():
    assert powers_of_two(1, 8) == (1, 2, 4, 8)
    assert powers_of_two(1, 6) == (1, 2, 4, 6)
    assert powers_of_two(64, 300) == (64, 128, 256, 300)
    assert powers_of_two(64, 40) == (40,)
    assert bucket_of(3, (1, 2, 4)) == 4 and bucket_of(5, (1, 2, 4)) is None


@pytest.mark.slow
def test_a_batch_whose_rows_join_and_leave_decodes_the_eager_tokens_with_compilations_bounded_by_the_buckets(parts):
    model, tokenizer = parts
    eager = join_and_leave_tokens(model, tokenizer)
    compiled = CompiledDecode(model, num_slots=4, max_seq_len=160)  # the longest row: 116 prompt tokens + 36
    assert compiled.row_buckets == (1, 2, 4) and compiled.position_buckets == (64, 128, 160)
    assert compiled.compile_buckets() == compiled.num_compiles == 9  # one per (rows, positions) bucket
    assert compiled.compile_buckets() == 0  # compiled once

    tokens = join_and_leave_tokens(model, tokenizer, compiled)
    assert tokens == eager
    assert min(len(t) for t in tokens) >= 32 and len({t for row in tokens for t in row}) > 4
    # Rows of 1 to 4, at positions from 9 to 152: most steps decode only, through the compiled step, which compiles
    # nothing more.
    assert compiled.num_steps > 32
    assert compiled.num_compiles == 9
    assert compiled.num_free == 4  # every row's slot back


@pytest.mark.slow
@pytest.mark.parametrize("preset, overrides", [
    ("tiny", {}),  # GQA: 4 query heads on 2 KV heads, untied head
    ("tiny-mistral", {"sliding_window": 8}),  # rows past the window see only its last 8 keys
    ("tiny-qwen3", {}),  # QK-norm, head_dim 32 != hidden / heads, tied head
    ("tiny-qwen2", {}),  # biases on q, k and v
])
def test_one_row_decodes_the_eager_tokens_through_the_compiled_step(tmp_path, preset, overrides):
    model, tokenizer = _fp32_model(tmp_path, preset, **overrides)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    prompt = prompt_ids(_engine(model, tokenizer, None), PROMPTS[1])
    eager = alone(_engine(model, tokenizer, None), prompt, params)
    compiled = CompiledDecode(model, num_slots=1, max_seq_len=96)
    assert compiled.compile_buckets() == 2  # one row; 64 and 96 positions
    engine = _engine(model, tokenizer, compiled)
    assert alone(engine, prompt, params) == eager and len(eager) == 40 and len(set(eager)) > 4
    assert compiled.num_steps == 39  # every step after the prompt's
    assert compiled.num_compiles == 2 and compiled.num_free == 1


def test_a_bucket_not_compiled_runs_eagerly_and_compiles_nothing(parts):
    model, tokenizer = parts
    compiled = CompiledDecode(model, num_slots=2, max_seq_len=64)
    engine = _engine(model, tokenizer, compiled)
    prompt = prompt_ids(engine, PROMPTS[0])
    params = SamplingParams(max_tokens=8, temperature=0.0)
    assert alone(engine, prompt, params) == alone(_engine(model, tokenizer, None), prompt, params)
    assert compiled.num_steps == 0 and compiled.num_compiles == 0
    assert compiled.num_free == 2


def test_rows_the_slabs_cannot_hold_get_their_own_caches_and_every_slot_comes_back(parts):
    model, tokenizer = parts
    compiled = CompiledDecode(model, num_slots=2, max_seq_len=64)
    engine = _engine(model, tokenizer, compiled)
    prompt = prompt_ids(engine, PROMPTS[0])
    short, long = SamplingParams(max_tokens=8), SamplingParams(max_tokens=64)  # the long one: past 64 positions
    rows = [engine.add(prompt, p, lambda e: None) for p in (short, long, short, short)]
    engine.step()
    assert [r.slot is not None for r in rows] == [True, False, True, False]  # too long; then no slot free
    assert compiled.num_free == 0
    assert rows[1].caches[0].max_seq_len == len(prompt) + 64  # its own, sized for it
    assert engine.kv_bytes() == compiled.kv_bytes() + sum(r.kv_bytes() for r in rows if r.slot is None)
    engine.cancel(rows[0])
    engine.step()
    assert compiled.num_free == 1 and rows[0].slot is None
    engine.fail_all(RuntimeError("a step failed"))
    assert compiled.num_free == 2


@pytest.mark.skipif(not is_packable(torch.zeros(2, 2, dtype=torch.bfloat16)),
                    reason="this torch has no oneDNN linear on this CPU: nothing is packed")
def test_a_packed_model_is_not_compiled(tmp_path):
    model, _ = _model(tmp_path, "tiny")
    pack(model, kernel="onednn").install()
    with pytest.raises(ValueError, match="plain weights"):
        CompiledDecode(model, num_slots=2, max_seq_len=64)
