"""Command-line generation: `python -m actors.cli --model DIR_OR_ZQS --prompt ...`.

`--demo DIR` synthesises a random-weight model of a named preset into DIR (once), packs
it into a `.zqs` file and generates from that, so it runs with nothing downloaded
(weights_tool/demo.py makes it).
Random weights produce fluent-looking nonsense; the point is the path, not the prose.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from actors.chat import GenerationRequest
from actors.checkpoint import load_hf_checkpoint
from actors.engine import Engine
from actors.events import FinishEvent, TokenEvent
from actors.layer_loader import load_zqs
from actors.sampling import SamplingParams
from actors.tokenizer import Message, Tokenizer
from weights_tool.demo import demo_model


def load(path: Path, device: str) -> tuple[torch.nn.Module, Tokenizer]:
    if path.suffix == ".zqs":
        return load_zqs(path, device=device)
    model, config = load_hf_checkpoint(path, device=device)
    return model, Tokenizer.from_dir(path, eos_token_ids=config.eos_token_ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="an HF checkpoint directory or a .zqs file")
    src.add_argument("--demo", type=Path, metavar="DIR", help="synthesise (once) and use a demo model in DIR")
    p.add_argument("--preset", default="small", help="the demo model's shape (see weights_tool.synth)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--system")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="a stop sequence (repeatable)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    path = demo_model(args.demo, args.preset) if args.demo else args.model
    t0 = time.perf_counter()
    model, tokenizer = load(path, args.device)
    load_s = time.perf_counter() - t0
    engine = Engine(model, tokenizer)
    try:
        sampling = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, seed=args.seed, stop_sequences=tuple(args.stop),
        )
        request = GenerationRequest((Message("user", args.prompt),), sampling, system=args.system)
        prompt = engine.prepare(request)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finish = None
    for event in engine.generate(prompt, sampling):
        if isinstance(event, TokenEvent):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, FinishEvent):
            finish = event
    assert finish is not None
    ttft = finish.first_token_time - finish.compute_start
    decode_s = finish.last_token_time - finish.first_token_time
    tps = (finish.output_tokens - 1) / decode_s if decode_s > 0 else float("nan")
    print(
        f"\n[{finish.stop_reason}] load {load_s:.2f}s, input {finish.input_tokens} tok, "
        f"output {finish.output_tokens} tok, TTFT {ttft * 1000:.0f} ms, decode {tps:.1f} tok/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
