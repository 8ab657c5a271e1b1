"""/v1/score (vLLM) and /rerank, /v1/rerank, /v2/rerank (vLLM's, Jina's and Cohere's bodies).

A cross-encoder scores each (query, document) pair as one prompt through its head; an embedding
model scores the cosine of the two embeddings (pooling/score.py), as vLLM does.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol_pooling import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingPooling
from pagedllm.pooling.score import PairsError, cosine_scores, cross_encoder_prompt, make_pairs


class OpenAIServingScores(OpenAIServingPooling):
    async def score_pairs(self, prefix: str, request: Any, pairs: list[tuple[str, str]],
                          arrival: float) -> tuple[list[float], int]:
        """(one score per pair, prompt tokens used)."""
        mc = self.engine.model_config
        if mc.pooler_config.task == "classify":
            tok = self.require_tokenizer()
            try:
                prompts = [await self.engine.run_in_tokenizer_pool(
                    cross_encoder_prompt, tok, a, b, request.truncate_prompt_tokens, mc.max_model_len)
                    for a, b in pairs]
            except ValueError as e:
                raise APIError(str(e), param="truncate_prompt_tokens") from None
            params = self.pooling_params(request, task="score", use_activation=request.use_activation)
            outs = await self.run_pooling(prefix, prompts, params, arrival, param="documents")
            if any(o.outputs.data.numel() != 1 for o in outs):
                raise APIError(f"scoring needs a model with one label; this one has {outs[0].outputs.data.numel()}.")
            return [float(o.outputs.data.reshape(-1)[0]) for o in outs], self.usage(outs).prompt_tokens
        if request.use_activation is not None:
            raise APIError("use_activation applies to cross-encoders; this model scores by cosine similarity.",
                           param="use_activation")
        texts = [t for pair in pairs for t in pair]
        params = self.pooling_params(request, task="embed")
        outs = await self.run_pooling(prefix, [{"prompt": t} for t in texts], params, arrival, param="documents")
        scores = cosine_scores([o.outputs.data for o in outs[0::2]], [o.outputs.data for o in outs[1::2]])
        return scores, self.usage(outs).prompt_tokens

    async def create_score(self, request: ScoreRequest, arrival: float) -> ScoreResponse:
        name = self.check_pooling(request)
        left_name = "text_1" if request.text_1 is not None else "queries"
        right_name = "text_2" if request.text_2 is not None else "documents"
        left, right = getattr(request, left_name), getattr(request, right_name)
        if left is None or right is None:
            raise APIError("give text_1 and text_2 (or queries and documents).",
                           param=left_name if left is None else right_name)
        try:
            pairs = make_pairs(left, right, (left_name, right_name))  # errors name the fields the request used
        except PairsError as e:
            raise APIError(str(e), param=e.name) from None

        async def work() -> ScoreResponse:
            scores, n = await self.score_pairs("score", request, pairs, arrival)
            return ScoreResponse(model=name, data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                                 usage=self._usage(n))

        return await self.run_admitted(len(pairs), work)

    async def create_rerank(self, request: RerankRequest, arrival: float) -> RerankResponse:
        name = self.check_pooling(request)
        docs = [d if isinstance(d, str) else d.text for d in request.documents]
        if not docs:
            raise APIError("documents must not be empty.", param="documents")
        if request.top_n is not None and request.top_n < 1:
            raise APIError(f"top_n must be >= 1, got {request.top_n}.", param="top_n")
        pairs = [(request.query, d) for d in docs]

        async def work() -> RerankResponse:
            scores, n = await self.score_pairs("rerank", request, pairs, arrival)
            order = sorted(range(len(docs)), key=lambda i: -scores[i])[: request.top_n or len(docs)]
            results = [RerankResult(index=i, relevance_score=scores[i],
                                    document=RerankDocument(text=docs[i]) if request.return_documents else None)
                       for i in order]
            return RerankResponse(model=name, usage=RerankUsage(total_tokens=n), results=results)

        return await self.run_admitted(len(pairs), work)

    @staticmethod
    def _usage(n: int) -> Any:
        from pagedllm.entrypoints.openai.protocol_pooling import PoolingUsage

        return PoolingUsage(prompt_tokens=n, total_tokens=n)

