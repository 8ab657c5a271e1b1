"""Where chunks live: one Qdrant collection (vectors + payload), and a BM25 index over the same
chunks' text (rank-bm25; jieba cuts Chinese into words, English is lower-cased words).

Qdrant runs in its local on-disk mode (`QdrantClient(path=...)`) by default, or against a server
(`url`). Each point's payload: text, source, doc_id, doc_hash, index. Re-ingesting a document whose
text is unchanged (same doc_hash) does nothing; a changed one has its old points deleted first.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pagedllm.rag.chunking import Chunk

COLLECTION = "documents"
_WORD = re.compile(r"[a-z0-9_]+|[\u4e00-\u9fff]+")


def bm25_tokens(text: str) -> list[str]:
    """"Paged KV 缓存管理" -> ["paged", "kv", "缓存", "管理"]: words, Chinese cut by jieba."""
    import jieba

    out: list[str] = []
    for m in _WORD.findall(text.lower()):
        if "\u4e00" <= m[0] <= "\u9fff":
            out.extend(w for w in jieba.lcut_for_search(m) if w.strip())
        else:
            out.append(m)
    return out


class ChunkStore:
    def __init__(self, path: str | Path | None = None, url: str | None = None, collection: str = COLLECTION) -> None:
        from qdrant_client import QdrantClient

        if url is not None:
            self.client = QdrantClient(url=url)
        else:
            Path(path or "rag_store").mkdir(parents=True, exist_ok=True)
            self.client = QdrantClient(path=str(path or "rag_store"))
        self.collection = collection
        self._bm25: Any = None
        self._bm25_ids: list[str] = []
        self._payloads: dict[str, dict[str, Any]] = {}

    def ensure_collection(self, dim: int) -> None:
        from qdrant_client import models

        if not self.client.collection_exists(self.collection):
            self.client.create_collection(self.collection, vectors_config=models.VectorParams(
                size=dim, distance=models.Distance.COSINE))

    def doc_hash(self, doc_id: str) -> str | None:
        """The stored content hash of a document, None if it is not stored."""
        from qdrant_client import models

        if not self.client.collection_exists(self.collection):
            return None
        points, _ = self.client.scroll(self.collection, limit=1, with_payload=True, scroll_filter=models.Filter(
            must=[models.FieldCondition(key="doc_id", match=models.MatchValue(value=doc_id))]))
        return points[0].payload.get("doc_hash") if points else None

    def replace_document(self, doc_id: str, doc_hash: str, chunks: list[Chunk], vectors: list[list[float]]) -> None:
        from qdrant_client import models

        self.client.delete(self.collection, points_selector=models.FilterSelector(filter=models.Filter(
            must=[models.FieldCondition(key="doc_id", match=models.MatchValue(value=doc_id))])))
        self.client.upsert(self.collection, points=[
            models.PointStruct(id=c.id, vector=v, payload={"text": c.text, "source": c.source, "doc_id": c.doc_id,
                                                           "doc_hash": doc_hash, "index": c.index})
            for c, v in zip(chunks, vectors)])
        self._bm25 = None

    def count(self) -> int:
        if not self.client.collection_exists(self.collection):
            return 0
        return self.client.count(self.collection).count

    def dense_search(self, vector: list[float], limit: int) -> list[tuple[str, float]]:
        hits = self.client.query_points(self.collection, query=vector, limit=limit, with_payload=True).points
        for h in hits:
            self._payloads[str(h.id)] = h.payload
        return [(str(h.id), float(h.score)) for h in hits]

    def bm25_search(self, query: str, limit: int) -> list[tuple[str, float]]:
        if self._bm25 is None:
            self._build_bm25()
        if not self._bm25_ids:
            return []
        scores = self._bm25.get_scores(bm25_tokens(query))
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:limit]
        return [(self._bm25_ids[i], float(scores[i])) for i in order if scores[i] > 0]

    def _build_bm25(self) -> None:
        from rank_bm25 import BM25Okapi

        ids, corpus, offset = [], [], None
        while True:
            points, offset = self.client.scroll(self.collection, limit=1000, offset=offset, with_payload=True)
            for p in points:
                ids.append(str(p.id))
                self._payloads[str(p.id)] = p.payload
                corpus.append(bm25_tokens(p.payload["text"]))
            if offset is None:
                break
        self._bm25_ids = ids
        self._bm25 = BM25Okapi(corpus) if corpus else None

    def payload(self, point_id: str) -> dict[str, Any]:
        if point_id not in self._payloads:
            (p,) = self.client.retrieve(self.collection, ids=[point_id], with_payload=True)
            self._payloads[point_id] = p.payload
        return self._payloads[point_id]

    def close(self) -> None:
        self.client.close()
