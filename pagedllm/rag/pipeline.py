"""The RAG pipeline: embed (our pooling runner), retrieve (dense + BM25, reciprocal rank fusion),
rerank (a cross-encoder our engine serves), answer (the generation engine), as the seed's §6 does.

Reciprocal rank fusion (Cormack et al.): a chunk's fused score is sum over the lists it appears in
of 1 / (k + rank), rank from 1, k = 60; dense ranks by cosine, BM25 by its score.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pagedllm.rag.chunking import TEXT_SUFFIXES, chunk_document, content_hash, document_id, read_document
from pagedllm.rag.store import ChunkStore

RRF_K = 60
DEFAULT_EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
PROMPT = "基于以下文档回答问题。\n\n文档：\n{context}\n\n问题：{question}\n\n回答："  # the seed's prompt


class Embedder:
    """Texts -> normalized vectors through LLM(runner="pooling"); prompts over the model's limit are
    truncated there (truncate_prompt_tokens=-1), as sentence-transformers does."""

    def __init__(self, model: str = DEFAULT_EMBEDDING_MODEL, **engine_kwargs: Any) -> None:
        from pagedllm import LLM

        self.llm = LLM(model, runner="pooling", **engine_kwargs)

    @property
    def dim(self) -> int:
        return len(self.embed(["dimension probe"])[0])

    def embed(self, texts: list[str]) -> list[list[float]]:
        return [o.outputs.embedding for o in self.llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)]


class Reranker:
    """A cross-encoder (*ForSequenceClassification) served by our engine: LLM.score."""

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        from pagedllm import LLM

        self.llm = LLM(model, runner="pooling", **engine_kwargs)

    def score(self, question: str, texts: list[str]) -> list[float]:
        outs = self.llm.score(question, texts, truncate_prompt_tokens=-1, use_tqdm=False)
        return [o.outputs.score for o in outs]


@dataclass
class IngestReport:
    num_docs: int = 0
    num_chunks: int = 0
    unchanged: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    seconds: float = 0.0

    @property
    def chunks_per_s(self) -> float:
        return self.num_chunks / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        lines = [f"ingested {self.num_chunks} chunks from {self.num_docs} documents in {self.seconds:.1f} s "
                 f"({self.chunks_per_s:.1f} chunks/s); {len(self.unchanged)} unchanged, {len(self.failed)} failed"]
        lines += [f"  skipped: {why}" for _, why in self.failed]
        return "\n".join(lines)


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Files as given; directories walked for text documents (sorted, so runs are reproducible)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        else:
            out.append(p)
    return out


def ingest(paths: Iterable[str | Path], store: ChunkStore, embedder: Embedder, chunk_size: int = 800,
           show_progress: bool = True) -> IngestReport:
    """Chunk, embed and store every document; a bad file is reported and skipped, the rest go in."""
    report = IngestReport()
    t0 = time.perf_counter()
    files = expand_paths(paths)
    store.ensure_collection(embedder.dim)
    for path in tqdm(files, desc="Documents", disable=not show_progress, dynamic_ncols=True):
        try:
            if not path.is_file():
                raise ValueError(f"{path}: no such file")
            text = read_document(path)
            doc, digest = document_id(path), content_hash(text)
            if store.doc_hash(doc) == digest:
                report.unchanged.append(str(path))
                continue
            chunks = chunk_document(path, text, chunk_size)
            vectors = embedder.embed([c.text for c in chunks])
            store.replace_document(doc, digest, chunks, vectors)
        except (ValueError, OSError) as e:
            report.failed.append((str(path), str(e)))
            continue
        report.num_docs += 1
        report.num_chunks += len(chunks)
    report.seconds = time.perf_counter() - t0
    return report


def rrf(rankings: list[list[str]], k: int = RRF_K) -> list[tuple[str, float]]:
    """[["a", "b"], ["b", "c"]] -> [("b", 1/62 + 1/61), ("a", 1/61), ("c", 1/62)]"""
    scores: dict[str, float] = {}
    for ranking in rankings:
        for rank, cid in enumerate(ranking, start=1):
            scores[cid] = scores.get(cid, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda kv: -kv[1])


class Retriever:
    def __init__(self, store: ChunkStore, embedder: Embedder, candidates: int = 50) -> None:
        self.store = store
        self.embedder = embedder
        self.candidates = candidates  # per list, before fusion

    def retrieve(self, question: str, top_k: int, mode: str = "hybrid") -> list[dict[str, Any]]:
        """mode: "dense", "bm25" or "hybrid". Each hit: id, text, source, index, score."""
        return self.retrieve_many([question], top_k, mode)[0]

    def retrieve_many(self, questions: list[str], top_k: int, mode: str = "hybrid") -> list[list[dict[str, Any]]]:
        """`retrieve` for several questions, their embeddings in one engine call."""
        if mode not in ("dense", "bm25", "hybrid"):
            raise ValueError(f"mode must be dense, bm25 or hybrid, got {mode!r}.")
        vectors = self.embedder.embed(questions) if mode != "bm25" else [None] * len(questions)
        return [self._retrieve(q, v, top_k, mode) for q, v in zip(questions, vectors)]

    def _retrieve(self, question: str, vector: list[float] | None, top_k: int, mode: str) -> list[dict[str, Any]]:
        n = max(top_k, self.candidates)
        dense = self.store.dense_search(vector, n) if vector is not None else []
        sparse = self.store.bm25_search(question, n) if mode != "dense" else []
        if mode == "dense":
            ranked = dense
        elif mode == "bm25":
            ranked = sparse
        else:
            ranked = rrf([[c for c, _ in dense], [c for c, _ in sparse]])
        hits = []
        for cid, score in ranked[:top_k]:
            p = self.store.payload(cid)
            hits.append({"id": cid, "text": p["text"], "source": p["source"], "index": p["index"], "score": score})
        return hits
