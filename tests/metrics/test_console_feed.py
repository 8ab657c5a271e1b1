"""The web console's feed (metrics/console_feed.py): gauges, per-second series and recent requests,
driven like AsyncLLM drives its stat loggers, on a fake clock."""

from __future__ import annotations

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.metrics.console_feed import ConsoleFeed
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def stats(running: int, waiting: int, usage: float) -> SchedulerStats:
    return SchedulerStats(running, waiting, usage, num_preemptions=1, prefix_cache_queries=100, prefix_cache_hits=25)


def test_series_gauges_and_recent_requests():
    clock = Clock()
    live = [{"id": "r2", "state": "running", "prompt_tokens": 5, "output_tokens": 3, "age_s": 0.5}]
    feed = ConsoleFeed("m", 2048, 16, 100, live_requests=lambda: live, window_s=10, clock=clock)
    snap = feed.snapshot()
    assert snap["kv_map"]["num_blocks"] == 100 and snap["running"] == 0  # before any stats: an idle pool
    feed.record(stats(2, 1, 0.25), IterationStats(num_prompt_tokens=40, num_generation_tokens=2,
                                                  time_to_first_tokens=[0.1, 0.3]))
    clock.t += 0.5
    feed.record(stats(2, 0, 0.30), IterationStats(num_generation_tokens=2))
    clock.t += 2.0  # a quiet second, then one more batch with a finished request
    feed.record(stats(1, 0, 0.1), IterationStats(
        num_generation_tokens=1, finished_requests=[FinishedRequestStats("stop", 1.5, 4, num_prompt_tokens=40, request_id="r1")]))
    snap = feed.snapshot()
    assert (snap["running"], snap["waiting"], snap["kv_usage"], snap["preemptions"]) == (1, 0, 0.1, 1)
    assert snap["prefix_cache_hit_rate"] == 0.25 and snap["total_generation_tokens"] == 5
    series = snap["series"]
    assert len(series) == 10 and [p[0] for p in series] == list(range(993, 1003))
    by_t = {p[0]: p for p in series}
    assert by_t[1000][1:4] == [40, 4, 0.2]  # prompt tok, generation tok, TTFT p50 of that second
    assert by_t[1001][1:3] == [0, 0] and by_t[1001][4] == 2  # quiet: no rates, gauges held
    assert by_t[1002][2] == 1
    assert snap["requests"][0] == live[0]
    assert snap["requests"][1] == {"id": "r1", "state": "stop", "prompt_tokens": 40, "output_tokens": 4,
                                   "e2e_s": 1.5, "finished_at": 1002.5}


def test_event_stream_deltas():
    """A stream's first event is the full snapshot; then nothing while nothing moved, and deltas that
    carry the block map and request list only when they changed, and only the new seconds."""
    import numpy as np

    from pagedllm.core.kv_snapshot import build_kv_block_map
    from pagedllm.metrics.console_feed import StreamCursor

    clock = Clock()
    feed = ConsoleFeed("m", 2048, 16, 8, window_s=10, clock=clock)
    cur = StreamCursor()
    first = feed.next_event(cur)
    assert first is not None and "delta" not in first and first["model"] == "m"
    assert len(first["series"]) == 10 and "kv_map" in first and first["requests"] == []
    assert feed.next_event(cur) is None  # nothing recorded since
    clock.t += 3.0
    kv_map = build_kv_block_map(8, {}, np.zeros(8, dtype=bool))
    s = stats(2, 0, 0.5)
    s.kv_block_map = kv_map
    feed.record(s, IterationStats(num_generation_tokens=2))
    d = feed.next_event(cur)
    assert d["delta"] is True and "model" not in d and d["running"] == 2
    assert [p[0] for p in d["series"]] == [1000, 1001, 1002, 1003]  # from the last second sent on
    assert d["series"][-1][2] == 2 and d["kv_map"]["num_blocks"] == 8 and "requests" not in d
    feed.record(stats(1, 0, 0.2), IterationStats(num_generation_tokens=1))  # same second, no new map
    d = feed.next_event(cur)
    assert [p[0] for p in d["series"]] == [1003] and d["series"][0][2] == 3 and "kv_map" not in d
    assert feed.snapshot()["kv_map"]["num_blocks"] == 8  # a new stream still gets everything
