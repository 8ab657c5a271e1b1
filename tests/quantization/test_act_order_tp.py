"""GPTQ act order (desc_act, g_idx) at tensor_parallel_size 2 (two CPU worker processes, gloo): a
row-parallel layer's rank keeps its slice of the inputs and of the group scales, which is right when its
inputs belong to its own groups (an act order within each rank's half of K, or GPTQ's static_groups:
the greedy tokens of TP=1), and is refused at load, naming the layer and what to do, when the groups are
scattered over all of K (plain desc_act: no kernel here reads a group index per input). group_size -1
(one group per channel) at TP=2 gives the tokens of TP=1 too."""

from __future__ import annotations

import gc
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from tests.quantization import quant_ckpt as qc
from tests.utils import tiny_model

PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(path: Path, tp: int) -> list[list[int]]:
    llm = LLM(str(path), skip_tokenizer_init=True, tensor_parallel_size=tp, cpu_threads=1,
              num_gpu_blocks_override=32, max_model_len=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    del llm  # its worker processes go with it
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs]


def _static_groups(src: Path) -> Path:
    """desc_act true with g_idx natural: what AutoGPTQ writes with static_groups."""
    dst = Path(tempfile.mkdtemp(prefix="pagedllm-static-groups-"))
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama3")[1]


def test_act_order_within_each_ranks_inputs_gives_tp1s_tokens(model):
    path = qc.gptq_checkpoint(model, 4, 32, desc_act=True, order_blocks=2)[0]
    assert _tokens(path, 2) == _tokens(path, 1)
    static = _static_groups(qc.gptq_checkpoint(model, 4, 32)[0])
    assert _tokens(static, 2) == _tokens(static, 1)


def test_act_order_scattered_over_all_inputs_is_refused_at_tp2(model):
    path = qc.gptq_checkpoint(model, 4, 32, desc_act=True)[0]
    with pytest.raises(Exception, match=r"(o|down)_proj\.g_idx: act order .* is not built at tensor_parallel_size 2: "
                                        r"rank \d of this row-parallel layer .* Run this checkpoint at "
                                        r"tensor_parallel_size 1"):
        _tokens(path, 2)


@pytest.mark.parametrize("desc_act", [False, True])
def test_one_group_per_channel_at_tp2_gives_tp1s_tokens(model, desc_act):
    # group_size -1: one scale row, the same on every rank; a row-parallel rank's inputs are one group of
    # K / 2 (before: refused as "32 inputs are not a whole number of groups of 64"). With act order, g_idx
    # is all 0: nothing to slice or refuse.
    path = qc.gptq_checkpoint(model, 8, -1, desc_act=desc_act)[0]
    assert _tokens(path, 2) == _tokens(path, 1)
