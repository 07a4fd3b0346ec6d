"""Batched decoding against one request at a time, side by side in one run: what a hot actor's batch buys.

    .venv/bin/python -m benchmarks.bench_batch            # ~3 min; writes benchmarks/results/batch.md
    .venv/bin/python -m benchmarks.bench_batch --quick    # seconds; writes .cache/bench/batch/batch.md

The demo model (`small`: ~100M parameters, bf16, the serving default), the actors' engine
(`actors/engine.py`) on the torch threads make serve's actors compute with (configs/serve.yaml). For each batch size B and
context length, an engine of its own takes B rows and steps them until every row decodes;
then the sizes' decode steps take turns, one of each, so a noisy neighbour slows every
size alike; each figure is the median over the plan's repeats.

- decode tokens/s = B / step time; per-row TPOT = the step time; both as ratios to B = 1
  at the same context (the issue's goals: tokens/s at 8 >= 4x batch 1, TPOT <= 1.5x).
- the rule scorer's batching constants (serve_app/scorer.py), fitted: `batch_row_cost`, a
  step's growth per extra row as a share of a one-row step, at the shortest context
  (where KV reads are negligible); `kv_read_bytes_per_s`, the extra KV bytes the longest
  context's steps read over the shortest's, per extra second they took.
- A joiner's stall: the longest step the running rows see while a long prompt joins
  them, with the prompt chunked (`prefill_chunk_tokens`) and whole.
- Packed linear weights (`actors/packed_weights.py`, the actors' default) against the plain
  kernels: every step size timed with both, in the same repeat.
- Where the largest batch's step goes at the longest context: the decode-attention kernel alone
  (every layer, random caches of the model's shape) against the whole step, what the TPOT goal
  would leave it for its KV bytes, and a plain fp32 sum over as many bytes (what reading them
  costs at all), in the same turns.
- The MLP's activation on 8 rows and on a 256-token chunk: torch's ops against csrc/silu_mul.cpp.
- The two CPU kernel choices the runtime makes (actors/layers.py, actors/attention.py):
  one bf16 row through `torch.mv` against `F.linear` on the model's MLP weight, and one
  decode query's attention over 1,024 cached positions with SDPA's `enable_gqa` against
  the query heads folded onto their KV head; each the best of 200-call medians.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from actors import bf16_linear, cpu_kernels
from actors.actor_config import ActorConfig
from actors.attention import decode_kernel
from actors.engine import Engine
from actors.kv_cache import KVCache
from actors.layer_loader import load_zqs
from actors.layers import packed_linear, silu_mul
from actors.packed_weights import pack, packed_kernel_of
from actors.sampling import SamplingParams
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

log = logging.getLogger("bench_batch")


@dataclass(frozen=True)
class Plan:
    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]  # prompt tokens per row
    steps: int
    repeats: int
    join_prompt: int  # the joining prompt of the stall measurement
    chunk: int  # prefill_chunk_tokens


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 30000, (n,), generator=g).tolist()


def raise_errors(event) -> None:
    if isinstance(event, BaseException):
        raise event


def step_time(engine: Engine, batch: int, context: int, steps: int) -> float:
    """Median seconds of one decode step of `engine` holding `batch` rows (at most its `max_batch`) of `context`
    prompt tokens each (bench_engine's cells, bench_linear, bench_bf16_linear)."""
    return step_times({batch: engine}, context, steps, num_rows={batch: batch})[0][batch]


def step_times(engines: dict, context: int, steps: int, probes: dict[str, Callable[[], None]] | None = None,
               num_rows: dict | None = None) -> tuple[dict, dict[str, float]]:
    """Median seconds of one decode step for each engine (keyed as given; each holding `num_rows[key]` rows, by
    default its `max_batch`, of `context` prompt tokens), and of one call of each of `probes`. The sizes' steps are interleaved, one of each in turn, the
    probes among them: this host's memory bandwidth drifts with its neighbours over seconds (the per-repeat ratios
    batch.md reports), and a ratio between sizes must not measure the drift."""
    probes = probes or {}
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0)
    num_rows = num_rows or {}
    rows = {b: [e.add(random_prompt(context, i), params, raise_errors) for i in range(num_rows.get(b, e.max_batch))]
            for b, e in engines.items()}
    for b, e in engines.items():
        while any(r.num_prefilled < len(r.prompt) for r in rows[b]) or any(r.num_out == 0 for r in rows[b]):
            e.step()
        e.step()  # one decode step untimed: first-touch of this size's buffers
    turns: dict = {**{b: e.step for b, e in engines.items()}, **probes}
    times: dict = {key: [] for key in turns}
    for _ in range(steps):
        for key, run in turns.items():
            t0 = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - t0)
    for b, e in engines.items():
        for r in rows[b]:
            e.cancel(r)
        e.step()
        assert not e.has_work
    medians = {key: statistics.median(t) for key, t in times.items()}
    return {b: medians[b] for b in engines}, {name: medians[name] for name in probes}


def join_stall(engine: Engine, prompt: int, running: int, steps_before: int = 3) -> float:
    """The longest step `running` decoding rows see while a `prompt`-token request joins them."""
    params = SamplingParams(max_tokens=2000, temperature=0.0)
    rows = [engine.add(random_prompt(64, i), params, raise_errors) for i in range(running)]
    for _ in range(steps_before + 2):
        engine.step()
    joiner = engine.add(random_prompt(prompt, 99), SamplingParams(max_tokens=4, temperature=0.0), raise_errors)
    longest = 0.0
    while joiner.num_out == 0:
        t0 = time.perf_counter()
        engine.step()
        longest = max(longest, time.perf_counter() - t0)
    for r in [*rows, joiner]:
        engine.cancel(r)
    while engine.has_work:
        engine.step()
    return longest


def _call_us(run, calls: int = 200, repeats: int = 5) -> float:
    """Microseconds a call, the best of `repeats` medians of `calls` timed calls."""
    run()
    best = float("inf")
    for _ in range(repeats):
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        best = min(best, statistics.median(times))
    return best * 1e6


def kernels(model) -> dict[str, float]:
    """The runtime's two CPU kernel choices, timed on this model's shapes (see the module docstring)."""
    import torch.nn.functional as F

    weight = model.model.layers[0].mlp.gate_proj.weight  # [intermediate, hidden]
    row = torch.randn(weight.shape[1]).to(weight.dtype)
    attn = model.model.layers[0].self_attn
    h, h_kv, d, positions = attn.num_heads, attn.num_kv_heads, attn.head_dim, 1024
    q = torch.randn(1, h, 1, d).to(weight.dtype)
    k, v = (torch.randn(1, h_kv, positions, d).to(weight.dtype) for _ in range(2))
    folded = q.view(1, h_kv, h // h_kv, d)
    packed = pack(model.model.layers[0].mlp.gate_proj, kernel="onednn").layers
    out = {} if not packed else {"packed_us": _call_us(
        lambda: packed_linear(row.view(1, -1), packed[0][1]))}
    if cpu_kernels.is_available():
        pairs = bf16_linear.pack(weight)
        out["pairs_us"] = _call_us(lambda: bf16_linear.linear(row.view(1, -1), pairs, weight.shape[0]))
        # The MLP's activation on its joined gate and up, [rows, 2I]: torch's ops as MLP.forward made them (in
        # place on the joined output, then the copy that makes the down projection's input contiguous) and
        # csrc/silu_mul.cpp's one pass; 8 decoding rows and a 256-token prompt chunk.
        inter = weight.shape[0]
        for rows in (8, 256):
            gate_up = torch.randn(rows, 2 * inter).to(weight.dtype)

            def torch_ops(gate_up=gate_up) -> torch.Tensor:
                joined = gate_up.clone()  # the ops write in place: on a copy, its cost timed below and taken off
                return F.silu(joined[:, :inter], inplace=True).mul_(joined[:, inter:]).contiguous()
            clone_us = _call_us(gate_up.clone)
            out[f"silu_torch_{rows}_us"] = _call_us(torch_ops) - clone_us
            out[f"silu_kernel_{rows}_us"] = _call_us(lambda gate_up=gate_up: silu_mul(gate_up))
    return out | {
        "mv_us": _call_us(lambda: torch.mv(weight, row)),
        "linear_us": _call_us(lambda: F.linear(row.view(1, -1), weight)),
        "sdpa_gqa_us": _call_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        "sdpa_folded_us": _call_us(lambda: F.scaled_dot_product_attention(folded, k, v)),
    }


def attention_probe(model, batch: int, context: int, is_int8: bool = False) -> Callable[[], None] | None:
    """One step's decode attention for `batch` rows with `context` cached positions each, every layer, through the
    kernel alone (random caches of the model's shape, 8-bit ones where `is_int8`); None where no kernel attends
    this dtype here."""
    if (kernel := decode_kernel(model.dtype)) is None:
        return None
    attn = model.model.layers[0].self_attn
    h, h_kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    layers = []  # per layer: the rows' key caches and their value caches, [1, H_kv, context + 1, D] each
    for _ in model.model.layers:
        rows = [KVCache(1, context + 1, h_kv, d, model.dtype, "cpu", is_int8) for _ in range(batch)]
        for c in rows:
            c.update(torch.arange(context + 1), *(torch.randn(1, h_kv, context + 1, d).to(model.dtype)
                                                  for _ in range(2)))
        layers.append(([c.k_cache for c in rows], [c.v_cache for c in rows]))
    qkv = torch.randn(batch, (h + 2 * h_kv) * d).to(model.dtype)
    pos, start = [context] * batch, [0] * batch

    def step() -> None:
        for k_caches, v_caches in layers:
            kernel(qkv, h, h_kv, k_caches, v_caches, pos, start, None, None)
    return step


def measure(plan: Plan, zqs: Path) -> dict:
    torch.set_num_threads(served_threads())  # as make serve's actors compute
    actor = ActorConfig()  # what the actors run: the main table (in fp32 on a CPU without bf16 arithmetic)
    is_packed = actor.is_weight_packed
    plain, tokenizer = load_zqs(zqs, compute_dtype=actor.compute_dtype)
    model = load_zqs(zqs, compute_dtype=actor.compute_dtype, is_weight_packed=True)[0] if is_packed else plain
    out: dict = {"steps": {}, "plain_steps": {}, "stall": {}, "is_packed": is_packed, "threads": torch.get_num_threads(),
                 "packed_kernel": packed_kernel_of(model) if is_packed else None,
                 "dtype": str(model.dtype).removeprefix("torch."),
                 "kv_bytes_per_token": model.config.kv_bytes_per_token(str(model.dtype).removeprefix("torch."))}
    engines = {chunk: Engine(model, tokenizer, max_batch=max(plan.batch_sizes), prefill_chunk_tokens=chunk)
               for chunk in (plan.chunk, 1_000_000)}
    # One engine per batch size, packed and (where packing is on) plain, so that their steps can take turns.
    sized = {b: Engine(model, tokenizer, max_batch=b, prefill_chunk_tokens=plan.chunk) for b in plan.batch_sizes}
    plain_sized = ({b: Engine(plain, tokenizer, max_batch=b, prefill_chunk_tokens=plan.chunk)
                    for b in plan.batch_sizes} if is_packed else {})
    out["kernels"] = kernels(plain)
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in plain.parameters())
    long, top = max(plan.contexts), max(plan.batch_sizes)
    # The top batch's attention beside its steps at the longest context, timed in the same turns.
    probes = {f"attention/{b}": probe for b in (1, top) if (probe := attention_probe(model, b, long)) is not None}
    if probes:  # what reading that many bytes costs at all: one fp32 sum over them, on the same threads
        plain = torch.randn(top * (long + 1) * out["kv_bytes_per_token"] // 4)
        probes["read"] = plain.sum
    for e in (sized, plain_sized):
        if e:
            step_times(e, 32, 4)  # warm-up
    for repeat in range(plan.repeats):
        for context in plan.contexts:
            for name, group in (("steps", sized), ("plain_steps", plain_sized)):
                if not group:
                    continue
                steps, probed = step_times(group, context, plan.steps,
                                           probes if name == "steps" and context == long else None)
                for batch, t in steps.items():
                    out[name].setdefault(f"{context}/{batch}", []).append(t)
                for probe, t in probed.items():
                    out.setdefault("probes", {}).setdefault(probe, []).append(t)
            log.info("repeat %d: context %d: %s ms a step", repeat, context,
                     ", ".join(f"batch {b} {out['steps'][f'{context}/{b}'][-1] * 1e3:.1f}" for b in plan.batch_sizes))
        for chunk, e in engines.items():
            stall = join_stall(e, plan.join_prompt, running=max(plan.batch_sizes) - 1)
            out["stall"].setdefault(str(chunk), []).append(stall)
            log.info("repeat %d: a %d-token joiner, chunk %d: longest step %.0f ms", repeat, plan.join_prompt,
                     chunk, stall * 1e3)
    return out


def report(plan: Plan, data: dict, command: str, elapsed_s: float, load: tuple[float, float]) -> str:
    med = {k: statistics.median(v) for k, v in data["steps"].items()}
    lines = [
        "# Batched decoding: tokens/s and TPOT against batch 1",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {cores()} cores, {cpu_model()}, Python "
        f"{python_version()}, torch {version_of('torch')}; {data.get('threads', 1)} torch thread(s) (make serve's "
        "actors' setting). "
        f"Load average {load[0]:.2f} at the start{' (busy: other work shared the machine)' if was_busy(load[0]) else ''}"
        f", {load[1]:.2f} at the end; {elapsed_s / 60:.1f} min.",
        "",
        "Model: the demo's `small` preset (100M parameters, 12 layers, hidden 768, 12 heads / 4 KV heads, vocab "
        f"32000, tied embeddings), stored bf16, computed in {data.get('dtype', 'bfloat16')} (`actor.compute_dtype: "
        "auto` on this CPU), through the actors' engine (`actors/engine.py`). Each row is the median "
        f"of {plan.repeats} repeats of the median of {plan.steps} timed decode steps; each batch size has an "
        "engine of its own and their steps take turns, one of each, so a host whose memory bandwidth drifts with "
        "its neighbours slows every size at the same moments; the ratios to batch 1 are the medians of each "
        "repeat's own ratio.",
        "",
        "| context (tokens per row) | batch | step (ms) = per-row TPOT | TPOT / batch 1 | decode tokens/s | tokens/s / batch 1 |",
        "|--:|--:|--:|--:|--:|--:|",
    ]
    for context in plan.contexts:
        for batch in plan.batch_sizes:
            t, ratio = med[f"{context}/{batch}"], statistics.median(_ratios(data, context, batch))
            lines.append(f"| {context} | {batch} | {t * 1e3:.1f} | {ratio:.2f} | {batch / t:.1f} | "
                         f"{batch / ratio:.2f} |")
    short, long = min(plan.contexts), max(plan.contexts)
    row_cost = statistics.median((med[f"{short}/{b}"] / med[f"{short}/1"] - 1) / (b - 1)
                                 for b in plan.batch_sizes if b > 1)
    kv_rates = [b * (long - short) * data["kv_bytes_per_token"] / (med[f"{long}/{b}"] - med[f"{short}/{b}"])
                for b in plan.batch_sizes if med[f"{long}/{b}"] > med[f"{short}/{b}"]]
    top = max(plan.batch_sizes)
    goals = []
    for context in plan.contexts:
        per_repeat = sorted(_ratios(data, context, top))
        tpot = statistics.median(per_repeat)
        speedup = top / tpot
        goals.append(f"- context {context}: tokens/s at batch {top} = **{speedup:.2f}x** batch 1 "
                     f"(goal >= 4: {'met' if speedup >= 4 else 'missed'}); per-row TPOT **{tpot:.2f}x** "
                     f"(goal <= 1.5: {'met' if tpot <= 1.5 else 'missed'}); TPOT ratio per repeat "
                     f"{per_repeat[0]:.2f}-{per_repeat[-1]:.2f}.")
    stall = {k: statistics.median(v) for k, v in data["stall"].items()}
    kern = data["kernels"]
    whole = stall[str(1_000_000)]
    lines += [
        "",
        "## Goals",
        "",
        *goals,
        "",
        "Fitted for the rule scorer (serve_app/scorer.py) and the simulator: a step grows by "
        f"**{row_cost:.3f}** of a one-row step per extra row at context {short} (`batch_row_cost`, the median "
        "over batch sizes), and the longer context's extra KV reads cost "
        + (f"**{statistics.median(kv_rates) / 1e9:.1f} GB/s** (`kv_read_bytes_per_s`; attention's compute on them "
           "included)." if kv_rates else "nothing measurable."),
        "",
        "## A long prompt joining a running batch",
        "",
        f"{top - 1} rows decode (64-token prompts) when a {plan.join_prompt}-token prompt joins; the longest "
        "step they see until the joiner's first token:",
        "",
        f"- prompt chunked at {plan.chunk} tokens a step: **{stall[str(plan.chunk)] * 1e3:.0f} ms**",
        f"- prompt whole in one step: **{whole * 1e3:.0f} ms**",
        "",
        "Chunking bounds what a joiner costs the running rows to one step of the chunk's size; the whole "
        "prompt in one step stalls every running row for all of it.",
        "",
        "## The runtime's CPU kernel choices, on this machine",
        "",
        "| kernel | µs a call | the runtime uses |",
        "|---|--:|---|",
        f"| one bf16 row × the MLP's gate weight, `torch.mv` | {kern['mv_us']:.0f} | "
        f"{'this' if kern['mv_us'] < kern['linear_us'] and not data['is_packed'] else ''} |",
        f"| the same, `F.linear` | {kern['linear_us']:.0f} | "
        f"{'this' if kern['linear_us'] <= kern['mv_us'] and not data['is_packed'] else ''} |",
        *([f"| the same, oneDNN's linear on the weight packed (`actors/packed_weights.py`) | {kern['packed_us']:.0f} | "
           f"{'this' if data.get('packed_kernel') == 'onednn' else ''} |"] if "packed_us" in kern else []),
        *([f"| the same, the weight in pairs for `actors/bf16_linear.py`'s kernel | {kern['pairs_us']:.0f} | "
           f"{'this' if data.get('packed_kernel') == 'bf16_linear' else ''} |"] if "pairs_us" in kern else []),
        *(line for rows in (8, 256) if f"silu_torch_{rows}_us" in kern for line in (
            f"| silu(gate) * up of {rows} rows, torch's `silu_`, `mul_` and the copy to contiguous | "
            f"{kern[f'silu_torch_{rows}_us']:.0f} | |",
            f"| the same, `csrc/silu_mul.cpp` in one pass | {kern[f'silu_kernel_{rows}_us']:.0f} | "
            f"{'this' if data.get('packed_kernel') == 'bf16_linear' else ''} |")),
        f"| one decode query over 1,024 positions, SDPA `enable_gqa` | {kern['sdpa_gqa_us']:.0f} | |",
        f"| the same, query heads folded onto their KV head | {kern['sdpa_folded_us']:.0f} | this |",
        "",
        "With packing off (`actor.is_weight_packed: false`), `actors/layers.py` times `mv` against `F.linear` "
        "once per process and keeps the faster (which one wins depends on the CPU); decode attention always folds.",
        "",
        *_packed_table(plan, data),
        *_attention_split(plan, data, med),
    ]
    return "\n".join(lines)


def _ratios(data: dict, context: int, batch: int) -> list[float]:
    """Each repeat's step at `batch` rows over its step at one row: the ratios the tables and goals take the median
    of. Paired within a repeat, since batch 1's step streams the weights and follows the host's memory bandwidth
    while batch 8's computes more and follows it less: medians taken apart would pair different moments."""
    return [b / o for b, o in zip(data["steps"][f"{context}/{batch}"], data["steps"][f"{context}/1"], strict=True)]


def _attention_split(plan: Plan, data: dict, med: dict[str, float]) -> list[str]:
    """The largest batch's step at the longest context: its attention against the rest, and the goal's budget."""
    long, top = max(plan.contexts), max(plan.batch_sizes)
    probes = data.get("probes", {})
    if "attention/1" not in probes or f"attention/{top}" not in probes:
        return []
    lines = [f"## Where batch {top}'s step goes at context {long}", "",
             "The decode-attention kernel alone (every layer, random caches of the model's shape), timed in turn "
             "with the steps above; the rest is the linear layers, norms and the engine's own work (each repeat's "
             "step less its attention, the median).", "",
             "| batch | step (ms) | attention (ms) | KV it reads (MB) | KV read rate (GB/s) | the rest (ms) |",
             "|--:|--:|--:|--:|--:|--:|"]

    def kv_bytes(b: int) -> float:
        return b * (long + 1) * data["kv_bytes_per_token"]

    def rests(b: int) -> list[float]:  # each repeat's step less its attention
        return [s - a for s, a in zip(data["steps"][f"{long}/{b}"], probes[f"attention/{b}"], strict=True)]

    for b in (1, top):
        a = statistics.median(probes[f"attention/{b}"])
        lines.append(f"| {b} | {med[f'{long}/{b}'] * 1e3:.1f} | {a * 1e3:.2f} | {kv_bytes(b) / 1e6:.0f} | "
                     f"{kv_bytes(b) / a / 1e9:.1f} | {statistics.median(rests(b)) * 1e3:.1f} |")
    # Per repeat: the top batch's rest over batch 1's whole step, and what a 1.5x TPOT leaves its attention.
    shares = sorted(r / o for r, o in zip(rests(top), data["steps"][f"{long}/1"], strict=True))
    share, one, kv_top = statistics.median(shares), med[f"{long}/1"], kv_bytes(top)
    budget = (1.5 - share) * one
    need = (f"{budget * 1e3:.1f} ms for its {kv_top / 1e6:.0f} MB of KV: **{kv_top / budget / 1e9:.0f} GB/s**"
            if budget > 0 else "nothing: the rest alone breaks it")
    lines += ["", f"Without its attention, batch {top}'s step is already **{share:.2f}x** batch 1's whole step "
              f"(per repeat {shares[0]:.2f}-{shares[-1]:.2f}: its linear layers multiply {top} rows, where one row "
              f"only streams the weights). A per-row TPOT of 1.5x batch 1's leaves its attention {need}, where it "
              f"reads them at {kv_top / statistics.median(probes[f'attention/{top}']) / 1e9:.0f} GB/s and batch 1's "
              f"step streams the model's {data['weight_bytes'] / 1e6:.0f} MB of weights at "
              f"{data['weight_bytes'] / one / 1e9:.0f} GB/s"
              + (f"; torch's fp32 sum over as many bytes in one tensor, in the same turns, reads "
                 f"{kv_top / statistics.median(probes['read']) / 1e9:.0f} GB/s." if "read" in probes else "."), ""]
    return lines


def _packed_table(plan: Plan, data: dict) -> list[str]:
    """The actors' packed linear weights against the plain kernels, step for step in the same repeat."""
    if not data["plain_steps"]:
        return []
    how = ({"onednn": "into oneDNN's layout; tokens are bit for bit the same (tests/runtime/test_packed_weights.py)",
            "bf16_linear": "in pairs for `actors/bf16_linear.py`'s AVX512-BF16 kernel (the LM head too, when tied); "
                           "products, and each step's logits, equal up to bf16 rounding (tests/runtime/test_bf16_linear.py)",
            "bf16_weights": "back to bf16 for `actors/bf16_weight_linear.py`'s AVX2 kernel, which widens them to fp32 "
                            "in registers (the LM head too, when tied; decoding rows attend in one call a layer); "
                            "products equal up to fp32 summation order (tests/runtime/test_bf16_weight_linear.py)"}
           .get(data.get("packed_kernel") or "onednn", str(data.get("packed_kernel"))))
    lines = ["## Packed linear weights against the plain kernels", "",
             "The same steps with the model's weights as loaded (`mv` or `F.linear`, chosen as above) and packed "
             f"as the actors pack them on this CPU (`actors/packed_weights.py`): {how}.", "",
             "| context | batch | plain step (ms) | packed step (ms) | plain ÷ packed |", "|--:|--:|--:|--:|--:|"]
    for context in plan.contexts:
        for batch in plan.batch_sizes:
            key = f"{context}/{batch}"
            plain, packed = statistics.median(data["plain_steps"][key]), statistics.median(data["steps"][key])
            lines.append(f"| {context} | {batch} | {plain * 1e3:.1f} | {packed * 1e3:.1f} | {plain / packed:.2f} |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two sizes, one repeat: a harness check")
    parser.add_argument("--out", help="default benchmarks/results/batch.md (.cache/bench/batch/batch.md with --quick)")
    args = parser.parse_args(argv)
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_batch", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    plan = (Plan((1, 8), (128,), 8, 1, 600, 256) if args.quick
            else Plan((1, 2, 4, 8), (128, 1024), 24, 5, 600, 256))
    out = Path(args.out or (".cache/bench/batch/batch.md" if args.quick else "benchmarks/results/batch.md"))
    started, load0 = time.time(), load_average()[0]
    data = measure(plan, demo_model(".cache/demo", "small"))
    text = report(plan, data, command, time.time() - started, (load0, load_average()[0]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
