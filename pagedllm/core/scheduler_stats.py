"""What the scheduler reports each step (`SchedulerStats`) and when its stats carry a picture of the
KV pool for the web console (`KVSnapshotClock`: at most every `kv_snapshot_interval_s`, and always
once when the engine goes idle)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_snapshot import KVBlockMap, build_kv_block_map


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, tokens
    prefix_cache_hits: int  # cumulative, tokens
    # The pool's picture for the web console, at most every `kv_snapshot_interval_s` (else None).
    kv_block_map: KVBlockMap | None = None
    num_swapped_reqs: int = 0  # waiting requests whose KV sits in the CPU swap pool


class KVSnapshotClock:
    """Decides, step by step, whether the stats carry a KVBlockMap (building one walks every block)."""

    def __init__(self) -> None:
        self._next_kv_snapshot = 0.0
        self._idle_kv_snapshot_sent = False

    def maybe_kv_block_map(self, kv: KVCacheManager, interval: float, idle: bool) -> KVBlockMap | None:
        """`idle`: the scheduler holds no request."""
        if interval <= 0:
            return None
        now = time.monotonic()
        # The stats of the step that emptied the engine always carry a map, so the last picture
        # shown is the idle pool, not one from up to `interval` earlier.
        if now < self._next_kv_snapshot and not (idle and not self._idle_kv_snapshot_sent):
            return None
        self._idle_kv_snapshot_sent = idle
        self._next_kv_snapshot = now + interval
        return build_kv_block_map(kv.num_blocks, kv.req_to_blocks, kv.block_pool.cached_mask)
