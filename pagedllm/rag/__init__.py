"""The self-hosted RAG service of the seed article (§6), on pagedllm's own engines (`pagedllm[rag]`):

    pagedllm rag ingest PATH...   files -> chunks -> embeddings (our pooling runner) -> Qdrant (local
                                  on-disk by default, a server with --qdrant-url); BM25 reads the same
    pagedllm rag serve            FastAPI POST /rag: dense + BM25 fused by reciprocal rank fusion,
                                  reranked by a cross-encoder our engine serves, answered by the
                                  generation engine (in-process, or any OpenAI-compatible URL)
"""
