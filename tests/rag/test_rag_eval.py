"""The RAG service end to end on the CPU with the embedded models: a mixed English / Chinese corpus
(tests/rag/corpus, written for this, plus standard-library docstrings as distractors: >= 200 chunks)
ingested into Qdrant's local on-disk store; 30 questions with known source chunks: recall@5 of
dense-only, BM25-only and hybrid retrieval (hybrid >= 0.9); re-ingesting duplicates nothing; bad
files are reported and skipped; POST /rag with a cross-encoder reranker served by our engine (a tiny
random one: no real cross-encoder ships offline) and the embedded SmolLM2 as the generator."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.rag.stdlib_docs import write_stdlib_docs

HERE = Path(__file__).parent
CHUNK_SIZE = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rag-corpus")
    for f in (HERE / "corpus").iterdir():
        shutil.copy(f, d / f.name)
    write_stdlib_docs(d)
    (d / "broken.txt").write_bytes(b"\xff\xfe\x00 not utf-8 \xc3\x28")
    return d


@pytest.fixture(scope="module")
def rag(corpus, tmp_path_factory):
    from pagedllm.rag.pipeline import Embedder, ingest
    from pagedllm.rag.store import ChunkStore

    store = ChunkStore(tmp_path_factory.mktemp("rag-store") / "qdrant")
    embedder = Embedder(max_num_seqs=32)
    report = ingest([corpus, corpus / "missing.md", corpus / "slides.pdf"], store, embedder, chunk_size=CHUNK_SIZE,
                    show_progress=False)
    print(report.summary())
    yield store, embedder, report
    store.close()


def _expected(store, source: str, marker: str) -> tuple[str, int]:
    hits = [(p["source"], p["index"]) for p in (store.payload(i) for i in store._bm25_ids)
            if p["source"].endswith(source) and marker in p["text"]]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def test_ingest_reports_bad_files_and_does_not_duplicate(rag, corpus):
    from pagedllm.rag.pipeline import ingest

    store, embedder, report = rag
    assert report.num_chunks >= 200 and store.count() == report.num_chunks
    failed = {Path(p).name: why for p, why in report.failed}
    assert set(failed) == {"broken.txt", "missing.md", "slides.pdf"}
    assert "not UTF-8" in failed["broken.txt"] and "no such file" in failed["missing.md"]
    assert report.chunks_per_s > 0
    again = ingest([corpus], store, embedder, chunk_size=CHUNK_SIZE, show_progress=False)
    assert again.num_chunks == 0 and len(again.unchanged) == report.num_docs
    assert store.count() == report.num_chunks


def test_recall_at_5(rag):
    from pagedllm.rag.pipeline import Retriever

    store, embedder, _ = rag
    retriever = Retriever(store, embedder)
    store.bm25_search("warm up", 1)
    questions = json.loads((HERE / "questions.json").read_text())
    assert len(questions) == 30
    recall = {}
    for mode in ("dense", "bm25", "hybrid"):
        found = 0
        results = retriever.retrieve_many([q for q, _, _ in questions], 5, mode)
        for (_, source, marker), hits in zip(questions, results):
            found += _expected(store, source, marker) in [(h["source"], h["index"]) for h in hits]
        recall[mode] = found / len(questions)
    print("recall@5:", recall)
    assert recall["hybrid"] >= 0.9


def test_post_rag(rag, tmp_path_factory):
    from fastapi.testclient import TestClient

    from pagedllm.rag.pipeline import Reranker, Retriever
    from pagedllm.rag.service import InProcessGenerator, RAGService, build_rag_app
    from tests.utils import write_tiny_cross_encoder

    store, embedder, _ = rag
    # A tiny random cross-encoder with MiniLM's tokenizer, served by our engine (pooling runner).
    path = tmp_path_factory.mktemp("tiny-reranker")
    write_tiny_cross_encoder(path)
    class RecordingGenerator(InProcessGenerator):
        """The real in-process generator, keeping what its engine returned for each prompt."""

        calls: list[tuple[str, object]] = []

        def complete(self, prompt: str, temperature: float, max_tokens: int):
            out = super().complete(prompt, temperature, max_tokens)
            self.calls.append((prompt, out))
            return out

    generator = RecordingGenerator(max_model_len=2048)
    service = RAGService(Retriever(store, embedder), generator, Reranker(str(path), max_num_seqs=16))
    client = TestClient(build_rag_app(service))
    q, source, marker = "How many approvals does a merge request need?", "lumen_handbook_en.md", "two approvals"
    r = client.post("/rag", json={"question": q, "top_k": 5, "rerank_top_k": 5, "temperature": 0.0,
                                  "max_tokens": 12})
    assert r.status_code == 200, r.text
    body = r.json()
    # The answer is the engine's greedy output for a prompt holding the question and the reranked sources
    # in their order. Its text may be empty: the tiny random reranker's order (near-ties that move with
    # the machine's threads) decides the prompt, and SmolLM2 may end at once (EOS, finish_reason "stop");
    # otherwise it ran to the 12 tokens asked for.
    (prompt, out), = generator.calls
    assert body["answer"] == out.text
    assert out.finish_reason == "stop" or (out.finish_reason == "length" and len(out.token_ids) == 12), out
    assert q in prompt
    offsets = [prompt.index(s["text"]) for s in body["sources"]]
    assert offsets == sorted(offsets)
    assert len(body["sources"]) == 5
    assert all(set(s) >= {"text", "score"} and len(s["text"]) <= 200 for s in body["sources"])
    scores = [s["score"] for s in body["sources"]]
    assert scores == sorted(scores, reverse=True) and all(0.0 <= s <= 1.0 for s in scores)  # sigmoid, reranked
    want = _expected(store, source, marker)
    assert want in [(s["source"], s["chunk_index"]) for s in body["sources"]]
    assert client.post("/rag", json={"question": ""}).status_code == 422
