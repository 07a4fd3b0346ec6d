"""Every layer of a decode-only step in one C++ call (actors/decode_layers.py, csrc/decode_layers.h), for bf16 rows
(AVX512-BF16) and fp32 rows over bf16 weights (AVX2): the layers' own bits, step by step, for GQA, biased,
sliding-window and wider-head models, tied and untied; a batch whose rows join and leave decodes the same tokens
with it as without; steps it does not compute (a prompt chunk in them) and models it does not serve (QK-norm,
unpacked) take the layers one by one."""

from __future__ import annotations

import pytest
import torch

from actors import cpu_kernels
from actors import decode_layers as decode_layers_module
from actors.packed_weights import pack
from tests.runtime.test_batch_engine import join_and_leave_tokens
from tests.runtime.test_decode_attention import _model, _rows_step
from tests.runtime.test_decode_attention_f32 import widened_model

# Each kernel set where it runs: bf16 rows need AVX512-BF16; fp32 rows the AVX2 kernels (on either kind of CPU).
KERNELS = [
    pytest.param(_model, marks=pytest.mark.skipif(not cpu_kernels.is_available(),
                                                  reason="no AVX512-BF16 on this CPU, or no build"), id="bf16"),
    pytest.param(widened_model, marks=pytest.mark.skipif(cpu_kernels.avx2_extension() is None,
                                                         reason="no AVX2 kernels here"), id="fp32"),
]


@pytest.fixture
def calls(monkeypatch):
    """How many steps went through the layers' kernel."""
    count = [0]
    forward = decode_layers_module.forward

    def counted(*args):
        count[0] += 1
        return forward(*args)

    monkeypatch.setattr(decode_layers_module, "forward", counted)
    return count


@pytest.mark.parametrize("make_model", KERNELS)
@pytest.mark.parametrize("preset, overrides", [
    ("tiny", {}),  # GQA: 4 query heads on 2 KV heads, head_dim 16, untied head
    ("tiny", {"head_dim": 64}),
    ("tiny-qwen2", {}),  # biases on q, k and v; tied head
    ("tiny-mistral", {"sliding_window": 8}),  # rows past the window read only its last 8 keys
])
def test_a_decode_only_step_through_the_layers_kernel_gives_the_layers_own_bits(tmp_path, calls, make_model, preset,
                                                                               overrides):
    model, _ = make_model(tmp_path, preset, **overrides)
    pack(model).install()
    kernel = model.decode_layers
    assert kernel is not None and kernel.num_layers == model.config.num_layers
    lengths = [1, 5, 17, 40, 9]
    for chunks in ({}, {2: 6}):  # every row decodes; or row 2 feeds a prompt chunk (the layers one by one)
        model.decode_layers = kernel
        before = calls[0]
        fused = _rows_step(model, lengths, chunks)
        # The step itself only where every row decodes; of the cache fills before it, only row 0's one-token prompt
        # (a step of one token against its cache, the same computation).
        assert calls[0] - before == (2 if not chunks else 1)
        model.decode_layers = None
        assert torch.equal(fused, _rows_step(model, lengths, chunks))


@pytest.mark.parametrize("make_model", KERNELS)
def test_a_batch_whose_rows_join_and_leave_decodes_the_same_tokens_with_the_layers_kernel(tmp_path, calls, make_model):
    model, tokenizer = make_model(tmp_path, "tiny")
    pack(model).install()
    kernel = model.decode_layers
    fused = join_and_leave_tokens(model, tokenizer)
    assert calls[0] > 32  # most steps decode only
    model.decode_layers = None
    assert fused == join_and_leave_tokens(model, tokenizer)
    assert min(len(t) for t in fused) >= 32 and len({t for row in fused for t in row}) > 4
    assert kernel is not None


@pytest.mark.parametrize("make_model", KERNELS)
def test_models_it_does_not_serve_keep_the_layers_one_by_one(tmp_path, make_model):
    model, _ = make_model(tmp_path, "tiny-qwen3")  # QK-norm: q and k normalised before RoPE, in torch
    pack(model).install()
    assert model.decode_layers is None
    plain, _ = make_model(tmp_path, "tiny")  # not packed: nothing for the kernel to read
    assert decode_layers_module.build(plain) is None and plain.decode_layers is None
