"""What the web console shows, gathered on the event loop from the engine's per-step stats.

`ConsoleFeed.record` is one more stat logger (AsyncLLM calls each with the core's SchedulerStats
and the frontend's IterationStats of every batch of outputs). It keeps the latest gauges, the
latest KV block map, per-second series over the last `window_s` seconds and the most recently
finished requests; `snapshot()` turns that into one JSON-ready dict for the event stream.

Nothing here waits or grows without bound: series are a fixed-size ring, the request list a
bounded deque, and the block map is replaced, never queued. A browser that reads slowly simply
gets fewer snapshots (entrypoints/openai/web_ui.py sends the latest one at each tick).

Each event stream sends the full snapshot once, then deltas (`next_event` with the stream's
`StreamCursor`): nothing at all while nothing moved, else the gauges, the series' seconds from the
last one sent on, and the block map and request list only when they changed. A busy 16-stream
server then sends ~1 KB a second instead of ~40 KB, and the page redraws only what moved.
"""

from __future__ import annotations

import base64
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.core.kv_snapshot import KVBlockMap, build_kv_block_map
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.metrics.stats import IterationStats

WINDOW_S = 300
RECENT_FINISHED = 40


@dataclass
class _Second:
    """One second of the series."""

    t: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    ttfts: list[float] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


class ConsoleFeed:
    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        live_requests: Callable[[], list[dict[str, Any]]] | None = None,
        window_s: int = WINDOW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.static = {
            "model": model_name,
            "max_model_len": max_model_len,
            "block_size": block_size,
            "num_blocks": num_blocks,
        }
        self.live_requests = live_requests
        self.window_s = window_s
        self.clock = clock
        self.stats: SchedulerStats | None = None
        # Until the engine's first map arrives: the pool as it starts, every block free.
        self.kv_map: KVBlockMap = build_kv_block_map(num_blocks, {}, np.zeros(num_blocks, dtype=bool))
        self.series: deque[_Second] = deque(maxlen=window_s)
        self.finished: deque[dict[str, Any]] = deque(maxlen=RECENT_FINISHED)
        self.total_generation_tokens = 0
        self.version = 0  # bumped at every record; the event stream sends only when it moved

    def _second(self, now: float) -> _Second:
        t = int(now)
        if not self.series or self.series[-1].t != t:
            self.series.append(_Second(t))
        return self.series[-1]

    def record(self, stats: SchedulerStats | None, it: IterationStats | None) -> None:
        now = self.clock()
        sec = self._second(now)
        if stats is not None:
            self.stats = stats
            if stats.kv_block_map is not None:
                self.kv_map = stats.kv_block_map
            sec.running, sec.waiting, sec.kv_usage = stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage
        if it is not None:
            sec.prompt_tokens += it.num_prompt_tokens
            sec.generation_tokens += it.num_generation_tokens
            self.total_generation_tokens += it.num_generation_tokens
            sec.ttfts.extend(it.time_to_first_tokens)
            sec.finished += len(it.finished_requests)
            for f in it.finished_requests:
                self.finished.appendleft({
                    "id": f.request_id,
                    "state": f.finish_reason,
                    "prompt_tokens": f.num_prompt_tokens,
                    "output_tokens": f.num_generation_tokens,
                    "e2e_s": round(f.e2e_latency, 3),
                    "finished_at": round(now, 3),
                })
        self.version += 1

    def _series_out(self, now: float, since: int | None = None) -> list[list[float | None]]:
        """[t, prompt tok/s, generation tok/s, TTFT p50 (s) or None, running, waiting, kv usage] per
        second, oldest first, seconds with no batch filled with zeros (the engine was idle); the
        whole window, or only the seconds from `since` on."""
        start = int(now) - self.window_s + 1
        if since is not None:
            start = max(start, since)
        by_t = {s.t: s for s in self.series if s.t >= start}
        out: list[list[float | None]] = []
        # The gauges of the last second before `start` carry into its quiet seconds.
        last: _Second | None = next((s for s in reversed(self.series) if s.t < start), None)
        for t in range(start, int(now) + 1):
            s = by_t.get(t)
            if s is None:
                # Gauges hold their last value across a quiet second; rates are zero.
                g = last or _Second(t)
                out.append([t, 0, 0, None, g.running, g.waiting, round(g.kv_usage, 4)])
                continue
            last = s
            ttft = _median(s.ttfts)
            out.append([t, s.prompt_tokens, s.generation_tokens, None if ttft is None else round(ttft, 4),
                        s.running, s.waiting, round(s.kv_usage, 4)])
        return out

    def snapshot(self) -> dict[str, Any]:
        event = self.next_event(StreamCursor())  # a fresh cursor: the full snapshot
        assert event is not None
        return event

    def next_event(self, cur: StreamCursor) -> dict[str, Any] | None:
        """The full snapshot on a fresh cursor; then None while nothing was recorded since the last
        event, else a delta (`"delta": true`): every gauge, `series` holding only the seconds from
        the last one sent on (it may have grown since), `kv_map` and `requests` only if changed."""
        if cur.version == self.version:
            return None
        full = cur.version < 0
        now = self.clock()
        cur.version = self.version
        st = self.stats
        hit_rate = None
        if st is not None and st.prefix_cache_queries:
            hit_rate = st.prefix_cache_hits / st.prefix_cache_queries
        kv = self.kv_map
        recent_gen = sum(s.generation_tokens for s in self.series if s.t > now - 10)
        live = self.live_requests() if self.live_requests is not None else []
        requests = live + list(self.finished)
        series = self._series_out(now, None if full else cur.series_t)
        cur.series_t = int(now)
        event: dict[str, Any] = {
            **({"delta": True} if not full else self.static),
            "t": round(now, 3),
            "running": st.num_running_reqs if st else 0,
            "waiting": st.num_waiting_reqs if st else 0,
            "swapped": st.num_swapped_reqs if st else 0,
            "kv_usage": round(st.kv_cache_usage, 4) if st else 0.0,
            "preemptions": st.num_preemptions if st else 0,
            "prefix_cache_hit_rate": None if hit_rate is None or math.isnan(hit_rate) else round(hit_rate, 4),
            "generation_tok_s_10s": round(recent_gen / 10, 1),
            "total_generation_tokens": self.total_generation_tokens,
            "series": series,
        }
        if kv is not cur.kv_map:
            cur.kv_map = kv
            event["kv_map"] = {
                "num_blocks": kv.num_blocks,
                "blocks_per_cell": kv.blocks_per_cell,
                "cells": base64.b64encode(kv.cells).decode(),
            }
        if requests != cur.requests:
            cur.requests = requests
            event["requests"] = requests
        return event


@dataclass
class StreamCursor:
    """What one event stream has sent so far (ConsoleFeed.next_event); version -1: nothing yet."""

    version: int = -1
    series_t: int | None = None  # the last second sent (resent next time: it may have grown)
    kv_map: KVBlockMap | None = None
    requests: list[dict[str, Any]] | None = None
