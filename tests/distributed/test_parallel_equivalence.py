"""TP=2, PP=2 and TP=2 x PP=2 give the greedy tokens of TP=1, for tiny random models of every
architecture in float32: 32 tokens for a batch of mixed-length prompts, chunked prefill (a 16-token
budget splits the long prompts) and prefix caching on (a second batch re-reads the first's blocks).
The parallel engines run their ranks as worker processes (mp executor; Ray once, test_ray_executor.py)."""

from __future__ import annotations

import gc

import psutil
import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import tiny_model

LONG = list(range(5, 45))  # 40 tokens: three steps of prefill at a 16-token budget
BATCH_1 = [LONG, [30, 31, 32], LONG[:19] + [99, 98], [40]]
# Each shares LONG's first two blocks (32 tokens), cached by batch 1.
BATCH_2 = [LONG[:33] + [7], LONG + [11, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
ENGINE = dict(skip_tokenizer_init=True, max_num_batched_tokens=16, max_num_seqs=4, cpu_threads=1,
              num_gpu_blocks_override=64, enable_prefix_caching=True, enable_chunked_prefill=True)


def generate(path: str, **parallel: object) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of both batches, and the prefix-cache hits of batch 2."""
    llm = LLM(path, **ENGINE, **parallel)
    tokens = []
    for batch in (BATCH_1, BATCH_2):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    # As vLLM users free an engine: its worker processes go with it, and the next engine starts clean.
    del llm
    gc.collect()
    assert worker_processes() == [], worker_processes()
    return tokens, [o.num_cached_tokens for o in outs]


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
        ("llama3", 2, 1),
        ("mistral", 2, 1),
        ("qwen2", 2, 1),
        ("qwen3", 2, 1),
        ("qwen3", 1, 2),
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
