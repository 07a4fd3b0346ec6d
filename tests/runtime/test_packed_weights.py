"""Packed linear weights (actors/packed_weights.py): oneDNN's the plain products bit for bit, in single rows;
either kernel's model the plain model's tokens in batches whose rows join and leave; the plain weights'
memory given back; installed only between steps. The bf16_linear kernel's own products:
test_bf16_linear.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
import torch.nn.functional as F

from actors import cpu_kernels
from actors.batch_runner import BatchRunner
from actors.checkpoint import load_hf_checkpoint
from actors.engine import Engine
from actors.layers import Linear
from actors.model import RowInput
from actors.packed_weights import is_packable, pack
from actors.sampling import SamplingParams
from actors.tokenizer import Message, Tokenizer
from tests.runtime.test_batch_engine import join_and_leave_tokens
from weights_tool.synth import preset_config, synthesize

pytestmark = pytest.mark.skipif(not is_packable(torch.zeros(2, 2, dtype=torch.bfloat16)),
                                reason="this torch has no oneDNN linear on this CPU")


def _bf16_model(tmp_path, *, tied: bool):
    """A tiny random bf16 model whose greedy tokens vary (weights wide enough not to repeat one token)."""
    cfg = preset_config("tiny") | {"tie_word_embeddings": tied}
    path = synthesize(cfg, tmp_path / f"tied-{tied}", dtype="bfloat16", seed=3)
    model, config = load_hf_checkpoint(path)
    torch.manual_seed(0)
    model.init_weights(std=0.15)
    return model, Tokenizer.from_dir(path, eos_token_ids=config.eos_token_ids)


def _linears(model) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("has_bias", [False, True])
def test_a_packed_linear_gives_the_plain_products_bit_for_bit(rows, has_bias):
    torch.manual_seed(rows)
    layer = Linear(96, 160, bias=has_bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_()
        if has_bias:
            layer.bias.normal_()
    x = torch.randn(1, rows, 96).to(torch.bfloat16)  # [1, T, hidden], as forward_rows feeds it
    # F.linear's products, rounded once: the plain path's gemv for one row rounds before it adds a bias.
    want = F.linear(x, layer.weight, layer.bias)
    pack(layer, kernel="onednn").install()
    assert layer.packed_weight is not None
    assert torch.equal(layer(x), want)


@pytest.mark.parametrize("tied", [True, False])
def test_a_onednn_packed_models_batch_decodes_the_plain_models_tokens(tmp_path, tied):
    model, tokenizer = _bf16_model(tmp_path, tied=tied)
    plain = join_and_leave_tokens(model, tokenizer)
    packed = pack(model, kernel="onednn")
    assert packed.kernel == "onednn"
    assert len(packed.layers) == 7 * model.config.num_layers + (0 if tied else 1)
    assert packed.head is None  # a tied head stays plain: the table's lookups read it, oneDNN's layout is opaque
    packed.install()
    assert join_and_leave_tokens(model, tokenizer) == plain
    assert min(len(t) for t in plain) >= 32 and len({t for row in plain for t in row}) > 4


@pytest.mark.skipif(not cpu_kernels.is_available(), reason="no AVX512-BF16 on this CPU, or the kernels could not be built")
@pytest.mark.parametrize("tied", [True, False])
def test_the_actors_kernels_give_the_plain_models_logits_to_bf16_rounding(tmp_path, tied):
    # Not its free-running greedy tokens: the kernels round differently (the attention less than SDPA's bf16 path:
    # test_decode_attention.py), and where two tokens are near-tied a decode parts and goes on differently. Each step's
    # logits on the same inputs are what must agree (batch invariance: test_decode_attention.py).
    model, _ = _bf16_model(tmp_path, tied=tied)
    torch.manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,)) for n in (3, 11, 24)]

    def logits() -> torch.Tensor:  # prompts cached, then one step of the three rows decoding: [steps x 3, V]
        caches = [model.new_row_cache(40) for _ in prompts]
        for p, c in zip(prompts, caches, strict=True):
            model.forward_rows(p, [RowInput(c, 0, len(p), needs_logits=False)])
        out, pos = [], [len(p) for p in prompts]
        for step in range(8):
            tokens = torch.tensor([(7 * step + i) % model.config.vocab_size for i in range(len(prompts))])
            out.append(model.forward_rows(tokens, [RowInput(c, p + step, 1) for c, p in zip(caches, pos, strict=True)]))
        return torch.cat(out)

    plain = logits()
    packed = pack(model)
    assert packed.kernel == "bf16_linear" and (packed.head is not None) == tied  # a tied head packed too
    packed.install()
    assert all(layer.self_attn.is_decode_batched for layer in model.model.layers)
    ours = logits()
    torch.testing.assert_close(ours, plain, rtol=0.05, atol=0.05)
    assert (ours.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9


def test_install_gives_the_plain_weights_back_and_a_stale_reader_fails_loudly(tmp_path):
    model, _ = _bf16_model(tmp_path, tied=False)
    q_proj = model.model.layers[0].self_attn.q_proj
    stale = q_proj.weight  # a reference taken before install: its pages are released under it
    plain_bytes = sum(m.weight.nbytes for m in _linears(model))
    released = pack(model).install()
    # The arena's pages under each weight, less the partial pages at its two ends.
    assert plain_bytes - 2 * 4096 * len(_linears(model)) <= released <= plain_bytes
    assert all(m.weight.numel() == 0 for m in _linears(model))
    with pytest.raises(RuntimeError):
        F.linear(torch.ones(1, q_proj.in_features, dtype=torch.bfloat16), q_proj.weight)
    assert stale.shape == (q_proj.out_features, q_proj.in_features)
    assert pack(model).layers == []  # nothing is packed twice


def test_only_bf16_weights_are_packed(tmp_path):
    path = synthesize("tiny", tmp_path, dtype="float32", seed=3)
    model, _ = load_hf_checkpoint(path)
    assert pack(model).layers == []  # fp32 packs in another summation order: eager stays the parity reference


def test_a_call_between_steps_runs_on_the_stepping_thread_and_never_inside_a_step(tmp_path):
    model, tokenizer = _bf16_model(tmp_path, tied=True)
    engine = Engine(model, tokenizer, max_batch=4, prefill_chunk_tokens=64)
    engine.eos_token_ids = frozenset()
    in_step = threading.Event()
    seen: list[tuple[str, bool]] = []
    real_step = engine.step

    def step(*args, **kwargs):
        in_step.set()
        try:
            return real_step(*args, **kwargs)
        finally:
            in_step.clear()

    engine.step = step

    async def scenario():
        runner = BatchRunner(engine, name="zq-test-batch")
        stream = runner.submit(tokenizer.encode_chat([Message("user", "Hi")]),
                               SamplingParams(max_tokens=64, temperature=0.0))
        await stream.get()  # the row is running: the next call lands between two of its steps
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def install():
            seen.append((threading.current_thread().name, in_step.is_set()))
            pack(model).install()
            loop.call_soon_threadsafe(done.set)

        runner.call_between_steps(install)
        await asyncio.wait_for(done.wait(), 60)
        events = [await stream.get()]
        while not stream.is_done:
            events.append(await stream.get())
        runner.close()
        return events

    events = asyncio.run(scenario())
    assert seen == [("zq-test-batch", False)]
    assert all(m.packed_weight is not None for m in _linears(model))
    assert sum(1 for e in events if hasattr(e, "token_id")) >= 1  # the row went on after the swap
