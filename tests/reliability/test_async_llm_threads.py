"""AsyncLLM: output processing (detokenization) runs on the event loop, one step between the loop's
other work (no output thread to fight the loop for the GIL), a crash there is an engine death like a
crash in a step, a request id may be reused as soon as its request ended,
and a draining server can end every request and refuse new ones."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def make_engine(model_dir: Path) -> AsyncLLM:
    return AsyncLLM.from_engine_args(
        EngineArgs(model=str(model_dir), max_model_len=512, num_gpu_blocks_override=256, cpu_threads=1)
    )


def params(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA, **kw)


async def drain(stream) -> str:
    return "".join([o.outputs[0].text async for o in stream])


class Bound:
    """One engine and the one event loop its threads post to, for the whole module."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()

    def run(self, coro):
        return self.loop.run_until_complete(coro)


@pytest.fixture(scope="module")
def bound(tiny_model_dir: Path):
    b = Bound(make_engine(tiny_model_dir))
    yield b
    b.engine.shutdown()
    b.loop.close()


def test_detokenization_runs_on_the_loop_between_its_other_work(bound: Bound):
    engine = bound.engine
    threads = set()
    ticks_at_step: list[int] = []
    tokens_at_step: list[int] = []
    ticks = 0
    original = engine.output_processor.process_outputs

    def spy(outputs):
        threads.add(threading.get_ident())
        ticks_at_step.append(ticks)
        tokens_at_step.append(sum(len(o.new_token_ids) for o in outputs))
        return original(outputs)

    engine.output_processor.process_outputs = spy

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def run() -> int:
        task = asyncio.ensure_future(ticker())
        await drain(await engine.add_request("a", "Hello", params(max_tokens=16, ignore_eos=True)))
        task.cancel()
        return threading.get_ident()

    try:
        loop_thread = bound.run(run())
    finally:
        engine.output_processor.process_outputs = original
    assert threads == {loop_thread}
    # Other tasks ran between any two batches' processing: one batch per loop iteration (a batch is
    # one step, or the steps queued meanwhile when the loop fell behind: output_pump.py).
    assert sum(tokens_at_step) == 16
    assert len(ticks_at_step) >= 2 and all(b > a for a, b in zip(ticks_at_step, ticks_at_step[1:]))


def test_output_thread_crash_kills_the_engine(tiny_model_dir: Path):
    engine = make_engine(tiny_model_dir)  # its own: this one dies
    calls = 0
    original = engine.output_processor.process_outputs

    def flaky(outputs):
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("detokenizer exploded")
        return original(outputs)

    engine.output_processor.process_outputs = flaky
    died = []
    engine.add_dead_callback(died.append)

    async def run() -> None:
        stream = await engine.add_request("x", "Hello", params(max_tokens=50, ignore_eos=True))
        with pytest.raises(EngineDeadError, match="detokenizer exploded"):
            await drain(stream)
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.add_request("y", "Hello", params())

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(died) == 1 and engine.get_num_unfinished_requests() == 0


def test_request_id_reuse_right_after_an_abort_gets_only_its_own_tokens(bound: Bound):
    engine = bound.engine

    async def run() -> tuple[str, str]:
        reference = await drain(await engine.add_request("ref", "Reuse me", params(max_tokens=12)))
        for _ in range(5):  # abort mid-flight, then reuse the id at once
            stream = await engine.add_request("same", "Something else entirely", params(200, ignore_eos=True))
            await stream.__anext__()
            stream.abort()
            again = await drain(await engine.add_request("same", "Reuse me", params(max_tokens=12)))
            assert again == reference
        return reference, again

    reference, again = bound.run(run())
    assert reference and again == reference
    assert engine.get_num_unfinished_requests() == 0


def test_fail_all_requests_and_refuse_new(bound: Bound):
    """Last in this module: the engine refuses new requests afterwards."""
    engine = bound.engine
    last = []
    engine.stat_loggers.append(lambda s, it: last.append(s))

    async def run() -> None:
        streams = [await engine.add_request(f"r{i}", f"prompt {i}", params(200, ignore_eos=True, n=2))
                   for i in range(3)]
        await streams[0].__anext__()
        err = RuntimeError("draining")
        engine.refuse_new_requests(err)
        assert engine.fail_all_requests(err) == 3
        for s in streams:
            with pytest.raises(RuntimeError, match="draining"):
                await drain(s)
        with pytest.raises(RuntimeError, match="draining"):
            await engine.add_request("late", "x", params())
        # the engine itself stays healthy and frees every block
        await engine.check_health()
        for _ in range(500):  # the engine publishes its state once the aborts emptied it
            s = next((x for x in reversed(last) if x is not None), None)  # None: an abort's own record
            if s is not None and s.num_running_reqs == 0 and s.num_waiting_reqs == 0 and s.kv_cache_usage == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"engine not idle: {last[-1]}")

    bound.run(run())
    assert engine.get_num_unfinished_requests() == 0
