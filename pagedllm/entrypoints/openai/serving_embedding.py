"""/v1/embeddings (OpenAI), /pooling and /classify (vLLM) on a runner="pooling" engine.

Every input of a request becomes one engine request; they run in the same steps as everyone
else's. A request for the wrong kind of model gets a 400 naming the runner that serves it.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import torch

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import random_uuid
from pagedllm.entrypoints.openai.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.pooling.outputs import PoolingRequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.processing import wrong_runner_message


def check_generate_runner(engine: Any) -> None:
    """Chat / completions on a pooling server: 400 naming the runner (called by api_server)."""
    if engine.model_config.runner_type == "pooling":
        raise APIError(wrong_runner_message(engine.config, False), param="model")


def encode_vector(x: torch.Tensor, encoding_format: str) -> list[float] | str:
    """float: a JSON list; base64: the float32 little-endian bytes (what the openai client decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(x.numpy().astype("<f4").tobytes()).decode()
    return x.tolist()


def input_to_prompts(value: Any) -> list[dict[str, Any]]:
    """"text" | ["a", "b"] | [1, 2, 3] | [[1, 2], [3]] -> one engine prompt each."""
    if isinstance(value, str):
        return [{"prompt": value}]
    if not value:
        raise APIError("input must not be empty.", param="input")
    if all(isinstance(v, str) for v in value):
        return [{"prompt": v} for v in value]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [{"prompt_token_ids": list(value)}]
    if all(isinstance(v, list) for v in value):
        for v in value:
            if not v:
                raise APIError("input holds an empty token list.", param="input")
        return [{"prompt_token_ids": list(v)} for v in value]
    raise APIError("input must be a string, a list of strings, a list of token ids or a list of them.",
                   param="input")


class OpenAIServingPooling(OpenAIServing):
    def check_pooling(self, request: Any, task: str | None = None) -> str:
        """The model name to answer with; 400 when this engine does not pool (or not this task)."""
        self.check_engine()
        name = self.models.resolve(request.model)
        mc = self.engine.model_config
        if mc.runner_type != "pooling":
            raise APIError(wrong_runner_message(self.engine.config, True), param="model")
        if task == "embed" and mc.pooler_config.task != "embed":
            raise APIError(f"The model {name!r} is a classifier (cross-encoder): it serves /v1/score, /rerank and "
                           "/classify, not embeddings.", param="model")
        if task == "classify" and mc.pooler_config.task != "classify":
            raise APIError(f"The model {name!r} embeds; /classify needs a *ForSequenceClassification model.",
                           param="model")
        return name

    async def run_pooling(self, prefix: str, prompts: list[dict[str, Any]], params: PoolingParams,
                          arrival: float, param: str = "input") -> list[PoolingRequestOutput]:
        """Queue every prompt, then wait for all; a refused one aborts those queued before it."""
        request_id = f"{prefix}-{random_uuid()}"
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.add_request(f"{request_id}-{i}", prompt, params, arrival, param))

            async def last(stream: Any) -> PoolingRequestOutput:
                result = None
                async for out in stream:
                    result = out
                assert result is not None
                return result

            return list(await asyncio.gather(*(last(s) for s in streams)))
        finally:
            for s in streams:
                s.abort()

    @staticmethod
    def usage(outputs: list[PoolingRequestOutput]) -> PoolingUsage:  # type: ignore[override]
        n = sum(len(o.prompt_token_ids) for o in outputs)
        return PoolingUsage(prompt_tokens=n, total_tokens=n)

    def pooling_params(self, request: Any, **fields: Any) -> PoolingParams:
        try:
            return PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens, **fields)
        except ValueError as e:
            first = str(e).split(" ", 1)[0]
            raise APIError(str(e), param=first if first in type(request).model_fields else None) from None

    # -- endpoints ---------------------------------------------------------------------------------
    async def create_embedding(self, request: EmbeddingRequest, arrival: float) -> EmbeddingResponse:
        name = self.check_pooling(request, "embed")
        prompts = input_to_prompts(request.input)
        params = self.pooling_params(request, task="embed", dimensions=request.dimensions,
                                     normalize=request.normalize)

        async def work() -> EmbeddingResponse:
            outs = await self.run_pooling("embd", prompts, params, arrival)
            data = [EmbeddingData(index=i, embedding=encode_vector(o.outputs.data, request.encoding_format))
                    for i, o in enumerate(outs)]
            return EmbeddingResponse(model=name, data=data, usage=self.usage(outs))

        return await self.run_admitted(len(prompts), work)

    async def create_pooling(self, request: PoolingRequest, arrival: float) -> PoolingResponse:
        name = self.check_pooling(request)
        prompts = input_to_prompts(request.input)
        params = self.pooling_params(request, task="encode", dimensions=request.dimensions,
                                     normalize=request.normalize)

        async def work() -> PoolingResponse:
            outs = await self.run_pooling("pool", prompts, params, arrival)
            data = [PoolingData(index=i, data=encode_vector(o.outputs.data, request.encoding_format))
                    for i, o in enumerate(outs)]
            return PoolingResponse(model=name, data=data, usage=self.usage(outs))

        return await self.run_admitted(len(prompts), work)

    async def create_classify(self, request: ClassificationRequest, arrival: float) -> ClassificationResponse:
        name = self.check_pooling(request, "classify")
        prompts = input_to_prompts(request.input)
        params = self.pooling_params(request, task="classify", use_activation=request.use_activation)
        id2label = getattr(self.engine.model_config.hf_config, "id2label", None) or {}

        async def work() -> ClassificationResponse:
            outs = await self.run_pooling("classify", prompts, params, arrival)
            data = []
            for i, o in enumerate(outs):
                probs = o.outputs.data.reshape(-1).tolist()
                best = int(np.argmax(probs))
                data.append(ClassificationData(index=i, label=id2label.get(best, str(best)), probs=probs,
                                               num_classes=len(probs)))
            return ClassificationResponse(model=name, data=data, usage=self.usage(outs))

        return await self.run_admitted(len(prompts), work)

