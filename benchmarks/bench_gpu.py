"""Hot, warm and cold time to first token on one GPU, for the `llama-3.2-1b` shape (random weights).

The GPU path of everything the CPU benchmarks measure: request actors with `num_gpus=1`
load through pinned staging buffers and a side stream (weights_tool/layer_stream.py,
`CudaLayerStream`), and a warm actor creates its CUDA context and allocates the model in
its constructor, ahead of any request. Per repeat, from the caller of the actor (where
the ingress stands), call -> first token:

    cold   a fresh actor, the request sent right after the spawn call
    warm   an actor started with `warm_layers=N`, the request sent once ready() answered
    hot    the same request again on an actor that stayed hot

    .venv/bin/python -m benchmarks.bench_gpu                       # run by benchmarks/gpu_check.sh
    .venv/bin/python -m benchmarks.bench_gpu --device cpu --preset tiny --repeats 1   # the harness, on a CPU

Writes the markdown report named by `--out` (default benchmarks/results/gpu.md).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from actors.actor_config import ActorConfig
from actors.actor_names import new_actor_name
from actors.messages import ActorRequest
from actors.request_actor import spawn
from actors.sampling import SamplingParams
from actors.shard_header import open_zqs
from benchmarks.actor_calls import first_token, kill, wait_gone
from benchmarks.bench_cold_start import prompt_of_length
from benchmarks.bench_warm import NAMESPACE
from benchmarks.common import cores, python_version, version_of
from weights_tool.pack import pack
from weights_tool.synth import synthesize

log = logging.getLogger("bench_gpu")
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def prepare(preset: str, dtype: str, cache: Path) -> Path:
    ckpt, zqs = cache / f"{preset}-{dtype}", cache / "gpu" / f"{preset}-{dtype}.zqs"
    if not (ckpt / "config.json").is_file():
        synthesize(preset, ckpt, dtype=dtype)
    if not zqs.is_file():
        zqs.parent.mkdir(parents=True, exist_ok=True)
        pack(ckpt, zqs, level=1)  # the fast level: packing must fit the check's time
    return zqs.resolve()


def one(ray: Any, zqs: Path, config: ActorConfig, prompt: tuple[int, ...], tier: str, warm_layers: int) -> float:
    name = new_actor_name("bench-gpu")
    actor = spawn(str(zqs), config, name, warm_layers=warm_layers if tier == "warm" else None)
    request = ActorRequest(name, prompt, ONE_TOKEN, keep_hot=tier == "hot")
    try:
        if tier == "warm":
            ray.get(actor.ready.remote(300.0), timeout=360)
            time.sleep(0.2)
        if tier == "hot":
            first_token(ray, actor.generate.remote(request))  # its cold request; the next one is timed
        call = time.time()
        first = first_token(ray, actor.generate.remote(ActorRequest(f"{name}-t", prompt, ONE_TOKEN)))
        wait_gone(ray, name, NAMESPACE)
        return first - call
    finally:
        kill(ray, actor)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm-layers", type=int, default=None, help="default: a quarter of the layers")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--cache-dir", default=".cache/bench")
    parser.add_argument("--out", default="benchmarks/results/gpu.md")
    parser.add_argument("--address", default=None,
                        help="a running Ray cluster's address (default: start a local one for the run)")
    args = parser.parse_args(argv)
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_gpu", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        log.error("no CUDA device is visible to torch %s: nothing to measure (--device cpu checks the harness)",
                  version_of("torch"))
        return 3
    import ray

    t0, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    zqs = prepare(args.preset, args.dtype, Path(args.cache_dir))
    reader, mconfig, tokenizer = open_zqs(zqs)
    reader.close()
    prompt = prompt_of_length(tokenizer, mconfig.max_position_embeddings, args.prompt_tokens)
    warm_layers = args.warm_layers if args.warm_layers is not None else max(1, mconfig.num_layers // 4)
    is_cuda = args.device == "cuda"
    config = ActorConfig(namespace=NAMESPACE, num_cpus=1, num_gpus=1.0 if is_cuda else 0.0, load_threads=2,
                         compute_threads=1)
    if args.address:
        ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
    else:
        ray.init(num_cpus=4, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    results: dict[str, list[float]] = {"cold": [], "warm": [], "hot": []}
    try:
        for rep in range(args.repeats):
            for tier in ("cold", "warm", "hot")[rep % 3:] + ("cold", "warm", "hot")[:rep % 3]:
                results[tier].append(one(ray, zqs, config, prompt, tier, warm_layers))
                log.info("repeat %d, %s: TTFT %.3f s", rep + 1, tier, results[tier][-1])
    finally:
        ray.shutdown()
    device = torch.cuda.get_device_name(0) if is_cuda else f"CPU ({cores()} cores)"
    cold = statistics.median(results["cold"])
    lines = [
        f"# Hot, warm and cold TTFT on {'one GPU' if is_cuda else 'the CPU (harness check)'}", "",
        f"Command: `{command}`", "",
        f"Run {started}, {(time.perf_counter() - t0) / 60:.1f} minutes. Device: {device}; torch {version_of('torch')}, "
        f"Python {python_version()}. Model: `{args.preset}` ({mconfig.num_layers} layers, "
        f"{mconfig.weight_bytes() / 2**30:.2f} GiB of {args.dtype} weights, random), `.zqs` at zstd level 1; "
        f"a {len(prompt)}-token prompt, one greedy output token; warm actors hold {warm_layers} layers. "
        "TTFT from the caller of the actor (where the ingress stands): call -> first token.", "",
        "| tier | what is ready before the request | TTFT median s | min–max s | × cold |", "|---|---|--:|---|--:|",
    ]
    what = {"cold": "nothing: the spawn call comes with the request",
            "warm": f"process, CUDA context, model allocated, embeddings + {warm_layers} layers",
            "hot": "everything: a second request"}
    for tier, xs in results.items():
        med = statistics.median(xs)
        lines.append(f"| {tier} | {what[tier]} | {med:.3f} | {min(xs):.3f}–{max(xs):.3f} | {med / cold:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
