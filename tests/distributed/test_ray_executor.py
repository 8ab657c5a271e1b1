"""TP=2 on a local Ray cluster (distributed_executor_backend="ray"): the ranks are Ray actors in a
placement group, and the greedy tokens equal TP=1's, json_schema requests included. One Ray start
for the module (slow on 2 cores)."""

from __future__ import annotations

import json
import time

import pytest

from tests.distributed.test_parallel_equivalence import generate, generate_constrained
from tests.utils import tiny_model

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_tp2_greedy_equals_tp1(local_ray):
    path, _ = tiny_model("qwen2")
    reference, _ = generate(path)
    tokens, cached = generate(path, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert all(c >= 32 for c in cached), cached
    assert tokens == reference
    # Dropping the engine removed its actors and placement group: the cluster's CPUs come back.
    deadline = time.monotonic() + 15
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2, ray.available_resources()


def test_ray_structured_outputs_tp2(local_ray):
    """json_schema requests through the Ray actors: the bitmask object reaches both sampling ranks."""
    path, _ = tiny_model("qwen3", vocab_size=49152, with_tokenizer=True)
    outs = generate_constrained(path, tensor_parallel_size=2, distributed_executor_backend="ray")
    for text, _ in (outs[1], outs[3]):
        json.loads(text)
    assert outs == generate_constrained(path)
