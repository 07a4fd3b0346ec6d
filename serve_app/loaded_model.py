"""A served model as the ingress holds it: its `.zqs` path, tokenizer and the figures decisions use.

Only the shard's header is read (config and tokenizer); the weights stay on disk for the actors.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.actor_config import ActorConfig
from actors.cold_start import warm_layers
from actors.compute_dtype import compute_dtype_for
from actors.shard_header import open_zqs
from actors.tokenizer import Tokenizer
from serve_app.config import ModelSpec, resolve_model_path
from serve_app.memory import ModelNumbers


@dataclass(frozen=True)
class LoadedModel:
    id: str
    display_name: str
    zqs_path: str
    tokenizer: Tokenizer
    numbers: ModelNumbers
    max_context: int
    created_at: float
    compute_dtype: str  # what the actors compute in (actors/compute_dtype.py)
    kv_dtype: str  # what their KV caches hold: compute_dtype, or "int8" (actor.kv_dtype)
    ttft_target_s: float | None = None
    total_target_s: float | None = None
    tpot_target_s: float | None = None
    warm_layers: int = 0  # a warm actor's layers resident before its request


def load_model(spec: ModelSpec, actor: ActorConfig) -> LoadedModel:
    path = resolve_model_path(spec)
    reader, config, tokenizer = open_zqs(path)  # header only: config + tokenizer
    reader.close()
    device_type = "cuda" if actor.num_gpus > 0 else "cpu"  # the actors' device
    num_warm = actor.warm_layers
    if num_warm is None:
        # Actors that pack their weights pack once every one is resident: a warm actor holding them all is packed
        # before its request; one holding fewer computes its first request with the plain weights, packing beside
        # it (benchmarks/results/warm_start.md: 0.029 s to a first token holding all 12 of `small`'s layers,
        # 0.34-0.57 s holding 1-9).
        num_warm = config.num_layers if actor.packs_weights_on(device_type) else warm_layers(
            config, actor.initial_load_bytes_per_s, actor.prefill_flops_per_s, actor.warm_prompt_tokens)
    window = config.max_position_embeddings
    # The actors' compute dtype, as they resolve it: what their weights and KV caches take.
    # Slots' CPUs are assumed to be like the ingress's own (one kind of node per cluster).
    dtype = compute_dtype_for(actor.compute_dtype, config.dtype, device_type)
    return LoadedModel(
        id=spec.id, display_name=spec.display_name, zqs_path=str(path), tokenizer=tokenizer,
        numbers=ModelNumbers.from_config(config, dtype, actor.is_kv_int8), compute_dtype=dtype,
        kv_dtype="int8" if actor.is_kv_int8 else dtype,
        max_context=min(window, spec.max_context) if spec.max_context else window,
        created_at=path.stat().st_mtime, ttft_target_s=spec.ttft_target_s, total_target_s=spec.total_target_s,
        tpot_target_s=spec.tpot_target_s, warm_layers=min(num_warm, config.num_layers),
    )
