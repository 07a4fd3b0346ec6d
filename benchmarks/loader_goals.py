"""The loader benchmark's goals, judged from one run's figures, and the seed's three methods side by side.

Each goal line gives the verdict on the medians, the best runs' figure beside it, and
what bounds the figure (from the same run's CPU times, rows and machine limits), so a
missed goal says by how much and why.
"""

from __future__ import annotations

from benchmarks.loader_cells import Cell, Cells, ShapeInfo
from benchmarks.loader_methods import NUM_THREADS, RATES, REGIMES

MB = 1e6
GOAL_RATIO = 1.4
GOAL_THROTTLED = 0.8
GOAL_WARM_SPEEDUP = 1.3
GOAL_FIRST_LAYER_S = 0.060
GOAL_EXTRA_LAYERS = 2
ZQS = ("zqs-bytegroup", "zqs-zstd", "zqs-raw", "zqs-raw-nocrc")
READER_1CORE = "{} reader, 1 core (layer 0 into prefaulted, verified)"


def seed_comparison(info: ShapeInfo, cells: Cells) -> list[str]:
    """The seed document's three methods side by side, every regime, with the memory each needed."""
    seed = (("tar.xz", "own"), ("zst-whole", "own"), ("zqs-bytegroup", "fresh"))
    regimes = [r for r in REGIMES if all((info.name, r, m, d) in cells for m, d in seed)]
    if not regimes:
        return []
    lines = [
        f"## The seed's three methods ({info.name})", "",
        "Median seconds into fresh private memory, and the most memory each needed beyond its result.", "",
        "| method | " + " | ".join(regimes) + " | extra RSS (MB) |",
        "|---|" + "--:|" * (len(regimes) + 1),
    ]
    for m, d in seed:
        row = [cells[(info.name, r, m, d)] for r in regimes]
        lines.append(f"| {m} | " + " | ".join(f"{c.seconds:.2f}" for c in row)
                     + f" | {max(c.extra for c in row) / MB:,.0f} |")
    ours = [cells[(info.name, r, "zqs-bytegroup", "fresh")].seconds for r in regimes]
    for m, _ in seed[:2]:
        ratios = [cells[(info.name, r, m, "own")].seconds / t for r, t in zip(regimes, ours, strict=True)]
        lines.append(f"| zqs-bytegroup's speedup over {m} | " + " | ".join(f"{x:.1f}×" for x in ratios) + " | |")
    return lines + [""]


# ---- goals ------------------------------------------------------------------------------


def goals(infos: dict[str, ShapeInfo], cells: Cells, limits: dict[str, float]) -> list[str]:
    big = infos.get("tinyllama-1.1b") or next(iter(infos.values()))

    def get(regime: str, method: str, dest: str) -> Cell | None:
        return cells.get((big.name, regime, method, dest))

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    lines = ["## Goals", "", f"Judged on the {big.name} shape unless a line says otherwise, on the medians; "
             "each line also gives the best runs' figure (fastest of each cell), which other jobs on the machine "
             "disturbed least.", ""]

    def also(ok_median: bool, ok_best: bool, figure: str) -> str:
        differs = "" if ok_median == ok_best else f" — {'met' if ok_best else 'missed'} on the best runs"
        return f" Best runs: {figure}{differs}."

    # 1. compression ratio
    parts = []
    for i in infos.values():
        r = i.ratio("zqs-bytegroup")
        margin = f"{r - GOAL_RATIO:+.3f}"
        parts.append(f"{i.name} {r:.3f} ({margin}; plain zstd {i.ratio('zqs-zstd'):.3f}, whole-file zstd "
                     f"{i.ratio('zst'):.3f}, xz {i.ratio('tar.xz'):.3f})")
    ok = all(i.ratio("zqs-bytegroup") >= GOAL_RATIO for i in infos.values())
    lines.append(f"1. **Byte-grouped bf16 ratio ≥ {GOAL_RATIO}**: {verdict(ok)}: " + "; ".join(parts) + ". On "
                 "random normal weights the exponent bytes hold a few bits and the mantissa bytes are noise; "
                 "ZipNN reports 1.51 on real BF16 models.")

    # 2. throttled storage
    for regime, rate in RATES.items():
        ours, theirs = get(regime, "zqs-bytegroup", "fresh"), get(regime, "st-pread-emul", "own")
        if ours is None or theirs is None:
            continue
        r, budget = ours.seconds / theirs.seconds, GOAL_THROTTLED * theirs.seconds
        link, floor = big.files["zqs-bytegroup"] / rate, ours.cpu_s / NUM_THREADS
        bound = max(link, floor)
        text = (f"2. **{regime}: byte-grouped .zqs ≤ {GOAL_THROTTLED} × uncompressed safetensors**: "
                f"{verdict(r <= GOAL_THROTTLED)}: {ours.seconds:.2f} s against {theirs.seconds:.2f} s = {r:.2f}× "
                f"(budget {budget:.2f} s).")
        rb = ours.best / theirs.best
        text += also(r <= GOAL_THROTTLED, rb <= GOAL_THROTTLED, f"{ours.best:.2f} s against {theirs.best:.2f} s = "
                     f"{rb:.2f}×")
        text += (f" Bounds: the file crosses the link in {link:.2f} s; decoding costs {ours.cpu_s:.2f} CPU-seconds "
                 f"(the load's own CPU time), at least {floor:.2f} s on {NUM_THREADS} cores; so {bound:.2f} s at "
                 f"best, {'over' if bound > budget else 'within'} the budget.")
        if floor > budget:
            text += (f" At this decoding cost the goal cannot be met on two cores: it needs decoding at "
                     f"{big.model_bytes / (budget * NUM_THREADS) / 1e9:.2f} GB/s per core, and it ran at "
                     f"{big.model_bytes / ours.cpu_s / 1e9:.2f} GB/s per CPU-second here.")
        if ours.seconds > 1.15 * bound:
            text += (f" Beyond the bound ({ours.seconds - bound:.2f} s): each decoding thread keeps one 4 MiB read in "
                     "flight, so the link idles whenever both threads wait on decoding at once, the first read of "
                     "every frame is not hidden, and a load that needs both cores loses whatever share other jobs "
                     "on the machine take.")
        lines.append(text)

    # 3. warm cache into private memory
    base = get("warm", "st-pread", "own")
    options = {(m, d): c for m in ZQS for d in ("fresh", "prefaulted") if (c := get("warm", m, d)) is not None}
    if base is not None and options:
        speed = {k: base.seconds / c.seconds for k, c in options.items()}
        best_speed = {k: base.best / c.best for k, c in options.items()}
        best = max(speed, key=speed.get)
        listing = "; ".join(f"{m} into {d}: {s:.2f}×" for (m, d), s in speed.items())
        lines.append(
            f"3. **Warm cache into private memory ≥ {GOAL_WARM_SPEEDUP}× faster than safetensors' pread backend** "
            f"(st-pread: {base.seconds:.3f} s): {verdict(speed[best] >= GOAL_WARM_SPEEDUP)}: the fastest .zqs "
            f"configuration, {best[0]} into {best[1]} tensors, reached {speed[best]:.2f}×; the default byte-grouped "
            "file: "
            f"{speed.get(('zqs-bytegroup', 'fresh'), float('nan')):.2f}× into fresh and "
            f"{speed.get(('zqs-bytegroup', 'prefaulted'), float('nan')):.2f}× into prefaulted tensors"
            f"{_against_goal(speed.get(('zqs-bytegroup', 'fresh'), 0.0))}. All: {listing}."
            + also(speed[best] >= GOAL_WARM_SPEEDUP, max(best_speed.values()) >= GOAL_WARM_SPEEDUP,
                   f"st-pread {base.best:.3f} s; " + "; ".join(f"{m} into {d}: {v:.2f}×"
                                                            for (m, d), v in best_speed.items()))
            + " " + _warm_why(big, base, get("warm", "st-pread-emul", "own"), options, limits))

    # 4. time to first layer
    firsts = {(m, d): c.first_layer_s for m in ZQS for d in ("fresh", "prefaulted")
              if (c := get("warm", m, d)) is not None and c.first_layer_s is not None}
    best_firsts = {(m, d): c.best_first_layer_s for m in ZQS for d in ("fresh", "prefaulted")
                   if (c := get("warm", m, d)) is not None and c.best_first_layer_s is not None}
    if firsts:
        best = min(firsts, key=firsts.get)
        default = firsts.get(("zqs-bytegroup", "fresh"), float("nan"))
        one_core = limits.get(READER_1CORE.format("zqs-bytegroup"), float("nan"))
        miss = "" if firsts[best] <= GOAL_FIRST_LAYER_S else f", {firsts[best] * 1e3 - GOAL_FIRST_LAYER_S * 1e3:.0f} ms over"
        lines.append(
            f"4. **Time to layer 0 ≤ {GOAL_FIRST_LAYER_S * 1e3:.0f} ms** ({big.name}, warm): "
            f"{verdict(firsts[best] <= GOAL_FIRST_LAYER_S)}: the fastest configuration, {best[0]} into {best[1]} "
            f"tensors, {firsts[best] * 1e3:.0f} ms{miss}; the default byte-grouped file into fresh tensors {default * 1e3:.0f} ms."
            + also(firsts[best] <= GOAL_FIRST_LAYER_S, min(best_firsts.values()) <= GOAL_FIRST_LAYER_S,
                   f"{min(best_firsts.values()) * 1e3:.0f} ms ({min(best_firsts, key=best_firsts.get)[0]})")
            + " "
            f"Layer 0 cannot run before the embeddings are in, so it waits for {big.embed_bytes / MB:.0f} MB of "
            f"embeddings plus its own {big.layer_bytes / MB:.0f} MB, on two threads at once. One core decodes "
            f"byte-grouped frames at {one_core:.2f} GB/s here, so the embedding table alone takes "
            f"{big.embed_bytes / one_core / 1e6:.0f} ms on its thread; {GOAL_FIRST_LAYER_S * 1e3:.0f} ms would "
            f"need {big.embed_bytes / GOAL_FIRST_LAYER_S / 1e9:.1f} GB/s on one core. Prefill needs only the "
            "prompt's rows of that table: splitting the embeddings into row blocks, or reading the prompt's rows "
            "first, is where the rest of this goal lies (a format/loader change, not measured here).")

    # 5. extra resident memory
    extras = {(r, m, d): c.extra for (s, r, m, d), c in cells.items() if s == big.name and m in ZQS}
    if extras:
        worst = max(extras, key=extras.get)
        allowed = GOAL_EXTRA_LAYERS * big.layer_bytes
        archive = max((c.extra for (s, _, m, _), c in cells.items() if s == big.name and m == "zst-whole"), default=0)
        lines.append(
            f"5. **Extra resident memory during a streaming load ≤ {GOAL_EXTRA_LAYERS} layers** "
            f"({allowed / MB:.0f} MB): {verdict(extras[worst] <= allowed)}: the most any .zqs load held beyond its "
            f"destinations was {extras[worst] / MB:.0f} MB ({worst[1]} into {worst[2]} tensors, {worst[0]}), "
            f"against {archive / MB:,.0f} MB for the whole-file zstd baseline. Each reader thread holds two 4 MiB "
            "reads (one decoding, one in flight), a 1 MiB block and zstd's window, never a whole group.")
    return lines + [""]


def _against_goal(speedup: float) -> str:
    """How the default file into fresh tensors stands against the warm goal, in words."""
    if speedup >= GOAL_WARM_SPEEDUP:
        return f", so the default file meets {GOAL_WARM_SPEEDUP}× even into fresh tensors"
    return f"; into fresh tensors it is short of {GOAL_WARM_SPEEDUP}× by {1 - speedup / GOAL_WARM_SPEEDUP:.0%}"


def _warm_why(big: ShapeInfo, base: Cell, emul: Cell | None, options: dict[tuple[str, str], Cell],
              limits: dict[str, float]) -> str:
    def limit(prefix: str) -> float:
        return next((v for k, v in limits.items() if k.startswith(prefix)), float("nan"))

    text = (f"Why: st-pread is one kernel copy from the page cache into fresh memory ({big.model_bytes / base.seconds / 1e9:.2f} "
            f"GB/s here; memcpy ran at {limit('memcpy into fresh'):.2f} GB/s into fresh and "
            f"{limit('memcpy into prefaulted'):.2f} GB/s into prefaulted memory). The compressed files are bound by "
            f"decoding: one core decodes byte-grouped frames at {limit(READER_1CORE.format('zqs-bytegroup')):.2f} "
            f"GB/s and plain zstd at {limit(READER_1CORE.format('zqs-zstd')):.2f} GB/s, and the goal needs "
            f"{GOAL_WARM_SPEEDUP * big.model_bytes / base.seconds / 1e9:.2f} GB/s from two cores. ")
    grouped = options.get(("zqs-bytegroup", "prefaulted"))
    if grouped is not None:
        floor = grouped.cpu_s / NUM_THREADS
        text += (f"The byte-grouped load into prefaulted tensors costs {grouped.cpu_s:.2f} CPU-seconds, so with both "
                 f"cores to itself it would take at least {floor:.2f} s, {base.seconds / floor:.2f}× st-pread's median "
                 f"(an upper bound, not a measurement); its wall time was {grouped.seconds:.2f} s")
        text += (", close to its CPU time: its second thread seldom had a core to itself. "
                 if grouped.seconds > 0.8 * grouped.cpu_s else ": both threads decoded at once. ")
    if emul is not None:
        text += (f"safetensors' pread backend itself costs more than the copy needs: {base.cpu_s:.2f} CPU-seconds "
                 f"against {emul.cpu_s:.2f} for plain preads of the same bytes into fresh tensors (st-pread-emul, "
                 f"{base.seconds / emul.seconds:.2f}× st-pread). ")
    fresh, pre = options.get(("zqs-raw-nocrc", "fresh")), options.get(("zqs-raw-nocrc", "prefaulted"))
    if fresh and pre:
        text += (f"Uncompressed, the copy itself is cheap and first-touch page faults decide: the same raw read "
                 f"took {fresh.seconds:.3f} s into fresh and {pre.seconds:.3f} s into prefaulted tensors, and the "
                 f"crc32 ({limit('zlib.crc32'):.2f} GB/s on one core) costs what separates zqs-raw from it. ")
    return text + ("The issue's prototype (2.2 GB in 0.93 s) implies 2.4 GB/s of decoding; the decoder measured "
                   "here does not get there on these two cores.")
