"""A quantized checkpoint on a CUDA GPU older than its method needs is refused at load, naming the
method, the GPU's compute capability and the minimum (QuantizationConfig.get_min_capability), before
any weight is read; the CPU runs every method. The capability query is monkeypatched: no GPU here."""

from __future__ import annotations

import pytest
import torch

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.loader.model_loader import check_capability, get_quant_config, load_model
from pagedllm.quantization.compressed_tensors import CompressedTensorsConfig
from pagedllm.quantization.fp8 import Fp8Config
from pagedllm.quantization.gptq import GPTQConfig
from tests.quantization import quant_ckpt as qc
from tests.utils import tiny_model

CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """Set the capability torch.cuda reports: gpu((8, 0)) is an A100."""
    def set_capability(cap: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    return set_capability


def test_fp8_checkpoint_on_an_a100_is_refused_before_its_weights_are_read(gpu):
    _, model = tiny_model("llama3")
    path = qc.fp8_checkpoint(model, per_channel=False, static=True)[0]
    config = EngineArgs(model=str(path), skip_tokenizer_init=True).create_engine_config()
    gpu((8, 0))
    with pytest.raises(ValueError, match=r"quantization 'fp8' needs a GPU of compute capability 8\.9 or newer "
                                         r"\(get_min_capability: 89\); cuda:0 has 8\.0 \(80\)"):
        load_model(config.model_config, CUDA)
    gpu((8, 9))  # an L4 / L40S: the config is built (the model itself would then load on the GPU)
    assert get_quant_config(config.model_config, CUDA).get_name() == "fp8"
    gpu((8, 0))
    assert get_quant_config(config.model_config, torch.device("cpu")).get_name() == "fp8"  # the CPU runs it


def test_each_method_against_its_own_minimum(gpu):
    gpu((7, 5))  # a T4
    check_capability(GPTQConfig(4, 32, False), CUDA)
    with pytest.raises(ValueError, match="'fp8' needs .* 8.9 .* has 7.5"):
        check_capability(Fp8Config(), CUDA)
    gpu((5, 2))
    with pytest.raises(ValueError, match="'gptq' needs a GPU of compute capability 6.0"):
        check_capability(GPTQConfig(4, 32, False), CUDA)


def _ct(weight_type: str) -> CompressedTensorsConfig:
    fmt = "float-quantized" if weight_type == "float" else "int-quantized"
    group = {"targets": ["Linear"],
             "weights": {"num_bits": 8, "type": weight_type, "symmetric": True, "strategy": "channel"},
             "input_activations": {"num_bits": 8, "type": weight_type, "symmetric": True, "strategy": "token",
                                   "dynamic": True}}
    return CompressedTensorsConfig.from_config({"format": fmt, "config_groups": {"group_0": group}})


def test_compressed_tensors_needs_what_its_schemes_need(gpu):
    # The class's floor is 75 (INT8, int4); an FP8 scheme runs FP8 GEMMs, as Fp8Config: 89.
    assert (_ct("int").required_capability(), _ct("float").required_capability()) == (75, 89)
    gpu((8, 6))
    check_capability(_ct("int"), CUDA)
    with pytest.raises(ValueError, match="'compressed-tensors' needs .* 8.9 .*get_min_capability: 89"):
        check_capability(_ct("float"), CUDA)
