"""The pooling endpoints on the app: /v1/embeddings, /pooling, /classify, /v1/score, /score,
/rerank, /v1/rerank, /v2/rerank. Registered on every server; on a runner="generate" engine each
answers 400 naming the runner that serves it (and chat / completions do the same on a pooling one)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.http_io import cancel_on_disconnect, read_request
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScores


def add_pooling_routes(
    app: FastAPI, engine: Any, models: Any, max_body: int, limits: ServerLimits, **serving_kwargs: Any
) -> None:
    serving = OpenAIServingScores(engine, models, limits=limits, **serving_kwargs)

    def route(path: str, model_cls: type, method: Callable[..., Any]) -> None:
        async def handler(raw: Request) -> Response:
            arrival = time.time()
            # Bounded parsing, off the loop for large bodies, with the server's count limits (http_io.py).
            request = await read_request(raw, model_cls, max_body, limits)
            result = await cancel_on_disconnect(raw, method(request, arrival))
            if result is None:
                return Response(status_code=499)  # the client left
            return JSONResponse(result.model_dump())

        app.add_api_route(path, handler, methods=["POST"])

    route("/v1/embeddings", EmbeddingRequest, serving.create_embedding)
    route("/pooling", PoolingRequest, serving.create_pooling)
    route("/classify", ClassificationRequest, serving.create_classify)
    for path in ("/score", "/v1/score"):
        route(path, ScoreRequest, serving.create_score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        route(path, RerankRequest, serving.create_rerank)
