"""initialize_dummy_weights: range, determinism, fp8, and finite outputs through a deep model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm.loader import initialize_dummy_weights


def deep_llama(dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deep_model_stays_finite(dtype: torch.dtype) -> None:
    model = deep_llama(dtype)
    initialize_dummy_weights(model)
    for name, param in model.named_parameters():
        assert param.dtype == dtype, name
        assert -1e-3 <= param.min().item() and param.max().item() <= 1e-3, name
        assert param.abs().max().item() > 5e-4, name  # actually filled, not left at zeros or ones
    with torch.no_grad():
        logits = model(torch.arange(12)[None]).logits.float()
    assert torch.isfinite(logits).all()
    assert logits.abs().max() > 0


def test_deterministic_per_seed() -> None:
    a, b, c = nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(16, 8)
    initialize_dummy_weights(a, seed=3)
    initialize_dummy_weights(b, seed=3)
    initialize_dummy_weights(c, seed=4)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert not torch.equal(a.weight, c.weight)


def test_custom_range_and_in_place() -> None:
    layer = nn.Linear(32, 32)
    storage = layer.weight.data_ptr()
    initialize_dummy_weights(layer, low=0.5, high=0.75)
    assert layer.weight.data_ptr() == storage
    assert 0.5 <= layer.weight.min().item() and layer.weight.max().item() <= 0.75
    with pytest.raises(ValueError, match="low < high"):
        initialize_dummy_weights(layer, low=1.0, high=1.0)


class Fp8AndInt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fp8 = nn.Parameter(torch.zeros(64, 64, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.packed = nn.Parameter(torch.full((4, 4), 7, dtype=torch.int32), requires_grad=False)
        self.g_idx = nn.Parameter(torch.arange(8, dtype=torch.int32), requires_grad=False)
        self.g_idx.skip_dummy_init = True
        self.register_buffer("cos_sin_cache", torch.ones(8))


def test_fp8_filled_int_random_marked_and_buffers_untouched() -> None:
    module = Fp8AndInt()
    initialize_dummy_weights(module)
    # e4m3's smallest step is 2**-9 ~ 0.00195, so U(-1e-3, 1e-3) rounds to {0, +-2**-9}: as in vLLM
    fp8 = module.fp8.float()
    assert set(fp8.unique().abs().tolist()) == {0.0, 2.0**-9}
    # Packed int weights get random bits (a quantized layout exercised as a real checkpoint would);
    # index tensors marked skip_dummy_init keep their valid values.
    assert module.packed.unique().numel() > 4
    assert torch.equal(module.g_idx, torch.arange(8, dtype=torch.int32))
    assert torch.equal(module.cos_sin_cache, torch.ones(8))
