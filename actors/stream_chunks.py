"""How a row's tokens leave its actor: how often (`chunk_interval_s`), and as how many items (`coalesce`).

Every chunk a row sends is a Ray object to the ingress and an SSE event on to the proxy and the client; on a
CPU node that handling runs on the cores the batch steps on, and token by token a batch streams a chunk per
decoding row a step (eight rows on 30 ms steps: ~270 a second). So the actor's rows together send at most
`max_chunks_per_s` chunks a second: with n rows, each row's chunks leave at least n / max_chunks_per_s apart,
never less than the per-row minimum, never more than `max_interval_s` (a client still sees its text move several
times a second). One row alone streams as before, token by token; a full batch streams in chunks of several tokens. The first token
always leaves at once (time to first token is unchanged), the last ones as the row ends, and a request that asks
for low latency (`ActorRequest.is_low_latency`) gets every token alone.

Measured (benchmarks/results/peer_stream_chunks_long.md: `make serve`'s app under GuideLLM, 32 prompt tokens,
128 output tokens): at 2 req/s, streamed token by token it served 47 of 81 requests at 150 output tokens/s, ITL
P50 93 ms, its processes besides the engines spending 355 ms of CPU a served request; with the share, in two runs
bracketing that one, 67 and 72 at 214 and 230 tokens/s, ITL P50 50 and 37 ms, 185 and 147 ms. Under the default
profile (16 output tokens: rows mostly prefilling, steps longer than the share's interval) nothing differed
beyond the spread between two runs of one config (peer_stream_chunks.md).
"""

from __future__ import annotations

from actors.messages import TextChunk


def chunk_interval_s(num_rows: int, min_interval_s: float, max_chunks_per_s: float, max_interval_s: float) -> float:
    """How long after one of its chunks a row's next may leave, while the actor runs `num_rows` rows.

    At least `min_interval_s`; beyond it, the rows' share of `max_chunks_per_s` (0: no share), capped at
    `max_interval_s`.
    """
    if max_chunks_per_s <= 0:
        return min_interval_s
    return max(min_interval_s, min(max_interval_s, num_rows / max_chunks_per_s))


def coalesce(items: list) -> list:
    """Merge runs of consecutive TextChunks into one; every other item keeps its place."""
    out: list = []
    for item in items:
        prev = out[-1] if out else None
        if isinstance(item, TextChunk) and isinstance(prev, TextChunk):
            out[-1] = TextChunk(prev.token_ids + item.token_ids, prev.text + item.text,
                                item.num_output_tokens, item.time)
        else:
            out.append(item)
    return out
