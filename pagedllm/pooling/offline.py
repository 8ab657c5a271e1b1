"""The offline pooling API behind LLM.encode / embed / classify / score (vLLM's signatures)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.pooling.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling.params import POOLING_TASKS, PoolingParams
from pagedllm.pooling.score import cosine_scores, cross_encoder_prompt, make_pairs

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM


def _as_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):  # LLM.generate's rule
        raise TypeError(f"prompts must be a string, a token-id list, a prompt dict or a list of them, got "
                        f"{type(prompts).__name__}.")  # was "'NoneType' object is not iterable"
    return list(prompts)


def _params_list(pooling_params: PoolingParams | Sequence[PoolingParams] | None, n: int, task: str,
                 truncate_prompt_tokens: int | None) -> list[PoolingParams]:
    if pooling_params is None:
        pooling_params = PoolingParams()
    if isinstance(pooling_params, PoolingParams):
        items = [pooling_params] * n
    elif isinstance(pooling_params, Sequence) and all(isinstance(p, PoolingParams) for p in pooling_params):
        items = list(pooling_params)
    else:  # was AttributeError ('str' object has no attribute 'clone'): h61's fuzzer
        raise TypeError(f"pooling_params must be a PoolingParams or a list of them (one per prompt), got "
                        f"{type(pooling_params).__name__}.")
    if len(items) != n:
        raise ValueError(f"got {len(items)} PoolingParams for {n} prompts; give one or one per prompt.")
    out = []
    for p in items:
        p = p.clone()
        if p.task is None:
            p.task = task
        if truncate_prompt_tokens is not None:
            p.truncate_prompt_tokens = truncate_prompt_tokens
        PoolingParams.__post_init__(p)
        out.append(p)
    return out


def _check_task(llm: LLM, task: str) -> None:
    mc = llm.llm_engine.config.model_config
    pooler = mc.pooler_config
    if mc.runner_type != "pooling":
        from pagedllm.pooling.processing import wrong_runner_message

        raise ValueError(wrong_runner_message(llm.llm_engine.config, True))
    if task == "embed" and pooler.task != "embed":
        raise ValueError("this model is a classifier (cross-encoder): use LLM.classify or LLM.score, not LLM.embed.")
    if task == "classify" and pooler.task != "classify":
        raise ValueError("this model embeds: LLM.classify needs a *ForSequenceClassification model.")


def pretokenize(llm: LLM, prompts: list[Any], params: list[PoolingParams]) -> list[Any]:
    """Text prompts tokenized in one batched tokenizer call, with the truncation the processor
    would apply (pooling/processing.py): the same ids, faster, and known before submission."""
    tok = llm.llm_engine.tokenizer
    if tok is None or not prompts or not all(isinstance(p, str) for p in prompts):
        return prompts
    if len({p.truncate_prompt_tokens for p in params}) != 1:
        return prompts
    k = params[0].truncate_prompt_tokens
    max_len = llm.llm_engine.config.model_config.max_model_len
    if k == -1:
        k = max_len
    if k is not None and k > max_len:
        return prompts  # the processor refuses it (ValueError); the tokenizer's OverflowError at 10**30 was no answer
    enc = tok(prompts, truncation=k is not None, max_length=k)["input_ids"]
    return [{"prompt": t, "prompt_token_ids": list(ids)} for t, ids in zip(prompts, enc)]


def run_pooling(llm: LLM, prompts: list[Any], params: list[PoolingParams], use_tqdm: bool) -> list[PoolingRequestOutput]:
    """Submit longest first (as sentence-transformers batches), so a step's prompts have similar
    lengths (models/bert.py attends per equal-length run); results come back in the caller's order."""
    engine = llm.llm_engine
    prompts = pretokenize(llm, prompts, params)

    def length(p: Any) -> int:
        return len(p["prompt_token_ids"]) if isinstance(p, dict) and "prompt_token_ids" in p else 0

    order = sorted(range(len(prompts)), key=lambda i: -length(prompts[i]))
    ids: list[str] = [""] * len(prompts)
    try:
        for i in order:
            rid = str(next(llm._counter))
            engine.add_request(rid, prompts[i], params[i])
            ids[i] = rid
    except ValueError:
        engine.abort_request([i for i in ids if i])
        raise
    return engine.run_to_completion(ids, use_tqdm)


def encode(llm: LLM, prompts: Any, pooling_params: Any = None, *, truncate_prompt_tokens: int | None = None,
           use_tqdm: bool = True, pooling_task: str | None = None) -> list[PoolingRequestOutput]:
    prompts = _as_list(prompts)
    task = pooling_task or "encode"
    if task not in POOLING_TASKS:  # named as the caller named it (PoolingParams says "task")
        raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, got {pooling_task!r}.")
    _check_task(llm, task)
    return run_pooling(llm, prompts, _params_list(pooling_params, len(prompts), task, truncate_prompt_tokens), use_tqdm)


def embed(llm: LLM, prompts: Any, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
          pooling_params: Any = None) -> list[EmbeddingRequestOutput]:
    prompts = _as_list(prompts)
    _check_task(llm, "embed")
    params = _params_list(pooling_params, len(prompts), "embed", truncate_prompt_tokens)
    return [EmbeddingRequestOutput.from_base(o) for o in run_pooling(llm, prompts, params, use_tqdm)]


def classify(llm: LLM, prompts: Any, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
             pooling_params: Any = None) -> list[ClassificationRequestOutput]:
    prompts = _as_list(prompts)
    _check_task(llm, "classify")
    params = _params_list(pooling_params, len(prompts), "classify", truncate_prompt_tokens)
    return [ClassificationRequestOutput.from_base(o) for o in run_pooling(llm, prompts, params, use_tqdm)]


def score(llm: LLM, data_1: Any, data_2: Any, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
          pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
    """Cross-encoder: each pair through the model's head; embedding model: cosine of embeddings."""
    _check_task(llm, "encode")
    pairs = make_pairs(data_1, data_2)
    engine = llm.llm_engine
    mc = engine.config.model_config
    if mc.pooler_config.task == "classify":
        prompts = [cross_encoder_prompt(engine.tokenizer, a, b, truncate_prompt_tokens, mc.max_model_len)
                   for a, b in pairs]
        params = _params_list(pooling_params, len(prompts), "score", None)
        outs = run_pooling(llm, prompts, params, use_tqdm)
        for o in outs:
            if o.outputs.data.numel() != 1:
                raise ValueError(f"score needs a model with one label; this one has {o.outputs.data.numel()}.")
        return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data.reshape(-1)[0])),
                                     o.prompt_token_ids) for o in outs]
    texts = [t for pair in pairs for t in pair]
    params = _params_list(pooling_params, len(texts), "embed", truncate_prompt_tokens)
    outs = run_pooling(llm, texts, params, use_tqdm)
    scores = cosine_scores([o.outputs.data for o in outs[0::2]], [o.outputs.data for o in outs[1::2]])
    return [ScoringRequestOutput(a.request_id, ScoringOutput(s), a.prompt_token_ids + b.prompt_token_ids)
            for a, b, s in zip(outs[0::2], outs[1::2], scores)]
