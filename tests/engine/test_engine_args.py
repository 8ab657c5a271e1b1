"""EngineArgs -> EngineConfig for the knobs vLLM users bring: CUDA graph capture sizes (vLLM's
cudagraph_capture_sizes, max_cudagraph_capture_size, compilation_config, older vLLM's
cuda_graph_sizes), enable_chunked_prefill and attention_backend. CPU-only: the sizes resolve on
any device."""

import argparse

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import resolve_cudagraph_capture_sizes
from pagedllm.engine.arg_utils import EngineArgs
from tests.utils import assert_pool_idle, tiny_model


def sizes(**kw):
    args = EngineArgs(model=tiny_model("llama3")[0], device="cpu", **kw)
    return args.create_engine_config().compilation_config.cudagraph_capture_sizes


def test_default_sizes_follow_max_num_seqs():
    assert resolve_cudagraph_capture_sizes(None, None, 256, 8192)[0] == (1, 2, 4, *range(8, 257, 8))
    assert resolve_cudagraph_capture_sizes(None, None, 100, 8192) == ((1, 2, 4, *range(8, 97, 8), 100), [])
    assert resolve_cudagraph_capture_sizes(None, None, 3, 8192)[0] == (1, 2, 3)
    # A decode batch also has at most max_num_batched_tokens rows.
    assert resolve_cudagraph_capture_sizes(None, None, 256, 20)[0] == (1, 2, 4, 8, 16, 20)
    assert resolve_cudagraph_capture_sizes(None, None, 2048, 8192)[0][-1] == 512


def test_max_size_follows_vllms_pattern():
    kept, dropped = resolve_cudagraph_capture_sizes(None, 300, 512, 8192)
    assert kept == (1, 2, 4, *range(8, 256, 8), 256, 272, 288)
    assert dropped == []
    # Sizes above the largest decode batch are never replayed: dropped, and reported.
    kept, dropped = resolve_cudagraph_capture_sizes(None, 64, 20, 8192)
    assert kept == (1, 2, 4, 8, 16) and dropped == [24, 32, 40, 48, 56, 64]


def test_explicit_sizes_are_taken_as_given():
    assert resolve_cudagraph_capture_sizes([64, 8, 1, 8], None, 256, 8192) == ((1, 8, 64), [])
    assert resolve_cudagraph_capture_sizes([1, 2, 512], 512, 256, 8192) == ((1, 2), [512])


@pytest.mark.parametrize(
    "capture, max_size, match",
    [
        ([1, 4], 8, "must equal the largest"),
        ([], None, "non-empty"),
        ([0, 4], None, ">= 1"),
        ([1.5], None, "list of ints"),
        ("1 2", None, "list of ints"),
        (None, 0, ">= 1"),
        ([300], None, "no CUDA graph capture size"),
    ],
)
def test_bad_sizes_are_clear_errors(capture, max_size, match):
    with pytest.raises(ValueError, match=match):
        resolve_cudagraph_capture_sizes(capture, max_size, 256, 8192)


def test_every_way_of_setting_sizes_reaches_the_config():
    assert sizes(max_num_seqs=16) == (1, 2, 4, 8, 16)
    assert sizes(cudagraph_capture_sizes=[1, 8, 16]) == (1, 8, 16)
    assert sizes(max_cudagraph_capture_size=20) == (1, 2, 4, 8, 16)  # vLLM's pattern: multiples of 8 up to 20
    assert sizes(compilation_config={"cudagraph_capture_sizes": [2, 4]}) == (2, 4)
    assert sizes(compilation_config='{"max_cudagraph_capture_size": 24}') == (1, 2, 4, 8, 16, 24)
    assert sizes(compilation_config=3, max_num_seqs=8) == (1, 2, 4, 8)  # a level: no effect
    assert sizes(cudagraph_capture_sizes=[1, 4], compilation_config={"level": 3, "cudagraph_capture_sizes": None}) == (1, 4)
    assert sizes(cuda_graph_sizes=[32]) == (1, 2, 4, 8, 16, 24, 32)  # older vLLM: one value = the largest
    assert sizes(cuda_graph_sizes=[1, 2, 4, 8, 16, 32, 64, 128], max_num_seqs=256) == (1, 2, 4, 8, 16, 32, 64, 128)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(compilation_config={"splitting_ops": []}), "not supported; supported"),
        (dict(compilation_config={"cudagraph_mode": "PIECEWISE"}), "PIECEWISE is not built"),
        (dict(compilation_config="{not json"), "JSON object"),
        (dict(compilation_config=[1, 2]), "must be a dict"),
        (dict(cudagraph_capture_sizes=[1], compilation_config={"cudagraph_capture_sizes": [2]}), "mutually exclusive"),
        (dict(cuda_graph_sizes=[8], max_cudagraph_capture_size=8), "mutually exclusive"),
    ],
)
def test_conflicting_or_unknown_settings_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        sizes(**kw)


def test_cli_flags():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    path = tiny_model("llama3")[0]
    for argv, want in (
        (["--cudagraph-capture-sizes", "1", "2", "8"], (1, 2, 8)),
        (["--max-cudagraph-capture-size", "8"], (1, 2, 4, 8)),
        (["-O", '{"cudagraph_capture_sizes": [4]}'], (4,)),
        (["-O3", "--max-num-seqs", "4"], (1, 2, 4)),
    ):
        args = EngineArgs.from_cli_args(parser.parse_args(["--model", path, "--device", "cpu", *argv]))
        assert args.create_engine_config().compilation_config.cudagraph_capture_sizes == want, argv


def test_chunked_prefill_off_gives_the_same_tokens():
    path = tiny_model("llama3")[0]
    prompts = [{"prompt_token_ids": list(range(1, n))} for n in (90, 20, 150, 7)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for chunked in (True, False):
        llm = LLM(path, device="cpu", skip_tokenizer_init=True, max_model_len=192, max_num_batched_tokens=None
                  if not chunked else 32, enable_chunked_prefill=chunked, num_gpu_blocks_override=128)
        cfg = llm.llm_engine.engine_core.config.scheduler_config
        assert cfg.enable_chunked_prefill is chunked
        if not chunked:
            assert cfg.max_num_batched_tokens >= 192  # raised to fit a whole prompt
        outs[chunked] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_pool_idle(llm)
    assert outs[True] == outs[False]


def test_attention_backend_names_the_one_built():
    for name in (None, "auto", "CPU_ATTN", "cpu_attn"):
        assert sizes(attention_backend=name)  # accepted on the CPU
    for name in ("FLASHINFER", "TRITON_ATTN"):  # vLLM's names: ours runs instead, with a warning
        assert sizes(attention_backend=name)
    with pytest.raises(ValueError, match="'NOT_A_BACKEND' is not an attention backend name.*CPU_ATTN"):
        sizes(attention_backend="NOT_A_BACKEND")


def test_seed_none_is_vllm_v1s_zero_and_a_bad_seed_is_named():
    """LLM(seed=None) failed after the weights loaded with TypeError out of torch.manual_seed."""
    assert EngineArgs(model=tiny_model("llama3")[0], device="cpu", seed=None).create_engine_config(
    ).model_config.seed == 0
    for bad in ("1", 1.5, True):
        with pytest.raises(ValueError, match="seed must be an integer"):
            EngineArgs(model=tiny_model("llama3")[0], device="cpu", seed=bad).create_engine_config()
