"""AsyncLLM in-process (no HTTP): streaming deltas, abort on close / cancel, engine death."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.engine.core_client import MAX_PENDING_BATCHES
from pagedllm.engine.output_stream import RequestOutputCollector
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

# How far the engine process may have stepped past the frontend's `num_steps` when the frontend acts: the
# batches its reader may hold (MAX_PENDING_BATCHES) and the one being read. `<= 2` steps counted from the
# frontend's view failed now and then in full CI runs on a loaded 2-core machine (3 steps, seventeenth session).
STEPS_AHEAD = MAX_PENDING_BATCHES + 1


def make_engine(model_dir: Path) -> AsyncLLM:
    args = EngineArgs(model=str(model_dir), max_model_len=512, num_gpu_blocks_override=256, cpu_threads=1)
    return AsyncLLM.from_engine_args(args)


class Harness:
    """One engine bound to one event loop for the whole module (the engine thread posts to it)."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.stats = []
        engine.stat_loggers.append(lambda s, it: self.stats.append(s))

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def wait_idle(self, timeout: float = 5.0) -> None:
        """Until the engine reports 0 running, 0 waiting and a free pool."""
        for _ in range(int(timeout / 0.01)):
            s = self.stats[-1] if self.stats else None
            if s is not None and s.num_running_reqs == 0 and s.num_waiting_reqs == 0 and s.kv_cache_usage == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"engine not idle: {self.stats[-1] if self.stats else None}")


@pytest.fixture(scope="module")
def h(tiny_model_dir: Path) -> Iterator[Harness]:
    harness = Harness(make_engine(tiny_model_dir))
    yield harness
    harness.engine.shutdown()
    harness.loop.close()


def params(kind: RequestOutputKind, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, output_kind=kind, **{"max_tokens": 12, **kw})


def test_deltas_add_up_to_the_final_output(h: Harness):
    async def run():
        final = [o async for o in h.engine.generate("Hello there", params(RequestOutputKind.FINAL_ONLY), "f")]
        deltas = [o async for o in h.engine.generate("Hello there", params(RequestOutputKind.DELTA), "d")]
        seeded = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=8, output_kind=RequestOutputKind.DELTA)
        n2 = [o async for o in h.engine.generate("Hello there", seeded, "n2")]
        seeded.output_kind = RequestOutputKind.FINAL_ONLY
        n2_final = [o async for o in h.engine.generate("Hello there", seeded, "n2f")]
        return final, deltas, n2, n2_final

    final, deltas, n2, n2_final = h.run(run())
    assert len(final) == 1 and final[0].finished
    assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
    assert "".join(o.outputs[0].text for o in deltas) == final[0].outputs[0].text
    assert sum(len(o.outputs[0].token_ids) for o in deltas) == 12
    texts = ["", ""]
    for o in n2:
        for c in o.outputs:
            texts[c.index] += c.text
    assert texts == [c.text for c in n2_final[0].outputs]


def test_closing_the_generator_aborts_within_one_step(h: Harness):
    async def run():
        gen = h.engine.generate("abort me", params(RequestOutputKind.DELTA, max_tokens=400, ignore_eos=True), "a")
        for _ in range(3):
            await gen.__anext__()
        steps_at_close = h.engine.engine_core.num_steps
        await gen.aclose()
        await h.wait_idle()
        return h.engine.engine_core.num_steps - steps_at_close

    # Never the 400 tokens asked for. The bound counts from `engine_core.num_steps`, the newest step the
    # frontend's reader has taken off the engine process's pipe: on a loaded machine the engine runs up to
    # the batches in transit ahead of it (STEPS_AHEAD); then the step running when the abort arrives ends.
    assert h.run(run()) <= STEPS_AHEAD + 1
    assert h.engine.get_num_unfinished_requests() == 0
    assert not h.engine.output_processor.has_unfinished_requests()


def test_cancelling_the_consumer_aborts(h: Harness):
    async def consume():
        async for _ in h.engine.generate("cancel me", params(RequestOutputKind.DELTA, max_tokens=400, ignore_eos=True),
                                         "c"):
            pass

    async def run():
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.3)
        steps_at_cancel = h.engine.engine_core.num_steps
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await h.wait_idle()
        return h.engine.engine_core.num_steps - steps_at_cancel

    # As in the close test above: the steps in transit when the consumer is cancelled, then the one that
    # runs when the abort (sent once the cancellation has unwound the consumer) arrives.
    assert h.run(run()) <= STEPS_AHEAD + 1
    assert h.engine.get_num_unfinished_requests() == 0


def test_bad_requests_are_refused_before_queueing(h: Harness):
    async def run():
        with pytest.raises(ValueError, match="maximum context length"):
            await h.engine.add_request("long", [1] * 500, params(RequestOutputKind.DELTA, max_tokens=100))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await h.engine.add_request("oov", [10**6], params(RequestOutputKind.DELTA))
        stream = await h.engine.add_request("dup", "x", params(RequestOutputKind.FINAL_ONLY))
        with pytest.raises(ValueError, match="already in use"):
            await h.engine.add_request("dup", "y", params(RequestOutputKind.FINAL_ONLY))
        return [o async for o in stream]

    outs = h.run(run())
    assert len(outs) == 1 and outs[0].finished
    assert h.engine.get_num_unfinished_requests() == 0


def test_tokenization_runs_off_the_event_loop(h: Harness):
    seen = []
    original = h.engine.processor.tokenize_prompt

    def spy(prompt):
        seen.append(threading.get_ident())
        return original(prompt)

    h.engine.processor.tokenize_prompt = spy
    try:
        loop_thread = h.run(_thread_id())
        h.run(_drain(h.engine.generate("spy", params(RequestOutputKind.FINAL_ONLY), "spy")))
    finally:
        h.engine.processor.tokenize_prompt = original
    assert seen and all(t != loop_thread for t in seen)


async def _thread_id() -> int:
    return threading.get_ident()


async def _drain(gen) -> list:
    return [o async for o in gen]


def test_collector_merges_deltas_for_a_slow_consumer():
    def out(index: int, text: str, ids: list[int], finished: bool = False) -> RequestOutput:
        comp = CompletionOutput(index, text, ids, None, None, "length" if finished else None)
        return RequestOutput("r", "p", [1], [comp], finished)

    async def run():
        c = RequestOutputCollector(RequestOutputKind.DELTA)
        c.put(out(0, "a", [1]))
        c.put(out(1, "x", [7]))
        c.put(out(0, "b", [2], finished=True))
        merged = await c.get()
        assert c.get_nowait() is None
        c.put(RuntimeError("boom"))
        c.put(out(0, "lost", [3]))
        with pytest.raises(RuntimeError):
            await c.get()
        return merged

    merged = asyncio.run(run())
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in merged.outputs] == [
        (0, "ab", [1, 2], "length"), (1, "x", [7], None)
    ]
    assert merged.finished


def test_engine_death_fails_requests_and_health(tiny_model_dir: Path):
    engine = make_engine(tiny_model_dir)
    died = []
    engine.add_dead_callback(died.append)

    async def run():
        engine.engine_core.fail_at_step = 3  # the test-only fault hook (env PAGEDLLM_TEST_FAIL_AT_STEP)
        await engine.check_health()
        with pytest.raises(EngineDeadError, match="injected fault"):
            async for _ in engine.generate("x", params(RequestOutputKind.DELTA, max_tokens=50), "doomed"):
                pass
        assert engine.errored
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.add_request("after", "x", params(RequestOutputKind.DELTA))

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(died) == 1 and isinstance(died[0], EngineDeadError)
