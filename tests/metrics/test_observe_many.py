"""observe_many: the same buckets and count as one observe() per value (bounds included), the same sum."""

from __future__ import annotations

import math
import random

from prometheus_client import CollectorRegistry, Histogram

from pagedllm.metrics.prometheus import ITL_BUCKETS, observe_many


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("le", "")): s.value for m in registry.collect() for s in m.samples
            if not s.name.endswith("_created")}


def test_observe_many_equals_one_observe_per_value():
    rng = random.Random(0)
    values = [0.0, 0.01, 0.025, 80.0, 1e9, -1.0] + [rng.expovariate(20) for _ in range(500)]
    values += list(ITL_BUCKETS)  # exactly on a bound: counted in that bound's bucket
    got = []
    for bulk in (False, True):
        r = CollectorRegistry()
        h = Histogram("itl", "d", ["model_name"], buckets=ITL_BUCKETS, registry=r).labels("m")
        if bulk:
            observe_many(h, values[:300])
            observe_many(h, values[300:])
            observe_many(h, [])
        else:
            for v in values:
                h.observe(v)
        got.append(_samples(r))
    one, many = got
    total = ("itl_sum", "")
    assert math.isclose(one.pop(total), many.pop(total), rel_tol=1e-12)
    assert one == many
    assert many[("itl_count", "")] == len(values)
    assert many[("itl_bucket", "0.01")] == sum(v <= 0.01 for v in values)  # cumulative, as exposed
