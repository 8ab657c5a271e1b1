"""Serving statistics: what the frontend measures (`stats`) and the Prometheus exporter (`prometheus`)."""

from pagedllm.metrics.stats import FinishedRequestStats, IterationStats

__all__ = ["FinishedRequestStats", "IterationStats"]
