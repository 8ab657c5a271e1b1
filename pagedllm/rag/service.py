"""FastAPI POST /rag with the seed's request (question, top_k, rerank_top_k, temperature,
max_tokens) and response (answer, sources with text and score), plus each source's file.

The engines are synchronous objects: requests run one at a time in a worker thread (a lock), so the
event loop stays free for /health while one answers.
"""

from __future__ import annotations

import threading
from typing import Any

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from pagedllm.rag.pipeline import PROMPT, Reranker, Retriever


class RAGQuery(BaseModel):
    question: str = Field(min_length=1)
    top_k: int = Field(10, ge=1, le=200)
    rerank_top_k: int = Field(5, ge=1, le=200)
    temperature: float = Field(0.3, ge=0.0, le=2.0)
    max_tokens: int = Field(1024, ge=1)


class InProcessGenerator:
    """The generation engine in this process: LLM.chat on the prompt (the embedded SmolLM2 by default)."""

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        from pagedllm import LLM

        self.llm = LLM(model, **engine_kwargs)

    def complete(self, prompt: str, temperature: float, max_tokens: int) -> Any:
        """The engine's CompletionOutput for `prompt` as the user's message (text, token ids, finish reason)."""
        from pagedllm import SamplingParams

        params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
        return self.llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0].outputs[0]

    def generate(self, prompt: str, temperature: float, max_tokens: int) -> str:
        return self.complete(prompt, temperature, max_tokens).text


class OpenAIGenerator:
    """Any OpenAI-compatible server (a `pagedllm serve`, vLLM, ...): chat.completions."""

    def __init__(self, base_url: str, model: str, api_key: str = "EMPTY") -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key=api_key)
        self.model = model

    def generate(self, prompt: str, temperature: float, max_tokens: int) -> str:
        r = self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": prompt}],
                                                temperature=temperature, max_tokens=max_tokens)
        return r.choices[0].message.content or ""


class RAGService:
    def __init__(self, retriever: Retriever, generator: Any, reranker: Reranker | None = None) -> None:
        self.retriever = retriever
        self.generator = generator
        self.reranker = reranker
        self._lock = threading.Lock()

    def answer(self, req: RAGQuery) -> dict[str, Any]:
        with self._lock:
            retrieved = self.retriever.retrieve(req.question, req.top_k)
            if self.reranker is not None and retrieved:
                scores = self.reranker.score(req.question, [d["text"] for d in retrieved])
                ranked = sorted(zip(scores, retrieved), key=lambda x: -x[0])
                docs = [{**d, "rerank_score": float(s)} for s, d in ranked[: req.rerank_top_k]]
            else:
                docs = retrieved[: req.rerank_top_k]
            context = "\n\n".join(f"[文档{i + 1}] {d['text']}" for i, d in enumerate(docs))
            answer = self.generator.generate(PROMPT.format(context=context, question=req.question),
                                             req.temperature, req.max_tokens)
        return {
            "answer": answer,
            "sources": [{"text": d["text"][:200], "score": d.get("rerank_score", d["score"]), "source": d["source"],
                         "chunk_index": d["index"]} for d in docs],
        }


def build_rag_app(service: RAGService) -> FastAPI:
    app = FastAPI(title="Self-hosted RAG with pagedllm")

    @app.post("/rag")
    async def rag_query(req: RAGQuery) -> dict[str, Any]:
        return await run_in_threadpool(service.answer, req)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
