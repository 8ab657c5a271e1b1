"""The typed engine messages: every command and reply survives msgpack (the engine process's wire),
errors come back as their builtin type, and the engine core answers the same messages the same way
in a thread and in its own process."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine import messages as m
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import MULTIPROCESSING_ENV, InprocClient
from pagedllm.engine.core_proc import multiprocessing_available
from pagedllm.engine.mp_client import MPClient
from pagedllm.request import Request
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from tests.entrypoints.conftest import make_tiny_model


def _round_trip(msg, decoder):
    return decoder.decode(m.encode(msg))


def test_every_message_survives_msgpack():
    sp = SamplingParams(temperature=0.7, top_k=5, seed=3, stop=["\n"], logit_bias={4: 2.0}, max_tokens=9,
                        output_kind=RequestOutputKind.DELTA)
    sp.update_from_generation_config({}, {2})  # the model's EOS joins the stop ids
    req = m.EngineCoreRequest.from_request(Request("r-0", [5, 6, 7], sp, arrival_time=12.5, cache_salt="s"))
    commands = [m.AddRequests([req]), m.AbortRequests(["a", "b"]), m.StopRequests({"a": "\n"}),
                m.ResetPrefixCache(7), m.InjectFault(3), m.InjectFault(None), m.Shutdown()]
    for cmd in commands:
        assert _round_trip(cmd, m.command_decoder) == cmd
    back = _round_trip(m.AddRequests([req]), m.command_decoder).requests[0].to_request()
    assert back.sampling_params.all_stop_token_ids == {2}  # derived, restored after decoding
    assert (back.request_id, back.prompt_token_ids, back.arrival_time, back.cache_salt) == ("r-0", [5, 6, 7], 12.5, "s")
    assert back.sampling_params.output_kind is RequestOutputKind.DELTA and back.sampling_params.logit_bias == {4: 2.0}
    err = m.ErrorInfo.from_exception(ValueError("bad prompt"))
    replies = [
        m.Ready(64), m.StartupFailed(err),
        m.StepOutputs([EngineCoreOutput("a", [3], [([3, 1], [-0.5, -1.5], 1)], "length", None, 16)],
                      SchedulerStats(1, 0, 0.25, 0, 32, 16), [0.01], 5),
        m.RequestsFailed([m.RequestFailure("a", err)]), m.PrefixCacheReset(7, True), m.EngineDead(err),
    ]
    for reply in replies:
        assert _round_trip(reply, m.reply_decoder) == reply


def test_errors_keep_their_builtin_type():
    e = m.ErrorInfo.from_exception(ValueError("too long")).to_exception()
    assert type(e) is ValueError and str(e) == "too long"

    class CustomError(Exception):
        pass

    e = m.ErrorInfo.from_exception(CustomError("odd")).to_exception()
    assert type(e) is RuntimeError and str(e) == "CustomError: odd"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama-msgs")))


CLIENTS = [pytest.param("0", InprocClient, id="thread"),
           pytest.param("1", MPClient, id="process", marks=pytest.mark.skipif(
               not multiprocessing_available(), reason="no forkserver start method here"))]


@pytest.mark.parametrize(("env", "client_class"), CLIENTS)
def test_the_same_messages_in_a_thread_and_a_process(model_dir, monkeypatch, env, client_class):
    monkeypatch.setenv(MULTIPROCESSING_ENV, env)
    engine = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, max_model_len=256, num_gpu_blocks_override=64,
                                                  device="cpu", cpu_threads=1))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    async def run():
        assert isinstance(engine.engine_core, client_class)
        first = [o async for o in engine.generate("Hello there", params, "a")][-1]
        steps = engine.engine_core.num_steps
        assert steps >= 6  # the core's own count of steps comes back with StepOutputs
        assert await engine.reset_prefix_cache() is True  # idle: reset
        again = [o async for o in engine.generate("Hello there", params, "b")][-1]
        assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
        return first.outputs[0].token_ids

    try:
        tokens = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(tokens) == 6
