"""The batch runner's stepping thread computes on the threads its governor decides, step by step."""

from __future__ import annotations

import asyncio
import itertools

import torch

from actors.batch_runner import BatchRunner
from actors.engine import Engine
from actors.events import TokenEvent
from actors.sampling import SamplingParams
from actors.thread_governor import StepProbe, ThreadGovernor
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


def _generate(engine: Engine, prompt: list[int], params: SamplingParams, governor: ThreadGovernor) -> list[int]:
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
        return asyncio.run(scenario())
    finally:
        use_threads_here(1)  # this module's tests compute on one thread (conftest)


def test_the_threads_change_between_steps_and_the_row_runs_on(parts):
    model, tokenizer = parts
    engine = Engine(model, tokenizer, max_batch=4, prefill_chunk_tokens=256)
    engine.eos_token_ids = frozenset()
    prompt = tokenizer.encode_chat([Message("user", "Tell me about queues.")])
    params = SamplingParams(max_tokens=32, temperature=0.0)
    expected = [e.token_id for e in engine.generate(prompt, params) if isinstance(e, TokenEvent)]

    governor = ThreadGovernor(1, 2, interval_s=1e-6, node_cpu=_FlappingNode(), rule="node_cpu")
    seen: list[tuple[int, int]] = []  # (threads torch computes on in the step, the governor's count)
    real_step = engine.step

    def step(*args, **kwargs):
        seen.append((torch.get_num_threads(), governor.threads))
        return real_step(*args, **kwargs)

    engine.step = step
    tokens = _generate(engine, prompt, params, governor)
    assert tokens == expected
    assert all(torch_threads == decided for torch_threads, decided in seen)
    assert {threads for threads, _ in seen} == {1, 2} and governor.num_changes >= 4


def test_the_measured_rule_hears_every_step_on_the_count_it_ran(parts):
    """Each step's measured ÷ rule time reaches the probe once, with the count torch computed that step on; a probe
    that tries the other count every other step moves between both, and the row's tokens are the same."""
    model, tokenizer = parts
    engine = Engine(model, tokenizer, max_batch=4, prefill_chunk_tokens=256)
    engine.eos_token_ids = frozenset()
    prompt = tokenizer.encode_chat([Message("user", "Tell me about queues.")])
    params = SamplingParams(max_tokens=24, temperature=0.0)
    expected = [e.token_id for e in engine.generate(prompt, params) if isinstance(e, TokenEvent)]
    assert engine.take_step_ratio() is not None and engine.take_step_ratio() is None  # taken once

    probe = StepProbe(1, 2, 2, probe_steps=1, min_home_steps=1, max_home_steps=1)
    heard: list[tuple[int, float]] = []
    real_observe = probe.observe

    def observe(threads: int, ratio: float) -> int:
        heard.append((threads, ratio))
        return real_observe(threads, ratio)

    probe.observe = observe
    ran: list[int] = []
    real_step = engine.step

    def step(*args, **kwargs):
        ran.append(torch.get_num_threads())
        return real_step(*args, **kwargs)

    engine.step = step
    tokens = _generate(engine, prompt, params, ThreadGovernor(1, 2, probe=probe))
    assert tokens == expected
    # The last step's ratio is heard before the next step, which never comes once the runner closes.
    assert [threads for threads, _ in heard] == ran[:len(heard)] and len(heard) >= len(ran) - 1
    assert all(ratio > 0 for _, ratio in heard)
    assert set(ran) == {1, 2} and probe.num_probes >= 2
