"""vLLM's periodic stats log line (off with --disable-log-stats):

    Engine 000: Avg prompt throughput: 412.3 tokens/s, Avg generation throughput: 1873.0 tokens/s,
    Running: 12 reqs, Waiting: 0 reqs, GPU KV cache usage: 8.4%, Prefix cache hit rate: 31.0%

`record` is registered with the engine's stat loggers (as the Prometheus one is) and only adds up;
`log` prints one line for the time since the previous line and starts a new interval. The server
calls `log` every LOG_STATS_INTERVAL_S seconds (vLLM's VLLM_LOG_STATS_INTERVAL default); nothing
is printed while the engine is idle and was idle at the previous line too.
"""

from __future__ import annotations

import logging
import time

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.metrics.stats import IterationStats

logger = logging.getLogger("pagedllm.metrics")

LOG_STATS_INTERVAL_S = 10.0


class LoggingStatLogger:
    def __init__(self, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self._last: SchedulerStats | None = None
        self._reset(time.monotonic())
        self._last_line_idle = False
        self._prev_queries = 0
        self._prev_hits = 0

    def _reset(self, now: float) -> None:
        self._start = now
        self._prompt_tokens = 0
        self._generation_tokens = 0

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self._last = scheduler_stats
        if iteration_stats is not None:
            self._prompt_tokens += iteration_stats.num_prompt_tokens
            self._generation_tokens += iteration_stats.num_generation_tokens

    def log(self, now: float | None = None) -> str | None:
        """Log (and return) the line for the interval that ends now; None when idle twice in a row."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        s = self._last
        running = s.num_running_reqs if s else 0
        waiting = s.num_waiting_reqs if s else 0
        usage = s.kv_cache_usage if s else 0.0
        queries = (s.prefix_cache_queries if s else 0) - self._prev_queries
        hits = (s.prefix_cache_hits if s else 0) - self._prev_hits
        idle = not (self._prompt_tokens or self._generation_tokens or running or waiting)
        line = None
        if not (idle and self._last_line_idle):
            line = (
                f"Engine {self.engine_index:03d}: Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs, GPU KV cache usage: {usage * 100:.1f}%, "
                f"Prefix cache hit rate: {(hits / queries * 100) if queries else 0.0:.1f}%"
            )
            logger.info("%s", line)
        self._last_line_idle = idle
        if s is not None:
            self._prev_queries, self._prev_hits = s.prefix_cache_queries, s.prefix_cache_hits
        self._reset(now)
        return line
