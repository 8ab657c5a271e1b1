"""`--load-format dummy`: fill a model with small random weights, as vLLM does, for benchmarks.

Every floating-point parameter, norm weights included, gets U(low, high) with low/high = -/+1e-3.
Small values keep a deep model finite in bf16: an RMSNorm with weights ~1e-3 scales its output down
to ~1e-3, each projection of width h multiplies magnitudes by ~sqrt(h) * 1e-3 < 1, so activations shrink
layer after layer instead of growing, and nothing overflows (tests run 24 layers in bf16 and fp32).

As vLLM, the generator is re-seeded with `seed` for each parameter, so the values depend only on the
seed and the parameter's shape and dtype, not on the order of the parameters.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0, low: float = -1e-3, high: float = 1e-3) -> None:
    """Fill every floating-point parameter of `model` in place, on its own device, with U(low, high).

    Integer parameters (packed int4/int8 quantized weights, zero points) get random bits, so a
    quantized layout is exercised as a real checkpoint would; parameters marked `skip_dummy_init`
    (GPTQ g_idx, compressed-tensors weight_shape) keep the valid values their method created.
    Buffers are left alone too, unlike vLLM's `state_dict()` walk: ours hold derived tables (rotary
    cos/sin) that must stay exact.
    """
    if not low < high:
        raise ValueError(f"initialize_dummy_weights needs low < high, got low={low}, high={high}")
    for param in model.parameters():
        if getattr(param, "skip_dummy_init", False):
            continue
        generator = torch.Generator(device=param.device)
        generator.manual_seed(seed)
        if not torch.is_floating_point(param):
            param.random_(generator=generator)
            continue
        if torch.finfo(param.dtype).bits < 16:
            # uniform_ has no kernel for 8-bit floats (fp8 weights): draw in fp16, then cast.
            tmp = torch.empty(param.shape, dtype=torch.float16, device=param.device)
            tmp.uniform_(low, high, generator=generator)
            param.copy_(tmp.to(param.dtype))
        else:
            param.uniform_(low, high, generator=generator)
