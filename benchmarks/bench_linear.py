"""Where a decode step's time goes on this CPU, and what a compiled linear layer would give back (issue 25).

    .venv/bin/python -m benchmarks.bench_linear     # ~5 min; writes benchmarks/results/linear.md + .json

`make serve`'s model (SmolLM2-135M-Instruct, bf16, `.cache/models/`; `make serve` or
`zq-weights fetch` packs it) on one torch thread, as an actor computes:

1. The engine's decode step at batch 1 and 8 (128-token contexts), as `bench_batch` times it,
   with the weights plain (as loaded) and packed (actors/packed_weights.py, the actors' default).
2. Only its weight reads: every linear layer of the step (7 a layer, then the LM head) in the
   model's order on the real weights, [rows, in] inputs, no attention, norm or Python between
   them. 270 MB of bf16 weights against a 105 MB L3: every pass streams them from memory,
   as a step does.
3. The same reads five ways: the runtime's `linear` (eager, gemv or oneDNN by its own timing),
   the weights in fp32, eager on weights packed into oneDNN's layout (the actors'), and the whole chain through `torch.compile` with frozen weights —
   inductor's default (oneDNN's packed linear) and `max-autotune`, whose C++ GEMM template has
   AMX / AVX-512 micro-kernels.

What the step does beside its weight reads is (1) less (2). Each figure is the median of
`PASSES` timed passes after two untimed ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import load_average, machine

ROOT = Path(__file__).parents[1]
ZQS = ROOT / ".cache/models/smollm2-135m-instruct.zqs"
ROWS = (1, 8)
PASSES = 15
CONTEXT = 128


def _chain(model):
    """A module that runs every linear layer of `model`'s step, in order, on a fixed input each."""
    import torch
    from torch import nn

    weights = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        weights += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
                    m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
    head = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
    weights.append(head)

    class Chain(nn.Module):
        def __init__(self, dtype, fn) -> None:
            super().__init__()
            self.fn = fn  # (x, weight) -> x @ weight.T
            self.weights = nn.ParameterList(nn.Parameter(w.detach().to(dtype), requires_grad=False) for w in weights)

        def forward(self, x_hidden: torch.Tensor, x_inter: torch.Tensor) -> list[torch.Tensor]:
            # x_hidden: [M, hidden]; x_inter: [M, intermediate] (down_proj's input)
            return [self.fn(x_inter if w.shape[1] == x_inter.shape[1] else x_hidden, w) for w in self.weights]

    return Chain, sum(w.numel() for w in weights)


def _packed(chain):
    """The chain on its weights packed as the actors pack theirs (actors/packed_weights.py)."""
    from torch import nn

    from actors.layers import Linear
    from actors.packed_weights import pack

    layers = nn.ModuleList()
    for w in chain.weights:
        layer = Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        layer.weight = nn.Parameter(w.detach().clone(), requires_grad=False)
        layers.append(layer)
    pack(layers, kernel="onednn").install()

    def run(x_hidden, x_inter):
        return [layer(x_inter if layer.in_features == x_inter.shape[1] else x_hidden) for layer in layers]

    run.weights = chain.weights  # measure() reads the dtype from here
    return run


def _time(run, passes: int = PASSES) -> float:
    for _ in range(2):
        run()
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure() -> dict:
    import torch
    import torch._inductor.config as inductor_config
    import torch.nn.functional as F

    from actors.engine import Engine
    from actors.layer_loader import load_zqs
    from actors.layers import linear
    from benchmarks.bench_batch import step_time

    torch.set_num_threads(1)
    model, tokenizer = load_zqs(ZQS, num_threads=1, compute_dtype="auto")
    out: dict = {"dtype": str(model.dtype).removeprefix("torch."), "step_s": {}, "packed_step_s": {},
                 "chain_s": {}, "compile_s": {}}
    packed_model = load_zqs(ZQS, num_threads=1, compute_dtype="auto", is_weight_packed=True)[0]
    engines = {key: Engine(m, tokenizer, max_batch=max(ROWS), prefill_chunk_tokens=1_000_000)
               for key, m in (("step_s", model), ("packed_step_s", packed_model))}
    for rows in ROWS:
        for key, engine in engines.items():
            out[key][rows] = step_time(engine, rows, CONTEXT, PASSES)
    del engines, packed_model

    chain_cls, num_params = _chain(model)
    out["weight_bytes"] = num_params * model.dtype.itemsize
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    inductor_config.freezing = True  # weights as constants: what lets the GEMM template pack them
    eager = {"eager (the runtime's linear)": chain_cls(model.dtype, linear),
             "eager, fp32 weights": chain_cls(torch.float32, linear)}
    to_compile = chain_cls(model.dtype, F.linear)  # the GEMM template replaces linear and mm, not gemv
    compiled = {"compiled, inductor default": "default", "compiled, max-autotune": "max-autotune"}
    eager["eager, packed (oneDNN's layout: the actors')"] = _packed(eager["eager (the runtime's linear)"])
    with torch.inference_mode():
        for rows in ROWS:
            x_h, x_i = torch.randn(rows, hidden, dtype=model.dtype), torch.randn(rows, inter, dtype=model.dtype)
            for name, chain in eager.items():
                args = (x_h.to(chain.weights[0].dtype), x_i.to(chain.weights[0].dtype))
                out["chain_s"].setdefault(name, {})[rows] = _time(lambda chain=chain, args=args: chain(*args))
            for name, mode in compiled.items():
                torch._dynamo.reset()
                fn = torch.compile(to_compile, mode=mode, dynamic=False)
                t0 = time.perf_counter()
                fn(x_h, x_i)
                out["compile_s"].setdefault(name, {})[rows] = time.perf_counter() - t0
                out["chain_s"].setdefault(name, {})[rows] = _time(lambda fn=fn, x_h=x_h, x_i=x_i: fn(x_h, x_i))
                # The same answers as eager, to bf16's rounding of a 576-long dot product.
                ref = eager["eager (the runtime's linear)"](x_h, x_i)
                out.setdefault("max_abs_diff", {}).setdefault(name, {})[rows] = max(
                    (a.float() - b.float()).abs().max().item() for a, b in zip(fn(x_h, x_i), ref, strict=True))
    return out


def report(data: dict, command: str, elapsed_s: float, load: tuple[float, float]) -> str:
    m = data["machine"]
    gb = data["weight_bytes"] / 1e9
    lines = [
        "# A decode step's weight reads on this CPU: eager against compiled linear layers",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {m['cores']} cores, {m['cpu']}, Python {m['python']}, torch {m['torch']}; one torch thread (an "
        f"actor's). Load average {load[0]:.2f} at the start, {load[1]:.2f} at the end; {elapsed_s / 60:.1f} min.",
        "",
        f"Model: SmolLM2-135M-Instruct as `make serve` packs it, computed in {data['dtype']}; its linear layers "
        f"(7 a layer × 30, and the tied LM head) hold {gb * 1e3:.0f} MB. Step: the engine's decode step at "
        f"{CONTEXT}-token contexts. Chain: only the step's linear layers, in order (module docstring).",
        "",
        "| what | rows | ms | GB/s of weights | ÷ eager chain | compile s |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for rows in ROWS:
        base = data["chain_s"]["eager (the runtime's linear)"][rows]
        step = data["step_s"][rows]
        lines.append(f"| the engine's whole step | {rows} | {step * 1e3:.1f} | | {step / base:.2f} | |")
        if rows in data.get("packed_step_s", {}):
            packed = data["packed_step_s"][rows]
            lines.append(f"| the engine's whole step, packed weights (the actors') | {rows} | {packed * 1e3:.1f} | | "
                         f"{packed / base:.2f} | |")
        for name, by_rows in data["chain_s"].items():
            s = by_rows[rows]
            nbytes = data["weight_bytes"] * (2 if "fp32" in name else 1)
            compile_s = data["compile_s"].get(name, {}).get(rows)
            lines.append(f"| {name} | {rows} | {s * 1e3:.1f} | {nbytes / s / 1e9:.1f} | {s / base:.2f} | "
                         f"{'' if compile_s is None else f'{compile_s:.0f}'} |")
    lines += ["", "## What it says", ""]
    for rows in ROWS:
        step, base = data["step_s"][rows], data["chain_s"]["eager (the runtime's linear)"][rows]
        best = min(data["chain_s"], key=lambda n: data["chain_s"][n][rows])
        best_s = data["chain_s"][best][rows]
        lines.append(f"- {rows} row(s): the linear layers take {base / step:.0%} of the eager step "
                     f"({base * 1e3:.1f} of {step * 1e3:.1f} ms); the rest, {(step - base) * 1e3:.1f} ms, is "
                     f"attention, norms, RoPE, sampling and Python. The fastest chain is *{best}*, "
                     f"{base / best_s:.2f}× the eager one; with the rest unchanged the step would take "
                     f"{(step - base + best_s) * 1e3:.1f} ms.")
    diffs = data.get("max_abs_diff", {})
    if diffs:
        worst = max(v for by_rows in diffs.values() for v in by_rows.values())
        lines.append(f"- Compiled outputs differ from eager by at most {worst:.3g} over every output of the chain "
                     "(bf16 outputs of fp32 accumulations; random inputs of unit scale).")
    lines.append("- Compile s: `torch.compile` of the whole chain for one row count, in this process "
                 "(max-autotune times both kernels of every layer: no disk cache was warm).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/linear.md"))
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if not ZQS.exists():
        print(f"{ZQS.relative_to(ROOT)} is missing: `make serve` or `zq-weights fetch smollm2-135m-instruct "
              f"-o {ZQS.relative_to(ROOT)}` packs it", file=sys.stderr)
        return 2
    load0, t0 = load_average()[0], time.monotonic()
    data = measure()
    data["machine"] = machine("torch")
    elapsed = time.monotonic() - t0
    command = ".venv/bin/python -m benchmarks.bench_linear" + (" " + " ".join(argv) if argv else "")
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.write_text(report(data, command, elapsed, (load0, load_average()[0])))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
