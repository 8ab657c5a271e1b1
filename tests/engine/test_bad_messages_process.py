"""One bad message costs one request, never the engine: through AsyncLLM and its real engine process on
the CPU (tiny random model). Each test injects a message that cannot cross the process boundary (or a
failure in one request's output processing), sees that request fail with an error that says why,
and then sees the next request served by the same engine process; at the end no process is left."""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import Future

import msgspec
import numpy as np
import pytest

from pagedllm.engine import mp_client
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_proc import EngineCoreProc, multiprocessing_available
from pagedllm.engine.messages import AddRequests, ResetPrefixCache, encode
from pagedllm.engine.output_processor import RequestState
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from tests.entrypoints.conftest import make_tiny_model

pytestmark = pytest.mark.skipif(not multiprocessing_available(), reason="no forkserver start method here")

TIMEOUT_S = 60  # a hang fails the test instead of blocking the run


class Bound:
    """One engine (in its own process) and the one event loop its threads post to."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        proc = engine.engine_core.core
        assert isinstance(proc, EngineCoreProc)
        self.pid = proc.process.pid

    def run(self, coro):
        return self.loop.run_until_complete(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.fixture(scope="module")
def bound(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-llama-bad-msgs"))
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(model), max_model_len=256, num_gpu_blocks_override=64,
                                                  device="cpu", cpu_threads=1))
    b = Bound(engine)
    yield b
    engine.shutdown()
    b.loop.close()
    assert not engine.engine_core.core.process.is_alive()
    assert not [p for p in multiprocessing.active_children() if p.name == "pagedllm-engine-core"]


def params(max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY, **kw)


async def tokens(engine: AsyncLLM, rid: str, sp: SamplingParams | None = None) -> list[int]:
    outs = [o async for o in engine.generate("Hello there", sp or params(), rid)]
    return outs[-1].outputs[0].token_ids


def assert_still_serving(b: Bound, rid: str) -> None:
    """The same engine process serves a following request; every client thread is alive."""
    assert len(b.run(tokens(b.engine, rid))) == 6
    client = b.engine.engine_core
    assert client.core.process.pid == b.pid and client.core.process.is_alive()
    assert client._sender_thread.is_alive() and client._receiver_thread.is_alive()
    assert not b.engine.errored and b.engine.get_num_unfinished_requests() == 0


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("seed", 2**70, "sampling_params.seed (int 1180591620717411303424)"),
    ("temperature", np.float64(0.0), "sampling_params.temperature (numpy.float64 0.0)"),
])
def test_a_command_the_sender_cannot_encode_fails_its_request_alone(bound: Bound, name, value, shown):
    sp = params()
    setattr(sp, name, value)  # after validation: a value of a type that slipped through
    with pytest.raises(RuntimeError, match=r"could not be sent to the engine: requests\[0\]\." + shown.replace(
            "(", r"\(").replace(")", r"\)")):
        bound.run(tokens(bound.engine, f"unsendable-{name}", sp))
    assert_still_serving(bound, f"after-unsendable-{name}")


def test_frames_the_engine_process_cannot_decode_fail_their_request_alone(bound: Bound, monkeypatch):
    def corrupting_encode(command):
        if isinstance(command, AddRequests) and command.requests[0].request_id.startswith("poison"):
            raw = msgspec.msgpack.decode(encode(command))
            raw[1][0][2]["max_tokens"] = "lots"  # AddRequests -> requests[0] -> sampling_params
            return msgspec.msgpack.encode(raw)
        return encode(command)

    monkeypatch.setattr(mp_client, "encode", corrupting_encode)
    with pytest.raises(RuntimeError, match=r"could not read this request: Expected .* at requests\[0\]\.sampling_params\.max_tokens"):
        bound.run(tokens(bound.engine, "poison"))
    monkeypatch.setattr(mp_client, "encode", encode)
    assert_still_serving(bound, "after-poison")
    # Bytes that are not a message at all, written on the pipe while the engine is idle: logged,
    # nobody to answer.
    bound.engine.engine_core.core.send_frame(b"\xc1 not msgpack")
    bound.engine.engine_core.core.send_frame(b"")
    assert_still_serving(bound, "after-garbage")


def test_a_reply_the_frontend_cannot_decode_fails_its_request_alone(bound: Bound, monkeypatch):
    proc = bound.engine.engine_core.core
    real_recv_frames = proc.recv_frames

    def corrupting_recv_frames():
        frames = real_recv_frames()
        for i, frame in enumerate(frames):
            if b"garbled" in frame:
                raw = msgspec.msgpack.decode(frame)
                if raw[0] == "StepOutputs":
                    for out in raw[1]:
                        if "garbled" in out["request_id"]:
                            out["new_token_ids"] = ["not a token"]
                    frames[i] = msgspec.msgpack.encode(raw)
        return frames

    monkeypatch.setattr(proc, "recv_frames", corrupting_recv_frames)

    async def both():
        return await asyncio.gather(tokens(bound.engine, "garbled"), tokens(bound.engine, "readable"),
                                    return_exceptions=True)

    bad, good = bound.run(both())
    assert isinstance(bad, RuntimeError), bad
    assert str(bad) == ("the engine's reply for this request could not be read: Expected `int`, got `str` - at "
                        "new_token_ids[0]")
    assert len(good) == 6  # its outputs came in the same frames
    monkeypatch.undo()  # the receiver may be inside the patched call still: the next ids do not match
    assert_still_serving(bound, "after-bad-reply")


def test_a_cancelled_reset_prefix_cache_leaves_the_receiver_alive(bound: Bound):
    """asyncio.wrap_future cancels the call's future when the awaiting task is cancelled (a client gone);
    the reply arrives later and must not end the receiver thread (InvalidStateError)."""
    client = bound.engine.engine_core
    fut: Future = Future()
    client._calls[10**6] = fut
    fut.cancel()
    client.send(ResetPrefixCache(10**6))
    assert_still_serving(bound, "after-cancelled-call")
    assert bound.run(bound.engine.reset_prefix_cache()) is True


def test_one_requests_output_processing_failure_fails_it_alone(bound: Bound, monkeypatch):
    real_add = RequestState.add

    def flaky_add(self, out):
        if "broken" in self.request_id and self.token_ids:
            raise IndexError("detokenizer: token outside the table")
        return real_add(self, out)

    monkeypatch.setattr(RequestState, "add", flaky_add)

    async def both():
        stream_params = params(max_tokens=6)
        stream_params.output_kind = RequestOutputKind.DELTA
        return await asyncio.gather(tokens(bound.engine, "broken", stream_params), tokens(bound.engine, "fine"),
                                    return_exceptions=True)

    bad, good = bound.run(both())
    assert isinstance(bad, RuntimeError) and "output could not be processed: IndexError: detokenizer" in str(bad)
    assert len(good) == 6
    monkeypatch.undo()
    assert_still_serving(bound, "after-failed-output")


def test_a_failing_stat_logger_costs_no_output(bound: Bound):
    calls = []

    def broken_logger(stats, it):
        calls.append(1)
        raise ZeroDivisionError("metrics bug")

    bound.engine.stat_loggers.append(broken_logger)
    try:
        assert_still_serving(bound, "logged-1")
        assert_still_serving(bound, "logged-2")  # the pump drains after a handler's failure too
    finally:
        bound.engine.stat_loggers.remove(broken_logger)
    assert len(calls) >= 2
