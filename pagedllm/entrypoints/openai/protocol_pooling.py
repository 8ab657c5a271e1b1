"""Request and response bodies of the pooling endpoints (vLLM's and OpenAI's shapes).

Requests are strict (JSON types must match) and refuse fields they do not know, naming them."""

from __future__ import annotations

import time
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.protocol import random_uuid

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class PoolingBaseRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, only logged
    truncate_prompt_tokens: int | None = None  # vLLM: -1 truncates to max_model_len


class EmbeddingRequest(PoolingBaseRequest):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # vLLM's extra field


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the model's pooler output as it is (an embedding, or token states)."""


class ClassificationRequest(PoolingBaseRequest):
    input: EmbeddingInput
    use_activation: bool | None = None


class ScoreRequest(PoolingBaseRequest):
    """vLLM's /v1/score: text_1 (one or N) against text_2 (N); queries / documents are accepted too."""

    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    use_activation: bool | None = None


class RerankDocument(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    text: str


class RerankRequest(PoolingBaseRequest):
    """vLLM's /rerank, Jina's and Cohere's bodies: a query, documents (strings or {"text": ...})."""

    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True
    use_activation: bool | None = None


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


DataT = TypeVar("DataT")


class _ListResponse(BaseModel, Generic[DataT]):
    """The body of /v1/embeddings, /pooling, /classify and /score: {id, object "list", created, model,
    data, usage}. Each response names its data type and its id's prefix (a subclass's `id` keeps this
    place in the JSON)."""

    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[DataT]
    usage: PoolingUsage


class EmbeddingData(BaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(_ListResponse[EmbeddingData]):
    id: str = Field(default_factory=lambda: f"embd-{random_uuid()}")


class PoolingData(BaseModel):
    index: int
    object: str = "pooling"
    data: Any  # a vector, or a list of vectors (token states), or base64


class PoolingResponse(_ListResponse[PoolingData]):
    id: str = Field(default_factory=lambda: f"pool-{random_uuid()}")


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(_ListResponse[ClassificationData]):
    id: str = Field(default_factory=lambda: f"classify-{random_uuid()}")


class ScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(_ListResponse[ScoreData]):
    id: str = Field(default_factory=lambda: f"score-{random_uuid()}")


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{random_uuid()}")
    model: str
    usage: RerankUsage
    results: list[RerankResult]
