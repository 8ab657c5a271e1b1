"""Seeded odd calls of the offline pooling API (fuzz_offline.py) on all-MiniLM-L6-v2 and on a tiny
random one-label cross-encoder (MiniLM's tokenizer): each is refused with ValueError / TypeError
naming what it set, or answered with well-formed outputs; every KV block is back in the pool after
each, and a good call works at the end.

    FUZZ_CASES=3000 FUZZ_SEED=7 pytest tests/reliability/test_fuzz_offline.py
"""

from __future__ import annotations

import os

import pytest

from tests.reliability.fuzz_offline import OfflinePoolingFuzzer, run_offline_pooling_case
from tests.utils import assert_pool_idle

CASES = int(os.environ.get("FUZZ_CASES", "200"))
SEED = int(os.environ.get("FUZZ_SEED", "0"))


@pytest.fixture(scope="module")
def embedder():
    from pagedllm import LLM

    return LLM("sentence-transformers/all-MiniLM-L6-v2", max_num_seqs=8)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    from pagedllm import LLM
    from tests.utils import write_tiny_cross_encoder

    path = tmp_path_factory.mktemp("tiny-cross-encoder")
    write_tiny_cross_encoder(path)
    return LLM(str(path), max_num_seqs=8)


@pytest.mark.parametrize("which", ["embedder", "cross_encoder"])
def test_offline_pooling_fuzz(request, which):
    llm = request.getfixturevalue(which)
    task = "embed" if which == "embedder" else "classify"
    failures = []
    for case in OfflinePoolingFuzzer(SEED, vocab_size=30522, dims=384, task=task).cases(CASES):
        problems = run_offline_pooling_case(llm, case)
        assert_pool_idle(llm)
        if problems:
            failures.append((case, problems))
    assert not failures, "\n".join(f"{c}\n    {p}" for c, p in failures[:10])
    texts = ["a query", "a document"]
    if task == "embed":
        assert len(llm.embed(texts, use_tqdm=False)[1].outputs.embedding) == 384
    assert len(llm.score(texts[0], texts[1:], use_tqdm=False)) == 1
