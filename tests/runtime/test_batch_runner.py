"""The batch runner's stepping thread computes on the threads its governor decides, step by step."""

from __future__ import annotations

import asyncio
import itertools

import torch

from actors.batch_runner import BatchRunner
from actors.engine import Engine
from actors.events import TokenEvent
from actors.sampling import SamplingParams
from actors.thread_governor import ThreadGovernor
from actors.threads import use_threads_here
from actors.tokenizer import Message
from tests.runtime import test_batch_engine

parts = test_batch_engine.parts  # the batch tests' fp32 tiny model (a module-scoped fixture)


class _FlappingNode:
    """A node of 2 cores whose other processes take a whole core, then nothing, in turn."""

    num_cores = 2

    def __init__(self) -> None:
        self._others = itertools.cycle([1.0, 1.0, 0.0, 0.0])

    def others_cores(self) -> float:
        return next(self._others)


def test_the_threads_change_between_steps_and_the_row_runs_on(parts):
    model, tokenizer = parts
    engine = Engine(model, tokenizer, max_batch=4, prefill_chunk_tokens=256)
    engine.eos_token_ids = frozenset()
    prompt = tokenizer.encode_chat([Message("user", "Tell me about queues.")])
    params = SamplingParams(max_tokens=32, temperature=0.0)
    expected = [e.token_id for e in engine.generate(prompt, params) if isinstance(e, TokenEvent)]

    governor = ThreadGovernor(1, 2, interval_s=1e-6, node_cpu=_FlappingNode())
    seen: list[tuple[int, int]] = []  # (threads torch computes on in the step, the governor's count)
    real_step = engine.step

    def step(*args, **kwargs):
        seen.append((torch.get_num_threads(), governor.threads))
        return real_step(*args, **kwargs)

    engine.step = step

    async def scenario() -> list[int]:
        runner = BatchRunner(engine, name="zq-test-batch", threads=governor)
        stream = runner.submit(prompt, params)
        tokens = []
        while not stream.is_done:
            event = await asyncio.wait_for(stream.get(), 60)
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
        runner.close()
        return tokens

    try:
        tokens = asyncio.run(scenario())
    finally:
        use_threads_here(1)  # this module's tests compute on one thread (conftest)
    assert tokens == expected
    assert all(torch_threads == decided for torch_threads, decided in seen)
    assert {threads for threads, _ in seen} == {1, 2} and governor.num_changes >= 4
