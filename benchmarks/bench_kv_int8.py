"""8-bit KV caches (`actor.kv_dtype: int8`) against the model's dtype, side by side in one run: what they buy a
batch's decode step, and what they change in its tokens.

    .venv/bin/python -m benchmarks.bench_kv_int8           # ~2 min; writes benchmarks/results/kv_int8.md
    .venv/bin/python -m benchmarks.bench_kv_int8 --quick   # a harness check; writes .cache/bench/kv_int8/kv_int8.md

Speed: the demo model (`small`, bf16, as bench_batch), the actors' engine on make serve's threads, one engine per
(batch size, KV dtype); at each context every engine's decode steps take turns, one of each
(bench_batch.step_times), so the host's drift slows both dtypes alike. Per-row TPOT and tokens/s at batch 8 against
batch 1 are the medians of each repeat's own ratio, as in batch.md (issue goals: tokens/s >= 4x, TPOT <= 1.5x at
1,024-token contexts). The decode-attention kernel alone is timed the same way for both caches.

Tokens: SmolLM2-135M-Instruct's real weights (the zqs `make serve` fetches). Each prompt's greedy text under fp32
compute (the reference) is fed, teacher-forced, through bf16 compute with bf16 caches (the default here) and with
8-bit caches: per step, the KL divergence of the next-token distribution from the reference's, and top-1 agreement.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from actors.actor_config import ActorConfig
from actors.attention import decode_kernel
from actors.engine import Engine
from actors.events import TokenEvent
from actors.layer_loader import load_zqs
from actors.model import RowInput
from actors.sampling import SamplingParams
from actors.tokenizer import Message
from benchmarks.bench_batch import attention_probe, raise_errors, step_times
from benchmarks.common import (
    cores,
    cpu_model,
    load_average,
    python_version,
    served_threads,
    version_of,
    was_busy,
)
from weights_tool.demo import demo_model

log = logging.getLogger("bench_kv_int8")

SMOLLM2 = Path(".cache/models/smollm2-135m-instruct.zqs")
DTYPES = ("bf16", "int8")
PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain what a hash table is to a new programmer.",
    "List three ways to save energy at home.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Why is the sky blue?",
)


def long_prompt(tokens: int) -> str:
    """A real document of about `tokens` tokens to summarise: this project's README, cut."""
    text = Path("README.md").read_text()
    return "Summarise the following text in three sentences.\n\n" + text[: tokens * 4]


def measure_speed(batches: tuple[int, ...], contexts: tuple[int, ...], steps: int, repeats: int) -> dict:
    actor = ActorConfig()
    model, tokenizer = load_zqs(demo_model(".cache/demo", "small"), compute_dtype=actor.compute_dtype,
                                is_weight_packed=actor.is_weight_packed)
    engines = {f"{kv}/{b}": Engine(model, tokenizer, max_batch=b, prefill_chunk_tokens=256, is_kv_int8=kv == "int8")
               for kv in DTYPES for b in batches}
    top, long = max(batches), max(contexts)
    probes = ({f"attention/{kv}": attention_probe(model, top, long, kv == "int8") for kv in DTYPES}
              if decode_kernel(model.dtype) is not None else {})
    out: dict = {"steps": {}, "probes": {}, "dtype": str(model.dtype).removeprefix("torch."),
                 "threads": torch.get_num_threads(),
                 "kv_bytes": {kv: model.config.kv_bytes_per_token(str(model.dtype).removeprefix("torch."),
                                                                  kv == "int8") for kv in DTYPES}}
    step_times(engines, 32, 4)  # warm-up
    for repeat in range(repeats):
        for context in contexts:
            times, probed = step_times(engines, context, steps, probes if context == long else None)
            for key, t in times.items():
                out["steps"].setdefault(f"{context}/{key}", []).append(t)
            for key, t in probed.items():
                out["probes"].setdefault(key, []).append(t)
            log.info("repeat %d, context %d: %s", repeat, context,
                     ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in times.items()))
    return out


def measure_tokens(zqs: Path, max_tokens: int, long_tokens: int) -> dict:
    """Each prompt's greedy continuation under fp32 (the reference), then that text fed token by token through bf16
    compute with bf16 caches and with 8-bit ones (teacher-forced: every step sees the same history): per step, the
    KL divergence of each one's next-token distribution from the reference's, and whether its top token is the
    reference's."""
    prompts = [*PROMPTS, long_prompt(long_tokens)]
    reference, tokenizer = load_zqs(zqs, compute_dtype="float32", is_weight_packed=True)
    bf16 = load_zqs(zqs, compute_dtype="auto", is_weight_packed=True)[0]
    runs = {"bf16": (bf16, False), "int8": (bf16, True)}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engine = Engine(reference, tokenizer)
    engine.eos_token_ids = frozenset()  # every prompt to max_tokens: as many steps to compare
    out: dict = {"dtype": str(bf16.dtype).removeprefix("torch."), "prompts": []}
    for prompt in prompts:
        ids = tokenizer.encode_chat([Message("user", prompt)])
        text: list[int] = []
        engine.add(ids, params, lambda e, out=text: _collect(e, out))
        while engine.has_work:
            engine.step()
        ref = _forced_logits(reference, ids, text, False)
        row: dict = {"prompt_tokens": len(ids)}
        for name, (model, is_int8) in runs.items():
            logits = _forced_logits(model, ids, text, is_int8)
            kl = torch.nn.functional.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                            reduction="none").sum(-1)  # [steps]: KL(reference || this)
            row[name] = {"kl": kl.tolist(), "top1": (logits.argmax(-1) == ref.argmax(-1)).tolist()}
        out["prompts"].append(row)
        log.info("%d-token prompt: mean KL bf16 %.2e, int8 %.2e", len(ids), statistics.mean(row["bf16"]["kl"]),
                 statistics.mean(row["int8"]["kl"]))
    return out


@torch.inference_mode()
def _forced_logits(model, prompt: list[int], text: list[int], is_int8: bool) -> torch.Tensor:
    """The prompt prefilled, then `text` fed one token a step (decode steps, the kernels' path): the logits before
    each of text's tokens, [len(text), V] fp32."""
    caches = model.new_row_cache(len(prompt) + len(text), is_int8=is_int8)
    logits = [model.forward_rows(torch.tensor(prompt), [RowInput(caches, 0, len(prompt))])[0]]
    for i, token in enumerate(text[:-1]):
        logits.append(model.forward_rows(torch.tensor([token]), [RowInput(caches, len(prompt) + i, 1)])[0])
    return torch.stack(logits).float()


def _collect(event, out: list[int]) -> None:
    raise_errors(event)
    if isinstance(event, TokenEvent):
        out.append(event.token_id)


def _ratios(data: dict, context: int, kv: str, batch: int, top: int) -> list[float]:
    """Each repeat's step at `top` rows over its step at `batch` rows (the same KV dtype)."""
    return [t / o for t, o in zip(data["steps"][f"{context}/{kv}/{top}"], data["steps"][f"{context}/{kv}/{batch}"],
                                  strict=True)]


def report(speed: dict, tokens: dict | None, batches, contexts, repeats, steps, command, elapsed_s, load) -> str:
    med = {k: statistics.median(v) for k, v in speed["steps"].items()}
    top = max(batches)
    lines = ["# 8-bit KV caches against the model's dtype", "", f"Command: `{command}`", "",
             f"Machine: {cores()} cores, {cpu_model()}, Python {python_version()}, torch {version_of('torch')}; "
             f"{speed['threads']} torch thread(s) (make serve's actors' setting). Load average {load[0]:.2f} at the "
             f"start{' (busy: other work shared the machine)' if was_busy(load[0]) else ''}, {load[1]:.2f} at the "
             f"end; {elapsed_s / 60:.1f} min.", "",
             "## Decode steps", "",
             "The demo's `small` preset (100M parameters, 12 layers, 12 heads / 4 KV heads of 64), computed in "
             f"{speed['dtype']}, packed as the actors pack it; KV bytes a position: {speed['kv_bytes']['bf16']:,} "
             f"(bf16) against {speed['kv_bytes']['int8']:,} (8-bit values and an fp32 scale a head). Each figure the "
             f"median of {repeats} repeats of the median of {steps} timed steps, every engine's steps in turn.", "",
             "| context | batch | bf16 KV step (ms) | 8-bit KV step (ms) | 8-bit ÷ bf16 |", "|--:|--:|--:|--:|--:|"]
    for context in contexts:
        for b in batches:
            one, eight = med[f"{context}/bf16/{b}"], med[f"{context}/int8/{b}"]
            lines.append(f"| {context} | {b} | {one * 1e3:.1f} | {eight * 1e3:.1f} | {eight / one:.2f} |")
    lines += ["", f"### Batch {top} against batch 1 (issue 25's goals: tokens/s >= 4x, per-row TPOT <= 1.5x)", ""]
    for context in contexts:
        for kv in DTYPES:
            per_repeat = sorted(_ratios(speed, context, kv, 1, top))
            tpot = statistics.median(per_repeat)
            lines.append(f"- context {context}, {kv} KV: tokens/s **{top / tpot:.2f}x** batch 1 (goal >= 4: "
                         f"{'met' if top / tpot >= 4 else 'missed'}), per-row TPOT **{tpot:.2f}x** (goal <= 1.5: "
                         f"{'met' if tpot <= 1.5 else 'missed'}); per repeat {per_repeat[0]:.2f}-{per_repeat[-1]:.2f}.")
    if speed["probes"]:
        a = {kv: statistics.median(speed["probes"][f"attention/{kv}"]) for kv in DTYPES}
        long = max(contexts)
        read = {kv: top * (long + 1) * speed["kv_bytes"][kv] for kv in DTYPES}
        lines += ["", f"The decode-attention kernel alone for {top} rows at {long} positions, every layer, in the same "
                  f"turns: **{a['bf16'] * 1e3:.2f} ms** over bf16 caches ({read['bf16'] / a['bf16'] / 1e9:.0f} GB/s "
                  f"of KV), **{a['int8'] * 1e3:.2f} ms** over 8-bit ones ({read['int8'] / a['int8'] / 1e9:.0f} GB/s):"
                  f" {a['int8'] / a['bf16']:.2f}x."]
    if tokens is None:
        lines += ["", "## Tokens", "", f"Skipped: {SMOLLM2} is missing (`make serve` fetches it)."]
        return "\n".join(lines) + "\n"
    rows = tokens["prompts"]
    n = len(rows[0]["bf16"]["kl"])
    lines += ["", "## Tokens", "",
              f"SmolLM2-135M-Instruct's real weights. Each prompt's greedy continuation of {n} tokens under fp32 "
              "compute (the reference), then the same text fed a token a step through "
              f"{tokens['dtype']} compute with its own caches and with 8-bit caches, every step seeing the reference's "
              "history (decode steps: the kernels' path). Per step, the KL divergence of the next-token distribution "
              "from the reference's, and whether the top token is the reference's; the means over the steps:", "",
              "| prompt tokens | bf16 KV: KL | 8-bit KV: KL | bf16 KV: top token as fp32 | 8-bit KV: top token as fp32 |",
              "|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['prompt_tokens']} | {statistics.mean(r['bf16']['kl']):.2e} | "
                     f"{statistics.mean(r['int8']['kl']):.2e} | {statistics.mean(r['bf16']['top1']):.1%} | "
                     f"{statistics.mean(r['int8']['top1']):.1%} |")
    every = {k: [x for r in rows for x in r[k]["kl"]] for k in DTYPES}
    top1 = {k: statistics.mean([x for r in rows for x in r[k]["top1"]]) for k in DTYPES}
    lines += ["", f"Over all {len(every['bf16'])} steps: mean KL **{statistics.mean(every['bf16']):.2e}** (bf16 caches) "
              f"against **{statistics.mean(every['int8']):.2e}** (8-bit), the largest {max(every['bf16']):.2e} and "
              f"{max(every['int8']):.2e}; the top token is the reference's at **{top1['bf16']:.1%}** and "
              f"**{top1['int8']:.1%}** of the steps."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two sizes, one repeat, few tokens: a harness check")
    parser.add_argument("--out", help="default benchmarks/results/kv_int8.md (.cache/bench/kv_int8/ with --quick)")
    args = parser.parse_args(argv)
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_kv_int8",
                          *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(served_threads())
    batches, contexts, steps, repeats = ((1, 8), (128,), 6, 1) if args.quick else ((1, 8), (128, 1024), 24, 5)
    out = Path(args.out or (".cache/bench/kv_int8/kv_int8.md" if args.quick else "benchmarks/results/kv_int8.md"))
    started, load0 = time.time(), load_average()[0]
    speed = measure_speed(batches, contexts, steps, repeats)
    tokens = measure_tokens(SMOLLM2, 8 if args.quick else 64, 200 if args.quick else 900) if SMOLLM2.exists() else None
    text = report(speed, tokens, batches, contexts, repeats, steps, command, time.time() - started,
                  (load0, load_average()[0]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
