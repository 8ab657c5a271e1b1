"""`pagedllm rag ingest PATH...` and `pagedllm rag serve` (needs `pip install pagedllm[rag]`)."""

from __future__ import annotations

import argparse
import sys

from pagedllm.rag.pipeline import DEFAULT_EMBEDDING_MODEL


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default="rag_store", help="Qdrant local on-disk directory (default: ./rag_store)")
    p.add_argument("--qdrant-url", default=None, help="a Qdrant server instead of the local store")
    p.add_argument("--collection", default="documents")
    p.add_argument("--embedding-model", default=DEFAULT_EMBEDDING_MODEL)


def add_rag_parser(sub: argparse._SubParsersAction) -> None:
    rag = sub.add_parser("rag", help="the self-hosted RAG service: ingest documents, serve POST /rag")
    rsub = rag.add_subparsers(dest="rag_command", required=True)
    p = rsub.add_parser("ingest", help="chunk, embed and store documents (files or directories)")
    p.add_argument("paths", nargs="+")
    _store_args(p)
    p.add_argument("--chunk-size", type=int, default=800, help="characters per chunk at most")
    p.set_defaults(func=cmd_ingest)
    p = rsub.add_parser("serve", help="serve POST /rag")
    _store_args(p)
    p.add_argument("--reranker-model", default=None, help="a cross-encoder (*ForSequenceClassification); none: no rerank")
    p.add_argument("--generator-model", default=None, help="in-process generator (default: the embedded SmolLM2)")
    p.add_argument("--generator-url", default=None, help="an OpenAI-compatible server instead (its /v1 URL)")
    p.add_argument("--generator-served-model", default=None, help="model name on --generator-url")
    p.add_argument("--max-model-len", type=int, default=4096, help="of the in-process generator")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.set_defaults(func=cmd_serve)


def _open(args: argparse.Namespace):
    from pagedllm.rag.pipeline import Embedder
    from pagedllm.rag.store import ChunkStore

    return ChunkStore(args.store, args.qdrant_url, args.collection), Embedder(args.embedding_model)


def cmd_ingest(args: argparse.Namespace) -> int:
    from pagedllm.rag.pipeline import ingest

    store, embedder = _open(args)
    try:
        report = ingest(args.paths, store, embedder, chunk_size=args.chunk_size)
    finally:
        store.close()
    print(report.summary(), file=sys.stderr if report.failed else sys.stdout)
    return 1 if report.failed and not report.num_docs and not report.unchanged else 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedllm.rag.pipeline import Reranker, Retriever
    from pagedllm.rag.service import InProcessGenerator, OpenAIGenerator, RAGService, build_rag_app

    store, embedder = _open(args)
    if store.count() == 0:
        raise ValueError(f"the store {args.qdrant_url or args.store!r} holds no chunks: run `pagedllm rag ingest` first.")
    if args.generator_url:
        if not args.generator_served_model:
            raise ValueError("--generator-url needs --generator-served-model.")
        generator = OpenAIGenerator(args.generator_url, args.generator_served_model)
    else:
        generator = InProcessGenerator(args.generator_model, max_model_len=args.max_model_len)
    reranker = Reranker(args.reranker_model) if args.reranker_model else None
    app = build_rag_app(RAGService(Retriever(store, embedder), generator, reranker))
    uvicorn.run(app, host=args.host, port=args.port)
    return 0
