"""Every corruption of a .zqs file is a ShardFormatError naming what is wrong, never a crash
or a silently wrong tensor."""

from __future__ import annotations

import copy
import json
import pickle
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_format import flip_byte, packed_checkpoint
from weights_tool.dtypes import SAFETENSORS_SIZES
from weights_tool.format import (
    MAX_HEADER_BYTES,
    PREAMBLE,
    VERSION,
    Header,
    ShardFormatError,
    crc32,
    decode_preamble,
)
from weights_tool.groups import group_names
from weights_tool.header import parse_header
from weights_tool.reader import ShardReader


@pytest.fixture
def zqs(tmp_path: Path) -> Path:
    return packed_checkpoint(tmp_path, "bfloat16", byte_group="always")


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header JSON, offset of the first frame)."""
    raw = path.read_bytes()
    _, _, _, n = PREAMBLE.unpack(raw[: PREAMBLE.size])
    doc = json.loads(raw[PREAMBLE.size : PREAMBLE.size + n])
    first = min(f["offset"] for g in doc["groups"] for f in g["frames"])
    return doc, first


def rewrite_header(path: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Edit the header JSON in place, with a valid crc, so only the edit is wrong."""
    doc, first = read_header(path)
    mutate(doc)
    new = json.dumps(doc, separators=(",", ":")).encode()
    assert PREAMBLE.size + len(new) <= first, "edited header no longer fits before the first frame"
    raw = bytearray(path.read_bytes())
    raw[: PREAMBLE.size] = PREAMBLE.pack(raw[:8], VERSION, crc32(new), len(new))
    raw[PREAMBLE.size : first] = new + bytes(first - PREAMBLE.size - len(new))
    path.write_bytes(bytes(raw))


def frame_of(doc: dict[str, Any], group: str, k: int = 0) -> dict[str, Any]:
    return next(g for g in doc["groups"] if g["name"] == group)["frames"][k]


def open_error(path: Path) -> str:
    with pytest.raises(ShardFormatError) as e:
        ShardReader(path).close()
    return str(e.value)


# ---- preamble and header -------------------------------------------------------------


def test_bad_magic(zqs: Path) -> None:
    raw = zqs.read_bytes()
    zqs.write_bytes(b"GGUF\x00\x00\x00\x00" + raw[8:])
    assert "bad magic" in open_error(zqs)


def test_bad_version(zqs: Path) -> None:
    raw = bytearray(zqs.read_bytes())
    raw[8:12] = struct.pack("<I", VERSION + 1)
    zqs.write_bytes(bytes(raw))
    assert f"unsupported .zqs version {VERSION + 1}" in open_error(zqs)


def test_header_size_over_the_cap_is_refused_before_reading(zqs: Path) -> None:
    raw = bytearray(zqs.read_bytes())
    raw[16:24] = struct.pack("<Q", MAX_HEADER_BYTES + 1)
    zqs.write_bytes(bytes(raw))
    assert "exceeds" in open_error(zqs)


def test_header_checksum_mismatch(zqs: Path) -> None:
    flip_byte(zqs, PREAMBLE.size + 20)
    assert "header checksum mismatch" in open_error(zqs)


def test_truncated_file_at_any_cut(zqs: Path) -> None:
    raw = zqs.read_bytes()
    doc, first = read_header(zqs)
    layer1 = frame_of(doc, "layer.1")
    cuts = {
        0: "shorter than",
        7: "shorter than",
        PREAMBLE.size: "runs past the end",
        PREAMBLE.size + 100: "runs past the end",
        first: "group embed frame 0",
        layer1["offset"] + layer1["stored_size"] // 2: "group layer.1 frame 0",
        len(raw) - 1: "group final",
    }
    for cut, expected in cuts.items():
        zqs.write_bytes(raw[:cut])
        assert expected in open_error(zqs), cut


def test_trailing_bytes_are_refused(zqs: Path) -> None:
    zqs.write_bytes(zqs.read_bytes() + b"\x00" * 3)
    assert "3 bytes after the last frame" in open_error(zqs)


def test_frame_out_of_bounds(zqs: Path) -> None:
    size = zqs.stat().st_size
    rewrite_header(zqs, lambda d: frame_of(d, "layer.2").update(offset=size + 4096))
    assert "group layer.2 frame 0" in open_error(zqs)


@pytest.mark.parametrize("field,value", [("offset", -1), ("stored_size", 2**64), ("size", 2**41), ("offset", 1.5),
                                         ("size", True), ("codec", "lz4"), ("crc32", 2**32)])
def test_bad_frame_fields(zqs: Path, field: str, value: Any) -> None:
    rewrite_header(zqs, lambda d: frame_of(d, "layer.1").update({field: value}))
    message = open_error(zqs)
    assert "group layer.1 frame 0" in message and field in message


def test_overlapping_frames(zqs: Path) -> None:
    def overlap(d: dict[str, Any]) -> None:
        a, b = frame_of(d, "layer.0"), frame_of(d, "layer.1")
        b["offset"] = a["offset"] + 1
    rewrite_header(zqs, overlap)
    assert "overlap" in open_error(zqs)


def test_frame_inside_the_header(zqs: Path) -> None:
    rewrite_header(zqs, lambda d: frame_of(d, "embed").update(offset=PREAMBLE.size))
    message = open_error(zqs)
    assert "group embed frame 0" in message and "the header" in message


def test_tensor_slice_outside_its_frame(zqs: Path) -> None:
    def grow(d: dict[str, Any]) -> None:
        t = next(g for g in d["groups"] if g["name"] == "layer.0")["tensors"][-1]
        t["shape"] = [t["shape"][0] * 2, *t["shape"][1:]]
        t["size"] *= 2
    rewrite_header(zqs, grow)
    message = open_error(zqs)
    assert "tensor model.layers.0." in message and "outside frame 0" in message


def test_tensor_size_must_match_dtype_and_shape(zqs: Path) -> None:
    rewrite_header(zqs, lambda d: d["groups"][0]["tensors"][0].update(dtype="F32"))
    assert "tensor model.embed_tokens.weight (group embed): size" in open_error(zqs)


def test_duplicate_tensor_names(zqs: Path) -> None:
    def duplicate(d: dict[str, Any]) -> None:
        tensors = next(g for g in d["groups"] if g["name"] == "layer.0")["tensors"]
        tensors[1]["name"] = tensors[0]["name"]
    rewrite_header(zqs, duplicate)
    assert "listed twice" in open_error(zqs)


def test_unsafe_file_names_are_refused(zqs: Path) -> None:
    rewrite_header(zqs, lambda d: d["tokenizer_files"].update({"../evil.json": "{}"}))
    assert "not a plain file name" in open_error(zqs)


# ---- frames ------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["raw", "zstd", "bytegroup"])
def test_flipped_byte_in_a_frame(tmp_path: Path, codec: str) -> None:
    options = {"raw": {"codec": "raw"}, "zstd": {"byte_group": False}, "bytegroup": {"byte_group": "always"}}
    zqs = packed_checkpoint(tmp_path, "bfloat16", **options[codec])
    doc, _ = read_header(zqs)
    frame = frame_of(doc, "layer.1")
    flip_byte(zqs, frame["offset"] + frame["stored_size"] // 2)
    with ShardReader(zqs) as r:
        with pytest.raises(ShardFormatError, match=r"group layer\.1 frame 0") as e:
            r.verify()
        assert "1 bad frame" in str(e.value)
        with pytest.raises(ShardFormatError, match=r"group layer\.1 frame 0 \(model\.layers\.1\."):
            r.read_layer(1)
        r.read_layer(0)
        r.read_layer(2)


def _unchecksummed_frame(tmp_path: Path, *, content_checksum: bool) -> tuple[Path, int]:
    """layer.2's frame re-encoded as incompressible zstd (stored raw blocks); returns the file and a byte to flip."""
    zqs = packed_checkpoint(tmp_path, "bfloat16", byte_group=False)
    with ShardReader(zqs) as r:
        group = r.group("layer.2")
        assert len(group.frames) == 1
        content = b"".join(bytes(v) for v in r.read_layer(2).values())
    frame = zstandard.ZstdCompressor(level=1, write_checksum=content_checksum).compress(content)
    end = zqs.stat().st_size
    with open(zqs, "ab") as f:
        f.write(frame)
    rewrite_header(zqs, lambda d: frame_of(d, "layer.2").update(offset=end, stored_size=len(frame), crc32=crc32(frame)))
    with ShardReader(zqs) as r:
        r.verify()  # a valid file so far
    return zqs, end + len(frame) // 2


def test_zstd_frame_without_content_checksum_is_checked_by_crc_on_load(tmp_path: Path) -> None:
    zqs, where = _unchecksummed_frame(tmp_path, content_checksum=False)
    flip_byte(zqs, where)  # inside a stored (raw) zstd block: still decodes, to wrong bytes
    with ShardReader(zqs) as r:
        with pytest.raises(ShardFormatError, match=r"group layer\.2 frame 0 .*checksum mismatch"):
            r.read_layer(2)
        r.read_layer(2, verify=False)  # trusted: nothing left to notice, as documented


def test_zstd_content_checksum_is_checked_even_unverified(tmp_path: Path) -> None:
    zqs, where = _unchecksummed_frame(tmp_path, content_checksum=True)
    flip_byte(zqs, where)
    with ShardReader(zqs) as r:
        for verify in (True, False):
            with pytest.raises(ShardFormatError, match=r"group layer\.2 frame 0 .*corrupt zstd data"):
                r.read_layer(2, verify=verify)
        with pytest.raises(ShardFormatError, match=r"group layer\.2 frame 0 .*(checksum|corrupt)"):
            r.verify()


def _bomb_file(tmp_path: Path, content_bytes: int, *, declare_size: bool, second_frame: bool = False) -> Path:
    """layer.0's first frame replaced by a valid zstd frame whose content exceeds the declared size."""
    zqs = packed_checkpoint(tmp_path, "bfloat16", byte_group=False)
    doc, _ = read_header(zqs)
    declared = frame_of(doc, "layer.0")["size"]
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=declare_size)
    if second_frame:  # a correct first frame, then a second one the decoder would read on into
        bomb = cctx.compress(bytes(declared)) + cctx.compress(bytes(content_bytes))
    else:
        cobj = cctx.compressobj(size=content_bytes if declare_size else -1)
        zeros = bytes(1 << 20)
        bomb = b"".join(cobj.compress(zeros[: min(len(zeros), content_bytes - k)])
                        for k in range(0, content_bytes, len(zeros))) + cobj.flush()
    end = zqs.stat().st_size
    with open(zqs, "ab") as f:
        f.write(bomb)
    rewrite_header(zqs, lambda d: frame_of(d, "layer.0").update(offset=end, stored_size=len(bomb), crc32=crc32(bomb)))
    return zqs


def test_decompression_bomb_is_caught_without_allocating_it(tmp_path: Path) -> None:
    content = 256 << 20
    zqs = _bomb_file(tmp_path, content, declare_size=False)
    with ShardReader(zqs) as r:
        into = {t.name: np.empty(t.size, dtype=np.uint8) for t in r.group("layer.0").tensors}
        tracemalloc.start()
        try:
            with pytest.raises(ShardFormatError, match=r"group layer\.0 frame 0 .*more than the declared"):
                r.read_layer(0, into=into)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, f"peak {peak} bytes while refusing a {content}-byte bomb"
        with pytest.raises(ShardFormatError, match="more than the declared"):
            r.verify()


def test_zstd_frame_declaring_a_different_size_is_refused_before_decoding(tmp_path: Path) -> None:
    zqs = _bomb_file(tmp_path, 64 << 20, declare_size=True)
    with ShardReader(zqs) as r, pytest.raises(ShardFormatError, match=r"group layer\.0 frame 0 .*declares 67108864"):
        r.read_layer(0)


def test_second_zstd_frame_counts_towards_the_declared_size(tmp_path: Path) -> None:
    zqs = _bomb_file(tmp_path, 1 << 20, declare_size=True, second_frame=True)
    with ShardReader(zqs) as r, pytest.raises(ShardFormatError, match="more than the declared"):
        r.read_layer(0)


def test_frame_shorter_than_declared(tmp_path: Path) -> None:
    zqs = packed_checkpoint(tmp_path, "bfloat16", byte_group=False)
    doc, _ = read_header(zqs)
    short = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(frame_of(doc, "layer.2")["size"] - 2))
    end = zqs.stat().st_size
    with open(zqs, "ab") as f:
        f.write(short)
    rewrite_header(zqs, lambda d: frame_of(d, "layer.2").update(offset=end, stored_size=len(short), crc32=crc32(short)))
    with ShardReader(zqs) as r, pytest.raises(ShardFormatError, match=r"group layer\.2 frame 0 .*fewer than the declared"):
        r.read_layer(2)


# ---- not a shard file at all ------------------------------------------------------------


def test_pickle_renamed_to_zqs(tmp_path: Path) -> None:
    path = tmp_path / "model.zqs"
    path.write_bytes(pickle.dumps({"model.embed_tokens.weight": [0.0] * 64}))
    assert "pickle" in open_error(path)


def test_torch_save_renamed_to_zqs(tmp_path: Path) -> None:
    path = tmp_path / "model.zqs"
    torch.save({"w": torch.zeros(8)}, path)
    assert "zip" in open_error(path)


def test_safetensors_renamed_to_zqs(tmp_path: Path) -> None:
    packed_checkpoint(tmp_path)
    path = tmp_path / "model.zqs"
    path.write_bytes((tmp_path / "hf" / "model.safetensors").read_bytes())
    assert "safetensors" in open_error(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "model.zqs"
    path.write_bytes(b"")
    assert "shorter than" in open_error(path)


# ---- property: any header edit parses fully checked or fails cleanly ----------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], int]:
    zqs = packed_checkpoint(tmp_path_factory.mktemp("base"), "bfloat16", byte_group="always", max_frame_bytes=8000)
    doc, _ = read_header(zqs)
    return doc, zqs.stat().st_size


_NASTY_INTS = st.sampled_from([-1, 0, 1, 2, 3, 7, 24, 4095, 4096, 2**31, 2**32, 2**40, 2**63, 2**64, -(2**63)])
_JSON = st.recursive(
    st.none() | st.booleans() | _NASTY_INTS | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
_KEYS = st.sampled_from(["offset", "stored_size", "size", "codec", "crc32", "element_size", "block_size", "name",
                         "dtype", "shape", "frame", "frames", "tensors", "groups", "num_layers", "config",
                         "source", "files", "metadata", "index_metadata", "tokenizer_files", "extra"])


def _mutate(data: st.DataObject, doc: Any) -> Any:
    """One random edit somewhere in the JSON tree: replace, delete, add, or duplicate."""
    parent, key = None, None
    node = doc
    while isinstance(node, (dict, list)) and node and data.draw(st.integers(0, 3)) > 0:
        parent = node
        key = data.draw(st.sampled_from(sorted(node))) if isinstance(node, dict) else data.draw(
            st.integers(0, len(node) - 1))
        node = node[key]
    op = data.draw(st.sampled_from(["replace", "delete", "add", "duplicate", "number"]))
    if parent is None:
        return data.draw(_JSON) if op == "replace" else doc
    if op == "replace":
        parent[key] = data.draw(_JSON)
    elif op == "number":
        parent[key] = data.draw(_NASTY_INTS)
    elif op == "delete":
        del parent[key]
    elif op == "add":
        if isinstance(parent, dict):
            parent[data.draw(_KEYS)] = data.draw(_JSON)
        else:
            parent.insert(key, data.draw(_JSON))
    elif isinstance(parent, list):
        parent.append(copy.deepcopy(parent[key]))
    else:
        parent[data.draw(_KEYS)] = copy.deepcopy(parent[key])
    return doc


def _assert_fully_checked(h: Header, header_bytes: int, file_size: int) -> None:
    assert [g.name for g in h.groups] == group_names(h.num_layers)
    spans = sorted((f.offset, f.end) for g in h.groups for f in g.frames if f.stored_size)
    start = PREAMBLE.size + header_bytes
    for a, b in spans:
        assert start <= a <= b <= file_size
        start = b
    for g in h.groups:
        numbers = [n for f in g.frames for n in (f.offset, f.stored_size, f.size, f.crc32)]
        numbers += [n for t in g.tensors for n in (t.frame, t.offset, t.size, *t.shape)]
        assert all(type(n) is int and n >= 0 for n in numbers)
    names = [t.name for g in h.groups for t in g.tensors]
    assert len(names) == len(set(names))
    for g in h.groups:
        for k, f in enumerate(g.frames):
            held = [t for t in g.tensors if t.frame == k]
            assert sum(t.size for t in held) == f.size
            assert all(0 <= t.offset and t.offset + t.size <= f.size for t in held)
        for t in g.tensors:
            assert t.size == SAFETENSORS_SIZES[t.dtype] * int(np.prod(t.shape, dtype=object))


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


def _parse(raw: bytes, file_size: int) -> Header | None:
    try:
        return parse_header(raw, crc32(raw), file_size=file_size)
    except ShardFormatError:
        return None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_headers_parse_checked_or_fail_cleanly(base: tuple[dict[str, Any], int], data: st.DataObject) -> None:
    doc, file_size = copy.deepcopy(base[0]), base[1]
    for _ in range(data.draw(st.integers(1, 3))):
        doc = _mutate(data, doc)
    raw = _dumps(doc)
    h = _parse(raw, file_size)
    if h is not None:
        _assert_fully_checked(h, len(raw), file_size)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_byte_flipped_headers_parse_checked_or_fail_cleanly(base: tuple[dict[str, Any], int], data: st.DataObject) -> None:
    original = _dumps(base[0])
    raw = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    h = _parse(bytes(raw), base[1])
    if h is not None:
        _assert_fully_checked(h, len(raw), base[1])
    if bytes(raw) != original:  # behind the original preamble, the stored crc no longer matches
        preamble = PREAMBLE.pack(b"\x89ZQS\r\n\x1a\n", VERSION, crc32(original), len(raw))
        _, stored_crc = decode_preamble(preamble, base[1])
        with pytest.raises(ShardFormatError, match="checksum"):
            parse_header(bytes(raw), stored_crc, file_size=base[1])
