"""TP=2, PP=2 and TP=2 x PP=2 give the greedy tokens of TP=1, for tiny random models of every
architecture in float32: 32 tokens for a batch of mixed-length prompts, chunked prefill (a 16-token
budget splits the long prompts) and prefix caching on (a second batch re-reads the first's blocks).
The parallel engines run their ranks as worker processes (mp executor; Ray once, test_ray_executor.py).
Qwen3's engines also run a batch of json_schema requests (one engine start for both checks).
With PP the stages overlap: two batches were in flight at once (the engine core's batch queue), and
stage 0 started a step before the last stage had finished the one before (the ranks' clocks)."""

from __future__ import annotations

import gc
import json

import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.utils import tiny_model

LONG = list(range(5, 45))  # 40 tokens: three steps of prefill at a 16-token budget
BATCH_1 = [LONG, [30, 31, 32], LONG[:19] + [99, 98], [40]]
# Each shares LONG's first two blocks (32 tokens), cached by batch 1.
BATCH_2 = [LONG[:33] + [7], LONG + [11, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
ENGINE = dict(skip_tokenizer_init=True, max_num_batched_tokens=16, max_num_seqs=4, cpu_threads=1,
              num_gpu_blocks_override=64, enable_prefix_caching=True, enable_chunked_prefill=True)


def generate(path: str, constrained: bool = False, **parallel: object) -> tuple[list, list[int]]:
    """Greedy tokens of both batches, and the prefix-cache hits of batch 2. With `constrained` (a model
    with a tokenizer), the same engine then runs constrained_outputs' batch, whose
    (text, token ids) follow the greedy tokens' lists."""
    llm = LLM(path, **{**ENGINE, "skip_tokenizer_init": not constrained}, **parallel)
    tokens = []
    for batch in (BATCH_1, BATCH_2):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    cached = [o.num_cached_tokens for o in outs]
    if constrained:
        tokens += constrained_outputs(llm)
    if parallel.get("pipeline_parallel_size", 1) > 1:
        check_stages_overlapped(llm)
    # As vLLM users free an engine: its worker processes go with it, and the next engine starts clean.
    del llm
    gc.collect()
    assert worker_processes() == [], worker_processes()
    return tokens, cached


def check_stages_overlapped(llm: LLM) -> None:
    """Two batches were in flight at once, and stage 0 really ran ahead: it started step i+1 before
    the last stage finished step i. One batch at a time, the driver would publish step i+1 only
    after the last stage's answer to step i, so neither could happen."""
    core = llm.llm_engine.engine_core
    assert core.batch_queue.depth_counts[2] > 0, core.batch_queue.depth_counts
    times = core.model_executor.collective_rpc("step_times")  # per rank: (start, end) per step
    first, last = times[0], times[-1]
    assert len(first) == len(last) == core.step_count
    ahead = sum(first[i + 1][0] < last[i][1] for i in range(len(first) - 1))
    assert ahead > 0, (first, last)


def worker_processes() -> list[psutil.Process]:
    """Rank processes of the mp executor still alive under this process."""
    procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "multiproc_worker" in " ".join(p.cmdline()):
                procs.append(p)
        except psutil.NoSuchProcess:
            pass
    return procs


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    """TP=1 tokens per architecture, computed once (in-process, fast)."""
    return {}


@pytest.mark.parametrize(
    ("arch", "tp", "pp"),
    [
        # Mistral without a window is models/llama.py's code path under TP, as llama3 (its TP=1 tokens
        # are held to transformers in tests/engine/test_greedy_vs_transformers.py and tests/models/test_llama.py).
        ("llama3", 2, 1),
        ("qwen2", 2, 1),
        ("llama-tied", 2, 2),  # tied LM head on a last stage that does not embed
    ],
)
def test_parallel_greedy_equals_tp1(reference, arch: str, tp: int, pp: int):
    path, _ = tiny_model(arch)
    if arch not in reference:
        reference[arch], _ = generate(path)
    tokens, cached = generate(path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                              distributed_executor_backend="mp")
    assert all(c >= 32 for c in cached), cached  # batch 2 read batch 1's blocks
    assert all(len(t) == 32 for t in tokens)
    assert tokens == reference[arch]


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def constrained_outputs(llm: LLM) -> list[tuple[str, list[int]]]:
    """A batch of json-schema requests beside plain ones (the bitmask rows are not the batch's)."""
    json_params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True))
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in (LONG, [30, 31, 32], LONG[:19], [40, 41])]
    outs = llm.generate(prompts, [plain, json_params, plain, json_params], use_tqdm=False)
    return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_qwen3_greedy_and_structured_outputs_parallel(reference, tp: int, pp: int):
    """Qwen3 under TP=2 and PP=2: the greedy tokens of TP=1 (as test_parallel_greedy_equals_tp1), then
    json_schema requests on the same engine: under TP=2 the bitmask reaches both sampling ranks, under
    PP=2 the last stage's rank, through the batch queue; valid JSON, and TP=1's tokens with the schema."""
    path, _ = tiny_model("qwen3", vocab_size=49152, with_tokenizer=True)
    if "qwen3" not in reference:
        reference["qwen3"], _ = generate(path, constrained=True)
    outs, cached = generate(path, constrained=True, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                            distributed_executor_backend="mp")
    greedy, constrained = outs[:6], outs[6:]
    assert all(c >= 32 for c in cached), cached  # batch 2 read batch 1's blocks
    assert all(len(t) == 32 for t in greedy)
    for text, _ in (constrained[1], constrained[3]):
        data = json.loads(text)
        assert set(data) == {"name", "age"} and 0 <= data["age"] <= 120, text
    assert outs == reference["qwen3"]
