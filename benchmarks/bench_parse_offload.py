"""Does parsing a large Messages body off the event loop keep the loop free for other requests?

    .venv/bin/python -m benchmarks.bench_parse_offload     # writes benchmarks/results/parse_offload.md

One asyncio loop, as in an ingress replica. A ticker coroutine wakes every 1 ms and
records how late it woke (the loop's lag: what every other request's admission waits
behind). Meanwhile one large body — `--messages` messages of the synthetic model's chat —
is parsed, validated and rendered through the chat template and tokenizer (`app.py`'s
`parse_and_prepare`), once inline on the loop and once on a thread (`offload.py`), side
by side, `--repeats` times each, alternating. Reported: the parse's wall time and the
ticker's worst and p99 lag during it, per mode, and their ratio. No Ray, no HTTP: this
isolates the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import cores, load_average, python_version
from serve_app import api
from serve_app.offload import BoundedExecutor


def body_of(num_messages: int, model: str) -> bytes:
    roles = ("user", "assistant")
    msgs = [{"role": roles[i % 2], "content": f"message {i}: the quick brown fox jumps over the lazy dog"}
            for i in range(num_messages - 1 + num_messages % 2)]
    return json.dumps({"model": model, "max_tokens": 16, "messages": msgs}).encode()


async def _one(mode: str, work, executor: BoundedExecutor) -> tuple[float, list[float]]:
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)  # the ticker is running
    lags.clear()
    t0 = time.perf_counter()
    if mode == "inline":
        work()
    else:
        await executor.run(work)
    took = time.perf_counter() - t0
    await asyncio.sleep(0.002)  # the lag of the tick that spans the end
    done.set()
    await tick
    return took, lags


async def measure(num_messages: int, repeats: int) -> dict:
    from actors.shard_header import open_zqs
    from weights_tool.demo import demo_model

    reader, _, tokenizer = open_zqs(demo_model(".cache/demo", "tiny"))
    reader.close()
    body = body_of(num_messages, "m")

    def work():
        req = api.parse_messages_request(body)
        return tokenizer.encode_chat(req.turns())

    executor = BoundedExecutor("parsing", max_threads=2, max_pending=8, timeout_s=120)
    rows = {"inline": [], "thread": []}
    for _ in range(repeats):
        for mode in ("inline", "thread"):
            took, lags = await _one(mode, work, executor)
            rows[mode].append({"took_s": took, "max_lag_ms": max(lags) * 1e3 if lags else took * 1e3,
                               "p99_lag_ms": (sorted(lags)[int(0.99 * (len(lags) - 1))] * 1e3) if lags else None,
                               "ticks": len(lags)})
    executor.close()
    return {"body_bytes": len(body), "rows": rows}


def report(result: dict, args: argparse.Namespace, command: str) -> str:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in result["rows"][mode])

    lines = [
        "# Parsing a large body off the event loop", "",
        f"Command: `{command}`", "",
        f"Machine: {cores()} cores, load average {load_average()[0]:.2f} at the end, Python "
        f"{python_version()}. Body: {args.messages} messages, {result['body_bytes'] / 2**20:.1f} MiB, the "
        f"synthetic `tiny` model's tokenizer and chat template; {args.repeats} runs per mode, alternating.", "",
        "| mode | parse + template + tokenize (s, median) | loop's worst lag (ms, median) | loop's p99 lag (ms, median) | ticks during it (median) |",
        "|---|---|---|---|---|",
    ]
    for mode in ("inline", "thread"):
        lines.append(f"| {mode} | {med(mode, 'took_s'):.3f} | {med(mode, 'max_lag_ms'):.1f} | "
                     f"{med(mode, 'p99_lag_ms') or 0:.1f} | {med(mode, 'ticks'):.0f} |")
    lines += ["", f"Worst lag, thread / inline: {med('thread', 'max_lag_ms') / med('inline', 'max_lag_ms'):.2f}×; "
              f"parse time, thread / inline: {med('thread', 'took_s') / med('inline', 'took_s'):.2f}×.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/parse_offload.md")
    args = p.parse_args(argv)
    command = "python -m benchmarks.bench_parse_offload " + shlex.join(argv if argv is not None else sys.argv[1:])
    result = asyncio.run(measure(args.messages, args.repeats))
    text = report(result, args, command.strip())
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
