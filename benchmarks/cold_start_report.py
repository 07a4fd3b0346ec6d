"""The cold-start benchmark's report: statistics over the runs, one row per mode, and the markdown.

Every figure comes from one run of `benchmarks.bench_cold_start`, whose raw results are kept
as JSON, so `--report-only` rewrites this report without measuring again. The run's records
(`benchmarks.cold_start_runs`) and the rows (`benchmarks.cold_start_rows`) live in modules of
their own, which the measurement, this report and the goals import alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from benchmarks.cold_start_goals import goals
from benchmarks.cold_start_rows import HotRow, Row, summarize
from benchmarks.cold_start_runs import (
    BASELINE,
    DERIVED,
    FIRST_ONE,
    MODES,
    PAGE_CACHE,
    Calibration,
    InProcess,
    Run,
)
from benchmarks.common import was_busy

BALANCED_WITHIN = 1.5  # load and prefill within this factor of each other: "balanced"
# Clock check: a load-then-compute run computing this long before its last group was resident.
MAX_CLOCK_SKEW_S = 0.002


# ---- arithmetic ---------------------------------------------------------------------


def overlap_efficiency(cold_ttft_s: float, load_s: float, prefill_s: float) -> float:
    """Cold TTFT over its lower bound: neither loading nor prefill can finish sooner on their own."""
    bound = max(load_s, prefill_s)
    if bound <= 0:
        raise ValueError(f"load ({load_s}) or prefill ({prefill_s}) must take some time")
    return cold_ttft_s / bound


def regime(load_s: float, prefill_s: float, within: float = BALANCED_WITHIN) -> str:
    if load_s > within * prefill_s:
        return "load-bound"
    if prefill_s > within * load_s:
        return "compute-bound"
    return "balanced"


def clock_gap(runs: Iterable[Run]) -> float | None:
    """Median of (layer-0 compute start - all groups resident) over load-then-compute runs.

    Load-then-compute waits for every group, so this is never negative when the actor's
    resident times and its compute times share one clock; what lies between is the KV
    cache's allocation and the `Started` event.
    """
    gaps = [r.cold.first_layer_compute_start - r.cold.all_layers_resident for r in runs if r.mode == BASELINE]
    return statistics.median(gaps) if gaps else None


def metrics(run: Run) -> dict[str, float]:
    """Seconds per phase of one run."""
    c, h = run.cold, run.hot
    return {
        "process_start": c.actor_start - run.spawn,
        "init": run.loading_at - c.actor_start,
        "first_layer": c.first_layer_resident - c.actor_start,
        "load": c.all_layers_resident - c.actor_start,
        "compute_start": c.first_layer_compute_start - c.actor_start,
        "ttft": c.first_token - c.actor_start,
        "cold_prefill": c.first_token - c.first_layer_compute_start,
        "client_ttft": run.client_first_chunk - run.spawn,
        "hot_prefill": h.first_token - h.compute_start,
        "hot_before_compute": h.compute_start - h.request_arrival,
        "hot_actor": h.first_token - h.request_arrival,
        "hot_client": run.hot_client_first_chunk - run.hot_call,
        # Runs recorded before Timings had it have no table time.
        **({} if c.embeddings_resident is None else {"table": c.embeddings_resident - c.actor_start}),
    }


def rows(runs: list[Run]) -> list[Row]:
    """One row per (model, prompt, storage, mode), with the group's references beside it."""
    measured = [(r, metrics(r)) for r in runs]
    out = []
    groups = dict.fromkeys((r.model, r.prompt, r.storage) for r in runs)
    for model, prompt, storage in groups:
        group = [(r, m) for r, m in measured if (r.model, r.prompt, r.storage) == (model, prompt, storage)]
        baseline = [m for r, m in group if r.mode == BASELINE]
        load_ref = statistics.median(m["load"] for m in baseline)
        prefill_ref = statistics.median(m["hot_prefill"] for _, m in group)
        base_ttft = statistics.median(m["ttft"] for m in baseline)
        for mode in MODES:
            ms = [m for r, m in group if r.mode == mode]
            if not ms:
                continue
            stats = {k: summarize(m[k] for m in ms) for k in ms[0]}
            out.append(Row(model, prompt, group[0][0].prompt_tokens, storage, mode, regime(load_ref, prefill_ref),
                           tuple(sorted({r.first_layers for r, _ in group if r.mode == mode})), stats, load_ref,
                           prefill_ref, overlap_efficiency(stats["ttft"].median, load_ref, prefill_ref),
                           stats["ttft"].median / base_ttft))
    return out


# ---- the report -------------------------------------------------------------------


def _table_order(meta: dict[str, Any]) -> str:
    if meta.get("raw_embeddings"):
        return ("The files store the embedding table raw (the packer's default): each request reads its prompt's "
                "rows before layer 0 and the stream loads the decoder layers first, the table after them (table "
                "resident), then the final norm and lm_head; the first token waits for the whole table.")
    return "The embedding table is compressed: it is the first group, and layer 0 resident comes after it."


def _heap_line(meta: dict[str, Any]) -> str:
    if not meta.get("is_freed_memory_retained"):
        return "- heap: glibc's defaults (freed activation memory goes back to the kernel)"
    return ("- heap: actors and the driver's in-process runs keep freed activation memory for the next layer, on "
            "transparent huge pages (`actors/heap.py`); an idle actor gives it back after "
            "`ActorConfig.idle_trim_after_s`, longer than the gap between a run's hot requests")


def _busy_warning(meta: dict[str, Any]) -> str:
    # At the end the run's own actors count (up to 2); before it, the load is everyone else's.
    before = float(meta["load_before"].split(" / ")[0])
    if not was_busy(before):
        return ""
    return (f". **Other jobs were using this machine** (1-minute load {before:.2f} before the run, on "
            f"{meta['cores']} cores): every figure is noisier, and the streamed modes, which need both cores at once, "
            "suffer most")


def report(data: dict[str, Any]) -> str:
    meta = data["meta"]
    cals = [Calibration(**c) for c in data["calibrations"]]
    runs = [Run.from_dict(r) for r in data["runs"]]
    table = rows(runs)
    lines = [
        "# Cold start: layer-streamed loading against load-then-compute",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Run {meta['started']}, {meta['elapsed_s'] / 60:.1f} minutes in all.",
        "",
        "## Machine and setup",
        "",
        f"- {meta['cores']} cores ({meta['cpu']}), {meta['mem_gib']:.1f} GiB RAM; Python {meta['python']}, "
        f"torch {meta['torch']}, Ray {meta['ray']}",
        f"- load average (1/5/15 min): {meta['load_before']} at the start, {meta['load_after']} at the end"
        + _busy_warning(meta),
        f"- threads: each actor (and the driver's in-process runs) streams with {meta['load_threads']} loader "
        f"thread(s) and computes with {meta['compute_threads']} torch thread(s): loading and prefill each get "
        f"their share of the {meta['cores']} cores, as they would on a CPU slot; actors run at nice "
        f"{meta['cpu_nice']}",
        f"- Ray: one local cluster (`ray.init(num_cpus=4)`), one fresh detached `RequestActor` per run "
        f"(num_cpus=1), sent its request right after the spawn call, as the ingress does; {meta['repeats']} "
        f"runs per mode and prompt, the modes' order rotated each repeat, after one calibration actor per model",
        "- requests: a chat prompt of repeated English text, greedy, max_tokens=1; then the same request again on "
        f"the now hot actor (keep_hot), {meta.get('hot_repeats', 1)} time(s); and as often, per prompt and repeat, "
        "in the driver on its own `Engine` (same threads, after a warm-up)",
        _heap_line(meta),
        "- storage: after the first read the `.zqs` file sits in the page cache, so 'page cache' rows measure "
        "decompression, not the disk; 'evicted' rows drop the file from the page cache (posix_fadvise "
        "DONTNEED) before the spawn (the Python and torch files stay cached)",
        "",
        "| model | dtype | params | layers | weights | `.zqs` file |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for c in cals:
        lines.append(f"| {c.model} | {c.dtype} | {c.num_params / 1e6:.1f} M | {c.num_layers} | "
                     f"{c.weight_bytes / 1e6:.0f} MB | {c.file_bytes / 1e6:.0f} MB |")
    lines += [
        "",
        "## Calibration (before the measured actors, same threads)",
        "",
        "Load: in the driver before Ray starts, `stream_zqs` called → every group resident (init: header, "
        "tokenizer, allocation). Prefill: on one hot calibration actor (load-then-compute, also the run's "
        "warm-up), compute start → first token, so that prompts are sized by the actors' own speed. The "
        "balanced prompt is the length whose prefill takes as long as the load. N: `choose_first_layers` "
        "with these rates, which are also the measured actors' `initial_load_bytes_per_s` and "
        "`prefill_flops_per_s`.",
        "",
        "| model | load s | of which init s | stream GB/s | prefill GFLOP/s | prompt | tokens | prefill s | regime | N |",
        "|---|--:|--:|--:|--:|---|--:|--:|---|--:|",
    ]
    for c in cals:
        for k, tokens in c.prompts.items():
            lines.append(f"| {c.model} {c.dtype} | {c.load_s:.3f} | {c.init_s:.3f} | {c.load_bytes_per_s / 1e9:.2f} | "
                         f"{c.prefill_flops_per_s / 1e9:.1f} | {k} | {tokens} | {c.prefill_s[k]:.3f} | "
                         f"{regime(c.load_s, c.prefill_s[k])} | {c.expected_n[k]} |")
    lines += [
        "",
        "## Cold TTFT, broken down",
        "",
        "Seconds from the actor's process start (`actor_start`: its `__init__` began, after Ray started the "
        "worker and it imported torch), median (min–max) over the runs; spawn → start is the Ray process "
        "start itself, reported apart. " + _table_order(meta),
        "",
        "| model | prompt | storage | mode | N | spawn → start | init | layer 0 resident | table resident | "
        "all resident | layer-0 compute | first token |",
        "|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in table:
        s = r.stats
        lines.append(f"| {r.model} | {r.prompt} | {r.storage} | {r.mode} | {'/'.join(map(str, r.first_layers))} | "
                     f"{s['process_start']} | {s['init']} | {s['first_layer']} | {s.get('table', '—')} | "
                     f"{s['load']} | {s['compute_start']} | {s['ttft']} |")
    lines += [
        "",
        "## Overlap",
        "",
        "Cold TTFT = first token − process start. Load = all resident − process start, the median of the "
        "load-then-compute runs (nothing computes while they load); prefill = the hot request's compute start "
        "→ first token, median over the group. Overlap efficiency = cold TTFT ÷ max(load, prefill); 1.0 is "
        "perfect overlap. The last column is what the client saw: spawn call → first token received.",
        "",
        "| model | prompt (tokens) | regime | storage | mode | cold TTFT | load | prefill (hot) | overlap "
        "efficiency | ÷ load-then-compute | spawn → first token at client |",
        "|---|---|---|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in table:
        lines.append(f"| {r.model} | {r.prompt} ({r.prompt_tokens}) | {r.regime} | {r.storage} | {r.mode} | "
                     f"{r.stats['ttft'].median:.3f} | {r.load_ref:.3f} | {r.prefill_ref:.3f} | "
                     f"**{r.efficiency:.2f}** | **{r.vs_baseline:.2f}** | {r.stats['client_ttft']} |")
    lines += [
        "",
        "## Hot TTFT",
        "",
        "The same request on the hot actor (its weights resident): the actor's request arrival → first token, "
        "and the client's call → first token received; where an actor served it more than once, its median "
        "request stands for it. In-process: the driver's `Engine.generate()` call → first token, after a "
        "warm-up, as many times per prompt and repeat (after that repeat's actors). The ratio is of the medians.",
        "",
        "| model | prompt (tokens) | actor: arrival → first token | of which arrival → compute start | "
        "client: call → first token | in-process: call → first token | actor ÷ in-process |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    hot = hot_rows(runs, [InProcess(**p) for p in data["in_process"]])
    for h in hot:
        lines.append(f"| {h.model} | {h.prompt} ({h.prompt_tokens}) | {h.actor} | {h.actor_before_compute} | "
                     f"{h.client} | {h.in_process} | **{h.ratio:.3f}** |")
    lines += ["", *goals(table, hot), "", *_accelerator(cals), "", "## Notes", ""]
    gap = clock_gap(r for r in runs if r.storage == PAGE_CACHE)
    if gap is not None:
        check = ("the actor's resident and compute times share one clock" if gap >= -MAX_CLOCK_SKEW_S else
                 "**negative: the actor's resident times are not on its compute clock, so the breakdown's resident "
                 "columns are off by about that much**")
        lines.append(f"- Clock check: in the load-then-compute runs layer 0's compute started a median "
                     f"{gap * 1e3:.1f} ms after every group was resident (the KV cache's allocation and the "
                     f"`Started` event lie between): {check}.")
    same = [(d, o) for d in table for o in table if d.mode == DERIVED and o.mode == FIRST_ONE
            and (d.model, d.prompt, d.storage) == (o.model, o.prompt, o.storage) and d.first_layers == (1,)]
    if same:
        lines.append("- Where the derived N came out 1, 'streamed, derived N' and 'streamed, N=1' ran the same "
                     "configuration, so the gap between their cold TTFTs is run-to-run noise: " + "; ".join(
                         f"{d.model} {d.prompt} {d.stats['ttft'].median:.3f} vs {o.stats['ttft'].median:.3f} s"
                         for d, o in same) + ".")
    lines += [
        "- The derived N is chosen by the actor per request from its stream's throughput so far and the "
        "calibrated prefill rate; the table lists every N the runs used.",
        "- Raw per-run timings: `benchmarks/results/cold_start.json` (the run also keeps a copy under "
        "`.cache/bench/cold_start/`); `--report-only benchmarks/results/cold_start.json` rewrites this report "
        "from it.",
        "",
    ]
    return "\n".join(lines)


def hot_rows(runs: list[Run], in_process: list[InProcess]) -> list[HotRow]:
    out = []
    for model, prompt in dict.fromkeys((r.model, r.prompt) for r in runs if r.storage == PAGE_CACHE):
        ms = [metrics(r) for r in runs if (r.model, r.prompt, r.storage) == (model, prompt, PAGE_CACHE)]
        ref = [p for p in in_process if (p.model, p.prompt) == (model, prompt)]
        tokens = next(r.prompt_tokens for r in runs if (r.model, r.prompt) == (model, prompt))
        out.append(HotRow(model, prompt, tokens, *(summarize(m[k] for m in ms) for k in (
            "hot_actor", "hot_before_compute", "hot_prefill", "hot_client")),
            summarize(p.ttft for p in ref), summarize(p.prefill for p in ref)))
    return out


def _accelerator(cals: list[Calibration]) -> list[str]:
    lines = [
        "## On an accelerator",
        "",
        "Here loading (zstd decompression into the parameters) and prefill each hold one of the two cores, and "
        "they still meet on the memory bus; a streamed prefill runs slower than a hot one by that contention "
        "and by waits on layers still arriving. On a GPU node:",
        "",
        "- prefill runs on the GPU and no longer competes with decompression: every CPU core can decompress "
        "(the reader's rate scales with threads until storage or PCIe binds), and `CudaLayerStream` copies "
        "each group from pinned staging buffers to HBM on a side stream at ~20+ GB/s, hidden behind the "
        "decompression of the next group;",
        "- prefill becomes far shorter than the load for these shapes (estimates, not measured here):",
    ]
    for c in cals:
        tokens = max(c.prompts.values())
        flops = c.prefill_flops_per_s * c.prefill_s[max(c.prompts, key=c.prompts.get)]
        lines.append(f"  - {c.model} {c.dtype}: {tokens}-token prefill ≈ {flops / 1e12:.2f} TFLOP → ~"
                     f"{flops / 100e12 * 1e3:.1f} ms at 100 TFLOP/s sustained; the load ≈ "
                     f"{c.weight_bytes / (c.load_bytes_per_s * 8) * 1e3:.0f} ms with 8 decompression threads at this "
                     f"machine's per-thread rate, plus ≥ {c.weight_bytes / 20e9 * 1e3:.0f} ms of host → HBM copy "
                     "(overlapped)")
    lines += [
        "- so every row of this table becomes load-bound: cold TTFT → load + one layer's compute after the last "
        "layer lands (well under a millisecond on the GPU), overlap efficiency → 1.0; but the ratio to "
        "load-then-compute, load ÷ (load + prefill), goes to 1 too: there is hardly any prefill left to hide;",
        "- execute-while-load pays on a GPU where the two are comparable again: large models with long prompts "
        "loaded from host memory or fast NVMe (λScale, ServerlessLLM's multi-tier loading). For example, an 8B "
        "model in bf16 (16 GB) copied from host memory at ~20 GB/s takes ~0.8 s, and an 8k-token prefill "
        "(2 × 8e9 × 8192 ≈ 130 TFLOP) ~1.3 s at the same 100 TFLOP/s: balanced, where streaming can save up "
        "to half of the cold TTFT. The decompression side then needs enough cores to keep up with the copy "
        "(here one core decodes at the rate above).",
    ]
    return lines
