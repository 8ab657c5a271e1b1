"""Measured launch tables of the weight-shape-keyed kernels (kernels/wna16_mma_config.py,
wna16_wgmma_config.py): the JSON file form a sweep script writes and a PAGEDLLM_*_TABLE variable reads,
and the pick of a row count's bucket.

Form: {"N,K": [[max_rows, [field, ...] or null], ...]} -> {(N, K): ((max_rows, Config(...) or None), ...)},
buckets sorted by max rows; a call of m rows takes the first bucket with m <= max_rows, None past the last.
Example: {"64,256": [[64, null], [32, [16, 64, 2, 4, 2]]]} -> {(64, 256): ((32, Config(16, 64, 2, 4, 2)), (64, None))}.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

__all__ = ["pick_bucket", "read_launch_table"]

C = TypeVar("C")


def read_launch_table(path: str, config: type[C], variable: str) -> dict[tuple[int, int], tuple[tuple[int, C | None], ...]]:
    """The table in `path` as `config` tuples; a malformed file is a ValueError naming `variable` and the file."""
    try:
        with open(path) as f:
            raw = json.load(f)
        return {
            tuple(int(v) for v in key.split(",")): tuple(
                (int(mx), None if c is None else config(*(int(v) for v in c)))
                for mx, c in sorted(buckets, key=lambda b: b[0]))
            for key, buckets in raw.items()
        }
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{variable}={path}: not a table of {config.__name__} launches ({e})") from None


def pick_bucket(buckets: tuple[tuple[int, Any], ...], m: int) -> Any:
    """The config of the first bucket holding m rows, None past the last."""
    for max_m, cfg in buckets:
        if m <= max_m:
            return cfg
    return None
