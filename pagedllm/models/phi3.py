"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's graph with checkpoint tensors already fused.

    self_attn.qkv_proj.weight  rows [q (heads * head_dim); k (kv_heads * head_dim); v (same)]
    mlp.gate_up_proj.weight    rows [gate (intermediate); up (intermediate)]
load straight into QKVParallelLinear / MergedColumnParallelLinear (their loaders split a fused tensor
into this rank's shards). Rope: default, or "longrope" (su) for the 128K checkpoints, see
`LongRoPEScalingRotaryEmbedding` for how its short/long switch compares with transformers'.
config.sliding_window (2047 in Phi-3-mini-4k) applies to every layer.
"""

from __future__ import annotations

from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.utils import StackedParamsMapping


class Phi3ForCausalLM(LlamaForCausalLM):
    # Nothing to stack: the checkpoint names already are the fused parameters' names.
    stacked_params_mapping: StackedParamsMapping = []
