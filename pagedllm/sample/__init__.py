"""Batched sampling (vLLM v1 style): SamplingMetadata built per step, Sampler applied to logits."""

from pagedllm.sample.metadata import RowInputs, SamplingMetadata, new_generator
from pagedllm.sample.sampler import LogprobsTensors, Sampler, SamplerOutput

__all__ = ["LogprobsTensors", "RowInputs", "Sampler", "SamplerOutput", "SamplingMetadata", "new_generator"]
