"""TP=2 on a local Ray cluster (distributed_executor_backend="ray"): the ranks are Ray actors in a
placement group, and the greedy tokens equal TP=1's, json_schema requests included (one engine for
both). One Ray start for the module (slow on 2 cores)."""

from __future__ import annotations

import json
import time

import pytest

from tests.distributed.test_parallel_equivalence import generate
from tests.utils import tiny_model

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_tp2_greedy_and_structured_outputs_equal_tp1(local_ray):
    """The greedy batches, then json_schema requests (the bitmask object reaches both sampling ranks),
    on one Ray engine: TP=1's tokens and valid JSON."""
    path, _ = tiny_model("qwen3", vocab_size=49152, with_tokenizer=True)
    reference, _ = generate(path, constrained=True)
    tokens, cached = generate(path, constrained=True, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert all(c >= 32 for c in cached), cached
    constrained = tokens[6:]
    for text, _ in (constrained[1], constrained[3]):
        json.loads(text)
    assert tokens == reference
    # Dropping the engine removed its actors and placement group: the cluster's CPUs come back.
    deadline = time.monotonic() + 15
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2, ray.available_resources()
