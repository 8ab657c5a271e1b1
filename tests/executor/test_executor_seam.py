"""The Executor seam: the engine core runs on any Executor (here a fake one, no model), start-up
takes the minimum over workers, get_class names what is missing, and what crosses it encodes."""

from __future__ import annotations

import importlib.util

import msgspec
import pytest

from pagedllm.config import ParallelConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.engine_core import EngineCore
from pagedllm.executor.abstract import Executor
from pagedllm.executor.uniproc import UniProcExecutor
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.utils import tiny_model


class _Handle:
    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def get(self) -> ModelRunnerOutput:
        return self.output


class FakeExecutor(Executor):
    """Two 'workers' that report different room; each step samples token (position + 100) % 500
    for every request that samples, as a model whose next token is a function of the position."""

    blocks = [(80, 0), (48, 0)]

    def _init_executor(self) -> None:
        self.calls: list[str] = ["init"]
        self.cache: tuple[int, int] | None = None
        self.steps: list[SchedulerOutput] = []
        self.num_computed: dict[str, int] = {}

    def determine_num_available_blocks(self) -> list[tuple[int, int]]:
        self.calls.append("determine")
        return list(self.blocks)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.calls.append("initialize_cache")
        self.cache = (num_gpu_blocks, num_cpu_blocks)

    def compile_or_warm_up_model(self) -> None:
        self.calls.append("warm_up")

    def execute_model(self, scheduler_output: SchedulerOutput) -> _Handle:
        so = scheduler_output
        self.steps.append(so)
        for new in so.scheduled_new_reqs:
            self.num_computed[new.req_id] = new.num_computed_tokens
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            self.num_computed[rid] += so.num_scheduled_tokens[rid]
            sampled.append((self.num_computed[rid] + 100) % 500)
        return _Handle(ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.fixture(scope="module")
def config():
    path, _ = tiny_model("llama3")
    return EngineArgs(model=path, skip_tokenizer_init=True, max_model_len=128, device="cpu").create_engine_config()


def test_engine_core_runs_on_a_fake_executor(config):
    core = EngineCore(config, executor_class=FakeExecutor)
    ex = core.model_executor
    assert isinstance(ex, FakeExecutor)
    assert ex.calls == ["init", "determine", "initialize_cache", "warm_up"]
    assert ex.cache == (48, 0) and core.num_gpu_blocks == 48  # the smaller worker decides
    assert core.scheduler.kv_cache_manager.num_blocks == 48
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    core.add_request(Request("a", [1, 2, 3], params))
    core.add_request(Request("b", list(range(1, 21)), params))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    finished = set()
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
    # The token sampled after n known tokens is (n + 100) % 500.
    assert tokens == {"a": [103, 104, 105, 106, 107], "b": [120, 121, 122, 123, 124]}
    assert finished == {"a", "b"}
    assert all(isinstance(so, SchedulerOutput) for so in ex.steps)
    core.shutdown()
    assert ex.calls[-1] == "shutdown"


def test_initialize_refuses_a_cache_smaller_than_max_model_len(config):
    class Small(FakeExecutor):
        blocks = [(100, 0), (7, 0)]  # 7 x 16 = 112 tokens < max_model_len 128

    with pytest.raises(ValueError, match=r"max_model_len \(128\) is larger than the 112 tokens"):
        EngineCore(config, executor_class=Small)


def test_get_class():
    assert Executor.get_class(ParallelConfig()) is UniProcExecutor
    assert ParallelConfig().distributed_executor_backend == "uni"
    for backend, module in (("mp", "pagedllm.executor.multiproc"), ("ray", "pagedllm.executor.ray_executor")):
        pc = ParallelConfig(distributed_executor_backend=backend)
        if importlib.util.find_spec(module) is None:
            with pytest.raises(ValueError, match=f"distributed_executor_backend='{backend}' is not available"):
                Executor.get_class(pc)
        else:
            assert issubclass(Executor.get_class(pc), Executor)
    with pytest.raises(ValueError, match="must be one of uni, mp, ray"):
        ParallelConfig(distributed_executor_backend="threads")
    # vLLM's third form: an Executor subclass by its qualified name, imported where the core runs.
    null = "pagedllm.benchmarks.null_executor.NullExecutor"
    assert Executor.get_class(ParallelConfig(distributed_executor_backend=null)).__name__ == "NullExecutor"
    for bad, why in (("pagedllm.nothing_here.Executor", "cannot be imported"),
                     ("pagedllm.config.ParallelConfig", "is not an Executor subclass")):
        with pytest.raises(ValueError, match=why):
            Executor.get_class(ParallelConfig(distributed_executor_backend=bad))


def test_the_null_executor_runs_the_whole_engine_without_a_model():
    # The serving path's ceiling (pagedllm/benchmarks/null_executor.py): real scheduler and
    # detokenizer, tokens a function of the position, every block back in the pool at the end.
    from pagedllm import LLM

    path, _ = tiny_model("llama3", with_tokenizer=True)
    llm = LLM(path, device="cpu", max_model_len=128, num_gpu_blocks_override=64,
              distributed_executor_backend="pagedllm.benchmarks.null_executor.NullExecutor")
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": list(range(1, 40))}],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    vocab = min(llm.llm_engine.config.model_config.vocab_size, 10000)
    assert [o.outputs[0].token_ids for o in outs] == [[(n * 7919 + 100) % vocab for n in range(p, p + 4)]
                                                      for p in (3, 39)]
    core = llm.llm_engine.engine_core
    assert core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_a_scheduler_output_round_trips_through_msgpack(config):
    # What a multiprocess executor broadcasts to its workers each step: plain data, no generators.
    from pagedllm.core.scheduler import Scheduler

    sched = Scheduler(config.scheduler_config, config.cache_config, 32)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=4, logit_bias={3: -1.0})
    sched.add_request(Request("a", [1, 2, 3], params))
    so = sched.schedule()
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(so), type=SchedulerOutput)
    assert back == so and back.scheduled_new_reqs[0].sampling_params.seed == 5


def test_model_runner_output_round_trips_through_msgpack():
    out = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[5, 0],
                            logprobs=[([5, 9], [-0.1, -2.5], 1), ([], [], 0)])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=ModelRunnerOutput)
    assert back == out
