"""`.zqs` shard file -> the HF safetensors checkpoint it was packed from.

`unpack` writes the same safetensors layout back: same file names, tensor order, dtypes,
shapes, bytes and `__metadata__`, plus config.json, the index (if there was one) and the
tokenizer files. Tensors decode straight into the memory-mapped output files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from weights_tool.checkpoint import INDEX_FILE, encode_safetensors_header
from weights_tool.reader import ShardReader


def unpack(zqs_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, progress: bool = False) -> Path:
    """Write the checkpoint a `.zqs` file was packed from: safetensors files, index, config, tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with ShardReader(zqs_path) as reader:
        h = reader.header
        dests: dict[str, np.ndarray] = {}
        written: list[tuple[Path, Path, np.memmap | None]] = []
        try:
            for sf in h.source_files:
                tmp, final = out / f".{sf.name}.tmp", out / sf.name
                entries = [reader.tensors[name] for name in sf.tensors]
                head, data_size = encode_safetensors_header(((t.name, t.dtype, t.shape) for t in entries), sf.metadata)
                with open(tmp, "wb") as f:
                    f.write(head)
                    f.truncate(len(head) + data_size)
                data = None
                if data_size:  # the tensors decode straight into the mapped file
                    data = np.memmap(tmp, dtype=np.uint8, mode="r+", offset=len(head), shape=(data_size,))
                    pos = 0
                    for t in entries:
                        dests[t.name] = data[pos : pos + t.size]
                        pos += t.size
                written.append((tmp, final, data))
            total = sum(g.size for g in h.groups)
            with tqdm(total=total, unit="B", unit_scale=True, desc="unpack", disable=None if progress else True) as bar:
                for g in h.groups:
                    reader.read_group(g.name, into=dests)
                    bar.update(g.size)
            dests.clear()
            for tmp, final, data in written:
                if data is not None:
                    data.flush()
                os.replace(tmp, final)
        finally:
            dests.clear()
            for tmp, _, _ in written:
                tmp.unlink(missing_ok=True)
        _write_text(out / "config.json", json.dumps(h.config, indent=2) + "\n")
        for name, text in h.tokenizer_files.items():
            _write_text(out / name, text)
        if h.index_metadata is not None:
            weight_map = {t: sf.name for sf in h.source_files for t in sf.tensors}
            index = {"metadata": h.index_metadata, "weight_map": dict(sorted(weight_map.items()))}
            _write_text(out / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    return out


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(text.encode("utf-8"))
    os.replace(tmp, path)
