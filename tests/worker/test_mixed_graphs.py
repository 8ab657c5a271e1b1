"""The padded inputs of mixed-step CUDA graphs (worker/mixed_graphs.py) give the eager step's tokens.

A graph replays the forward over fixed shapes: a step's tokens padded to a captured token count and
its requests to max_num_seqs slots. On the CPU the same padded static-buffer path runs eagerly
(capture=False), so CI holds the padding itself to the plain forward, token for token; a GPU run
(`pytest tests/worker`) also replays real graphs.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import CompilationConfig
from pagedllm.worker.mixed_graphs import (
    MAX_MIXED_GRAPH_TOKENS,
    MIN_MIXED_GRAPH_TOKENS,
    active_parameters,
    has_experts,
    mixed_capture_sizes,
    mixed_graph_token_cap,
)
from tests.utils import assert_pool_idle, tiny_model


def test_capture_sizes_pad_a_step_by_at_most_a_quarter_and_end_at_the_budget():
    sizes = mixed_capture_sizes(8192)
    assert sizes[:4] == [64, 128, 192, 256] and sizes[-1] == 8192 and len(sizes) == 24
    assert sizes == sorted(set(sizes))
    for n in range(65, 8193, 7):
        pad = next(s for s in sizes if s >= n)
        assert pad - n <= max(64, n // 4)
    assert mixed_capture_sizes(300) == [64, 128, 192, 256, 300]
    assert mixed_capture_sizes(40) == [40]
    assert mixed_capture_sizes(32768)[-1] == MAX_MIXED_GRAPH_TOKENS
    # Large models stop where their kernels outlast the eager launches: ~8B parameters -> 1536 tokens.
    assert mixed_capture_sizes(8192, mixed_graph_token_cap(8_030_000_000))[-1] == 1536
    assert mixed_graph_token_cap(600_000_000) == MAX_MIXED_GRAPH_TOKENS
    assert mixed_graph_token_cap(10**12) == MIN_MIXED_GRAPH_TOKENS
    # Mixture-of-experts models: every size (their eager launches outlast the kernels).
    assert mixed_graph_token_cap(3_300_000_000, experts=True) == MAX_MIXED_GRAPH_TOKENS


def test_a_mixture_of_experts_counts_top_k_of_its_experts():
    from pagedllm.layers.fused_moe.layer import FusedMoE

    moe = FusedMoE(num_experts=8, top_k=2, hidden_size=16, intermediate_size=32)  # 8 x (2 x 32 + 32) x 16
    model = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False), moe)
    assert active_parameters(model) == 16 * 16 + 8 * 96 * 16 * 2 // 8
    assert has_experts(model) and not has_experts(torch.nn.Linear(2, 2))


def test_cudagraph_mode_takes_vllms_names_and_refuses_piecewise():
    assert CompilationConfig((1, 2)).mixed_graphs
    assert not CompilationConfig((1, 2), "FULL_DECODE_ONLY").mixed_graphs
    assert not CompilationConfig((1, 2), "NONE").decode_graphs
    with pytest.raises(ValueError, match="PIECEWISE is not built"):
        CompilationConfig((1, 2), "PIECEWISE")
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        CompilationConfig((1, 2), "SOMETIMES")
    from pagedllm.engine.arg_utils import EngineArgs

    path = tiny_model("llama3")[0]
    config = EngineArgs(model=path, skip_tokenizer_init=True, device="cpu", max_model_len=64,
                        compilation_config='{"cudagraph_mode": "full_decode_only"}').create_engine_config()
    assert config.compilation_config.cudagraph_mode == "FULL_DECODE_ONLY"


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_padded_mixed_steps_give_the_eager_steps_tokens():
    path = tiny_model("llama3")[0]
    # A small token budget and staggered prompts: most steps mix a prefill chunk with decodes,
    # chunks split prompts, and token counts fall between capture sizes.
    kwargs = dict(skip_tokenizer_init=True, max_model_len=256, dtype="float32", device="cpu",
                  max_num_batched_tokens=96, max_num_seqs=6, num_gpu_blocks_override=96, enable_prefix_caching=True)
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(n)] for i, n in enumerate([5, 70, 33, 130, 9, 64, 21, 100])]
    prompts.append(prompts[3][:80] + [5, 6, 7])  # a cached prefix, then a chunk
    reference = _generate(LLM(path, **kwargs), prompts)

    llm = LLM(path, **kwargs)
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    mixed = runner.make_mixed_graph_runner(capture=False)
    assert mixed is not None and mixed.sizes == [64, 96]
    mixed.capture()  # capture=False: captures nothing, runs the padded path eagerly
    runs = []
    run = mixed.run

    def counted(inp, fill):
        runs.append(len(inp.input_ids))
        return run(inp, fill)

    mixed.run = counted
    runner.mixed_graph_runner = mixed
    assert _generate(llm, prompts) == reference
    assert len(runs) >= 5 and any(n not in mixed.sizes for n in runs)  # padded steps ran
    assert_pool_idle(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixed_step_graphs_give_the_eager_tokens_on_the_gpu():
    path = tiny_model("llama3")[0]
    kwargs = dict(skip_tokenizer_init=True, max_model_len=256, dtype="float32", max_num_batched_tokens=96,
                  max_num_seqs=6, num_gpu_blocks_override=96)
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(n)] for i, n in enumerate([5, 70, 33, 130, 9, 64, 21, 100])]
    reference = _generate(LLM(path, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}, **kwargs), prompts)
    llm = LLM(path, **kwargs)
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    assert runner.mixed_graph_runner is not None and runner.mixed_graph_runner.graphs
    assert _generate(llm, prompts) == reference
    assert_pool_idle(llm)
