"""How request actors are placed, load, batch and stream: one frozen config per deployment, from YAML.

Plain data, no torch and no Ray: the ingress builds it from the app's args (serve_app/config.py)
and hands it to every actor it creates.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.compute_dtype import check_setting
from actors.step_cost import RECENT_STEPS, StepCost

# actor.packed_kernel's settings (actors/packed_weights.py): "auto" is the actors' own kernels where the CPU runs them.
PACKED_KERNELS = ("auto", "onednn")
KV_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class ActorConfig:
    """How request actors are placed and how they load; one per deployment, from YAML."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0  # 1 (or a fraction) on GPU clusters
    resources: tuple[tuple[str, float], ...] = ()  # e.g. (("zq_slot", 1.0),) for CPU slots
    namespace: str = "zeroqueue"
    load_threads: int = 1
    # Threads for torch's compute; on a CPU node loading and compute share the cores.
    compute_threads: int = 1
    # Fewer threads, down to this many, while other processes use the node's cores: a step waits for
    # its slowest thread, and beside one busy process two threads prefill in 1.8-2.1x one thread's time, their
    # slowest steps several times (benchmarks/results/threads.md). Equal to compute_threads: always that many.
    min_compute_threads: int = 1
    # The dtype the model computes in (actors/compute_dtype.py): "auto" keeps the file's dtype
    # except on a CPU without native 16-bit arithmetic, where a bf16 model computes several
    # times slower than in fp32 (benchmarks/results/engine.md) and is widened, at 2x its memory.
    compute_dtype: str = "auto"
    # Keys and values cached in the compute dtype ("auto"), or in 8 bits ("int8": an fp32 scale a position and KV
    # head, actors/kv_cache.py): about half the bytes, so twice the rows' positions fit and a decoding row reads half
    # as much a step (benchmarks/results/kv_int8.md), at a small error in attention (its quality figures there). Not with
    # `is_compiled`.
    kv_dtype: str = "auto"
    # Rows a hot actor runs at most (the policy's max_batch, a safety cap: the ingress sets both from one value).
    max_batch: int = 32
    # The most prompt tokens one step may add while other rows decode: a joiner's prompt is
    # chunked so that running rows wait at most one step of this size, and less where a decoding
    # row's TPOT target needs shorter steps (actors/scheduler.py).
    prefill_chunk_tokens: int = 256
    # A prompt gets at least the tokens a step that bring its first token half way to its request's TTFT target,
    # however little the decoding rows' TPOT targets leave (actors/scheduler.py, tokens_due, paced_due). Off: those
    # targets alone bound a step's prefill, and a joiner beside rows past their target is fed one token a step.
    is_prefill_paced_by_ttft: bool = True
    # The engine prices its steps by the rule times the mean of measured ÷ predicted, or by the median of this many
    # last steps' ratios where that is more (actors/step_cost.py, StepCheck): a host turned slower is priced so within
    # a few steps, by the planner and by the router, which hears it with each row's start. 0: the mean alone.
    step_check_recent_steps: int = RECENT_STEPS
    # What a step costs (actors/step_cost.py): the ingress sets it from the app's `rule_scorer`,
    # the same constants its admission predicts with.
    step_cost: StepCost = StepCost()
    first_layers: int | None = None  # None: derived per request (see cold_start)
    # A warm actor's layers resident before any request (serve_app/warm_pool.py); None: every layer where
    # the actors pack their weights (`packs_weights_on`: packing needs them all, and a warm actor
    # holding them all is packed before its request), else derived by cold_start.choose_first_layers for a
    # prompt of `warm_prompt_tokens`.
    warm_layers: int | None = None
    warm_prompt_tokens: int = 64
    # Every group resident before prefill starts: load-then-compute, the cold-start
    # benchmark's baseline (first_layers = L still streams the table and the final group).
    is_load_then_compute: bool = False
    # Prefill compute rate used to derive first_layers (and a warm actor's layers), and the load
    # rate assumed before a stream has measured its own: bench_cold_start's figures for the
    # `small` bf16 model on one thread of the 2-core CPU machine (524 GFLOP/s, 0.55 GB/s);
    # measure and set them per deployment.
    prefill_flops_per_s: float = 5.2e11
    initial_load_bytes_per_s: float = 5.5e8
    load_timeout_s: float = 300.0
    # On CPU slots the actors' compute shares cores with the proxy, ingress and registry;
    # a lower priority keeps admission and refusals fast however busy the slots are. The
    # worker's interpreter is started under it (actors/priority.py), so a starting actor's
    # imports are already below them; Ray runs other workers' main threads at nice 15, so
    # 19 puts the actors below all of Ray's own.
    cpu_nice: int = 19
    # After the first token, a row sends at most one chunk per interval (tokens sampled meanwhile
    # ride together): at least `stream_interval_s` (0: every token on its own while the rows'
    # share allows), and while n rows run, n / `max_stream_chunks_per_s` (0: no share), at most
    # `max_stream_interval_s` (actors/stream_chunks.py). Each chunk is a Ray object to the
    # ingress and an SSE event on to the proxy, whose handling competes with the batch's steps
    # on a CPU node; a longer interval delays a request's last token by up to as much.
    stream_interval_s: float = 0.02
    max_stream_chunks_per_s: float = 50.0
    max_stream_interval_s: float = 0.2
    # Keep activation memory freed inside a request for the next layer, on huge pages
    # (actors/heap.py); a hot actor gives it back once idle this long, so back-to-back
    # requests do not page-fault their working set in again.
    is_freed_memory_retained: bool = True
    # Once every weight is resident, bf16 linear weights are repacked on a CPU for a faster kernel
    # (actors/packed_weights.py, `packed_kernel` below); false keeps the plain eager kernels (the parity
    # reference).
    is_weight_packed: bool = True
    # The kernel they are packed for (PACKED_KERNELS): "auto" is the actors' own where the
    # CPU has AVX512-BF16 (actors/cpu_kernels.py: bf16_linear.py's, and decoding rows' attention in one call a
    # layer; benchmarks/results/bf16_linear.md; products equal up to rounding), or, where it has AVX2 and computes
    # a bf16 file in fp32, bf16_weight_linear.py's over the weights narrowed back to bf16 (engine_avx2.md), else
    # oneDNN's; "onednn" always oneDNN's and SDPA row by row (F.linear's products bitwise, steps up to 1.2x the
    # plain kernels').
    packed_kernel: str = "auto"
    idle_trim_after_s: float = 2.0
    # Decode steps through torch.compile (actors/compiled_step.py): up to `compiled_slots` rows of up to
    # `compiled_max_seq_len` positions (prompt + max_tokens) in static KV slabs, allocated at start, and their
    # (rows, positions) buckets compiled before a warm actor is ready; other rows, prompt chunks and a cold actor's
    # steps run eagerly. It reads the plain weights, so the actor does not pack them: on a CPU where the actors'
    # own kernels run they are the faster step (benchmarks/results/engine_avx512bf16.md), and this stays off. On a
    # GPU it is inductor with CUDA graphs.
    is_compiled: bool = False
    compiled_slots: int = 8
    compiled_max_seq_len: int = 2048

    @property
    def is_kv_int8(self) -> bool:
        return self.kv_dtype == "int8"

    def packs_weights_on(self, device_type: str) -> bool:
        """Whether an actor computing on `device_type` packs its weights once all are resident
        (actors/packed_weights.py): on a CPU, unless packing is off or the compiled step reads the plain ones."""
        return self.is_weight_packed and not self.is_compiled and device_type == "cpu"

    def __post_init__(self) -> None:
        check_setting(self.compute_dtype)
        if self.packed_kernel not in PACKED_KERNELS:
            raise ValueError(f"ActorConfig.packed_kernel must be {' or '.join(PACKED_KERNELS)}, "
                             f"got {self.packed_kernel!r}")
        if self.warm_layers is not None and self.warm_layers < 0:
            raise ValueError(f"ActorConfig.warm_layers must be >= 0, got {self.warm_layers}")
        if not 1 <= self.min_compute_threads <= max(1, self.compute_threads):
            raise ValueError(f"ActorConfig needs 1 <= min_compute_threads <= compute_threads, got "
                             f"{self.min_compute_threads} and {self.compute_threads}")
        if self.compiled_slots < 1 or self.compiled_max_seq_len < 1:
            raise ValueError(f"ActorConfig needs compiled_slots and compiled_max_seq_len >= 1, got "
                             f"{self.compiled_slots}, {self.compiled_max_seq_len}")
        if self.max_batch < 1 or self.prefill_chunk_tokens < 1 or self.warm_prompt_tokens < 1:
            raise ValueError(f"ActorConfig needs max_batch, prefill_chunk_tokens and warm_prompt_tokens >= 1, "
                             f"got {self.max_batch}, {self.prefill_chunk_tokens}, {self.warm_prompt_tokens}")
        if min(self.stream_interval_s, self.max_stream_chunks_per_s, self.max_stream_interval_s) < 0:
            raise ValueError(f"ActorConfig needs stream_interval_s, max_stream_chunks_per_s and max_stream_interval_s "
                             f">= 0, got {self.stream_interval_s}, {self.max_stream_chunks_per_s}, "
                             f"{self.max_stream_interval_s}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"ActorConfig.kv_dtype must be {' or '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.is_kv_int8 and self.is_compiled:
            raise ValueError("ActorConfig.kv_dtype int8 is not served by the compiled step: set is_compiled false")
        if self.step_check_recent_steps < 0:
            raise ValueError(f"ActorConfig.step_check_recent_steps must be >= 0, got {self.step_check_recent_steps}")

    def actor_options(self, name: str) -> dict:
        from actors.priority import runtime_env_for

        runtime_env = runtime_env_for(self.cpu_nice) if self.num_gpus == 0 else {}
        return ({"runtime_env": runtime_env} if runtime_env else {}) | {
            "name": name,
            "namespace": self.namespace,
            "lifetime": "detached",
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "resources": dict(self.resources),
            "max_restarts": 0,
            "max_task_retries": 0,
            # One `generate` per row, plus status / release / shutdown beside them.
            "max_concurrency": self.max_batch + 4,
        }
