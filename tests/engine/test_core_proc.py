"""AsyncLLM on the CPU runs its EngineCore in a process of its own (engine/core_proc.py): the same
greedy tokens as the engine thread, the core's start-up errors raised where the engine is built, a
dead engine process seen as a dead engine, and no process left after shutdown."""

from __future__ import annotations

import asyncio
import os

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.engine.core_client import MULTIPROCESSING_ENV
from pagedllm.engine.core_proc import EngineCoreProc, multiprocessing_available
from pagedllm.engine.engine_core import EngineCore
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from tests.entrypoints.conftest import make_tiny_model

pytestmark = pytest.mark.skipif(not multiprocessing_available(), reason="no forkserver start method here")

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama-proc")))  # SmolLM2's tokenizer


def make_engine(model_dir: str, **kw) -> AsyncLLM:
    args = dict(model=model_dir, max_model_len=256, num_gpu_blocks_override=64, device="cpu", cpu_threads=1)
    return AsyncLLM.from_engine_args(EngineArgs(**{**args, **kw}))


async def generate(engine: AsyncLLM, prompts: list[str]) -> list[list[int]]:
    async def one(i: int, p: str) -> list[int]:
        outs = [o async for o in engine.generate(p, PARAMS, f"r{i}")]
        return outs[-1].outputs[0].token_ids

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def test_engine_process_gives_the_engine_threads_tokens(model_dir, monkeypatch):
    prompts = ["Hello there", "The sea is", "One two three four", "a"]
    engine = make_engine(model_dir)
    try:
        assert isinstance(engine.engine_core.core, EngineCoreProc) and engine.engine_core.core.process.is_alive()
        assert engine.engine_core.num_gpu_blocks == 64
        in_process = asyncio.run(generate(engine, prompts))
    finally:
        engine.shutdown()
    assert not engine.engine_core.core.process.is_alive()
    monkeypatch.setenv(MULTIPROCESSING_ENV, "0")
    threaded = make_engine(model_dir)
    try:
        assert isinstance(threaded.engine_core.core, EngineCore)
        assert asyncio.run(generate(threaded, prompts)) == in_process
    finally:
        threaded.shutdown()


def test_core_start_up_errors_are_raised_here(model_dir):
    with pytest.raises(ValueError, match="larger than the 32 tokens"):
        make_engine(model_dir, num_gpu_blocks_override=2)


def test_a_killed_engine_process_is_a_dead_engine(model_dir):
    engine = make_engine(model_dir)
    died = []
    engine.add_dead_callback(died.append)

    async def run() -> None:
        stream = await engine.add_request("x", "Hello", SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        os.kill(engine.engine_core.core.process.pid, 9)
        with pytest.raises(EngineDeadError, match="engine process exited"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.check_health()

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(died) == 1


def test_a_prestarted_engine_process_serves_the_frontends_config(model_dir):
    """`pagedllm serve` starts its engine process before its config exists (core_proc's prestart):
    that process builds the config itself and loads the model; the frontend's config decides. The
    same arguments: the prestarted process is taken. Other arguments (never the case in the server,
    which passes the same EngineArgs): the core is built again from the frontend's config. Unused:
    the process is ended."""
    from pagedllm.engine import core_proc

    args = dict(model=model_dir, max_model_len=256, device="cpu", cpu_threads=1)
    same = EngineArgs(**args, num_gpu_blocks_override=64)
    core_proc.prestart_engine_process(same, warm_cuda=False)
    early = core_proc._prestarted.result(60)
    proc = EngineCoreProc.start(same.create_engine_config(), None)
    try:
        assert proc is early
        proc.wait_ready()
        assert proc.num_gpu_blocks == 64
    finally:
        proc.close()
    core_proc.prestart_engine_process(EngineArgs(**args, num_gpu_blocks_override=64), warm_cuda=False)
    proc = EngineCoreProc.start(EngineArgs(**args, num_gpu_blocks_override=48).create_engine_config(), None)
    try:
        proc.wait_ready()
        assert proc.num_gpu_blocks == 48  # the frontend's config, not the one the process built first
    finally:
        proc.close()
    core_proc.prestart_engine_process(same, warm_cuda=False)
    unused = core_proc._prestarted.result(60)
    core_proc.discard_prestarted_engine_process()
    assert not unused.process.is_alive() and core_proc._prestarted is None


def test_a_prestarted_process_fits_an_environment_with_unread_additions():
    from pagedllm.engine.core_proc import env_fits as _env_fits

    then = {"PATH": "/bin", "PAGEDLLM_FUSED_QKV": "1"}
    assert _env_fits(then, dict(then))
    assert _env_fits(then, {**then, "KMP_DUPLICATE_LIB_OK": "True"})  # set by an import since: never read
    assert _env_fits(then, {**then, "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"})  # the same (seen on the H200 host)
    assert not _env_fits(then, {**then, "PAGEDLLM_FUSED_QKV": "0"})  # changed
    assert not _env_fits(then, {"PATH": "/bin"})  # removed
    assert not _env_fits(then, {**then, "TRITON_INTERPRET": "1"})  # added, but read at import

