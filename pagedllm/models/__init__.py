"""Model definitions (vLLM-style: fused projections, flat token batch, paged attention)."""

from pagedllm.models.registry import get_supported_archs, resolve_model_cls

__all__ = ["get_supported_archs", "resolve_model_cls"]
