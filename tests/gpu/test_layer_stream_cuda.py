"""CudaLayerStream: groups land bit-exact in CUDA tensors through a small ring of pinned slots."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.test_format import TORCH_DTYPES, flip_byte, packed_checkpoint
from weights_tool.format import ShardFormatError
from weights_tool.layer_stream import THREAD_NAME, CudaLayerStream
from weights_tool.reader import ShardReader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

_STORED = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def cuda_destinations(reader: ShardReader) -> dict[str, torch.Tensor]:
    return {n: torch.full(t.shape, float("nan"), dtype=_STORED[t.dtype], device="cuda")
            for n, t in reader.tensors.items()}


def host_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("slot_bytes", [4096, 1 << 20])
def test_groups_arrive_bit_exact(tmp_path: Path, dtype: str, slot_bytes: int) -> None:
    assert dtype in TORCH_DTYPES
    zqs = packed_checkpoint(tmp_path, dtype, byte_group="always", max_frame_bytes=20_000)
    with ShardReader(zqs) as r:
        expected = {n: a.tobytes() for g in r.groups for n, a in r.read_group(g.name).items()}
        dests = cuda_destinations(r)
        # A 4 KiB slot is smaller than most tensors: every group crosses many slot refills.
        with CudaLayerStream(r, dests, num_threads=2, slot_bytes=slot_bytes, num_slots=2) as stream:
            for i in range(-1, r.num_layers + 1):
                stream.wait(i, timeout=30)
                group = r.group("embed" if i == -1 else "final" if i == r.num_layers else f"layer.{i}")
                # .cpu() runs on the current stream, which wait() made wait on the copy event.
                for t in group.tensors:
                    assert host_bytes(dests[t.name]) == expected[t.name]
            torch.cuda.synchronize()
            assert all(stream.is_ready(i) for i in range(-1, r.num_layers + 1))
            assert sorted(stream.ready_times()) == list(range(-1, r.num_layers + 1))
    assert not [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


def test_compute_stream_waits_without_the_host(tmp_path: Path) -> None:
    zqs = packed_checkpoint(tmp_path, "float32")
    with ShardReader(zqs) as r:
        expected = {n: np.frombuffer(a.tobytes(), dtype=np.float32) for n, a in r.read_group("layer.0").items()}
        dests = cuda_destinations(r)
        compute = torch.cuda.Stream()
        with torch.cuda.stream(compute), CudaLayerStream(r, dests, num_threads=1) as stream:
            stream.wait(0, timeout=30)
            # Queued on the compute stream right after wait(): must see the loaded weights.
            total = sum(dests[n].double().sum() for n in expected)
            got = total.item()
        assert got == pytest.approx(sum(float(v.astype(np.float64).sum()) for v in expected.values()), rel=1e-9)


def test_error_stays_with_its_group(tmp_path: Path) -> None:
    zqs = packed_checkpoint(tmp_path, "bfloat16")
    with ShardReader(zqs) as r:
        frame = r.group("layer.1").frames[0]
    flip_byte(zqs, frame.offset + frame.stored_size // 2)
    with ShardReader(zqs) as r, CudaLayerStream(r, cuda_destinations(r), num_threads=2) as stream:
        for i in (-1, 0, 2, r.num_layers):
            stream.wait(i, timeout=30)
        with pytest.raises(ShardFormatError, match=r"group layer\.1"):
            stream.wait(1, timeout=30)


def test_destinations_must_be_cuda_tensors_of_the_right_size(tmp_path: Path) -> None:
    zqs = packed_checkpoint(tmp_path, "bfloat16")
    with ShardReader(zqs) as r:
        dests = cuda_destinations(r)
        dests["model.norm.weight"] = dests["model.norm.weight"].cpu()
        with pytest.raises(ValueError, match="model.norm.weight"):
            CudaLayerStream(r, dests)
        dests = cuda_destinations(r)
        dests["model.norm.weight"] = torch.zeros(3, device="cuda")
        with pytest.raises(ValueError, match="model.norm.weight"):
            CudaLayerStream(r, dests)


def test_prompt_rows_then_layers_first_give_the_logits_of_a_full_load(tiny_zqs) -> None:
    from actors.layer_loader import load_zqs, stream_zqs

    model, tokenizer = load_zqs(tiny_zqs, device="cuda")
    prompt = tokenizer.encode("Rows first on the GPU.")
    model.setup_cache(64)
    expected = model.prefill(torch.tensor([prompt], device="cuda"))
    streamed = stream_zqs(tiny_zqs, device="cuda", num_threads=1)
    try:
        assert streamed.is_embedding_raw and streamed.load_rows(prompt)
        num_layers = streamed.config.num_layers

        def wait_layer(i: int) -> None:
            if i != -1:
                streamed.stream.wait(i, timeout=30)
            if i == num_layers:
                streamed.stream.wait(-1, timeout=30)

        streamed.model.setup_cache(64)
        got = streamed.model.prefill(torch.tensor([prompt], device="cuda"), wait_layer=wait_layer)
        torch.cuda.synchronize()
    finally:
        streamed.close()
    assert torch.equal(got, expected)
