"""Pooling models against transformers (fp32, CPU): tiny random XLMRobertaModel, BertModel,
BertForSequenceClassification / XLMRobertaForSequenceClassification cross-encoders and a Qwen3
embedder, run through the engine (scheduler, batching, pooling runner), max abs diff <= 1e-4."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers

from pagedllm import LLM, PoolingParams

ENC = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
           max_position_embeddings=128)
# Lengths that differ (the padded attention path), one pair of equal ones, and a single token; both
# attention paths are also held to plain SDPA per request in test_encoder_batch_paths.
PROMPTS = [[5, 17, 42, 7, 99, 3], [8, 9], [11] * 20, [250], [4, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8]]


def _save(model: torch.nn.Module, tmp_path_factory, name: str) -> str:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # perturb norms and biases so that loading them matters
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path)


def _llm(path: str, **kw) -> LLM:
    return LLM(path, skip_tokenizer_init=True, dtype="float32", max_num_seqs=4, **kw)


def _ids(p: list[int]) -> dict:
    return {"prompt_token_ids": p}


@pytest.fixture(scope="module")
def xlmr(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.XLMRobertaConfig(**ENC, pad_token_id=1, max_length=None)
    cfg.max_position_embeddings = 130
    model = transformers.XLMRobertaModel(cfg).eval()
    return _save(model, tmp_path_factory, "xlmr"), model


def test_xlm_roberta_model_matches_transformers(xlmr):
    path, hf = xlmr
    llm = _llm(path, pooler_config={"pooling_type": "ALL", "normalize": False})
    assert llm.llm_engine.config.model_config.max_model_len == 128  # 130 positions - pad id 1 - 1
    outs = llm.encode([_ids(p) for p in PROMPTS], use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).last_hidden_state[0]
        assert o.outputs.data.shape == ref.shape
        assert (o.outputs.data - ref).abs().max() <= 1e-4
    del llm
    gc.collect()
    cls_llm = _llm(path)  # defaults: CLS, normalized
    embs = cls_llm.embed([_ids(p) for p in PROMPTS], use_tqdm=False)
    for p, e in zip(PROMPTS, embs):
        with torch.no_grad():
            ref = torch.nn.functional.normalize(hf(torch.tensor([p])).last_hidden_state[0, 0], dim=0)
        assert (torch.tensor(e.outputs.embedding) - ref).abs().max() <= 1e-4


def test_bert_for_sequence_classification_matches_transformers(tmp_path_factory):
    torch.manual_seed(1)
    cfg = transformers.BertConfig(**ENC, num_labels=3, type_vocab_size=2)
    hf = transformers.BertForSequenceClassification(cfg).eval()
    path = _save(hf, tmp_path_factory, "bert-cls")
    llm = _llm(path)
    # A pair: segment ids 0 for the first part, 1 for the second.
    types = [[0] * (len(p) // 2) + [1] * (len(p) - len(p) // 2) for p in PROMPTS]
    prompts = [{"prompt_token_ids": p, "token_type_ids": t} for p, t in zip(PROMPTS, types)]
    raw = llm.encode(prompts, PoolingParams(use_activation=False), use_tqdm=False)
    probs = llm.classify(prompts, use_tqdm=False)
    for p, t, r, c in zip(PROMPTS, types, raw, probs):
        with torch.no_grad():
            ref = hf(torch.tensor([p]), token_type_ids=torch.tensor([t])).logits[0]
        assert (r.outputs.data - ref).abs().max() <= 1e-4
        assert (torch.tensor(c.outputs.probs) - ref.softmax(-1)).abs().max() <= 1e-4


def test_xlm_roberta_cross_encoder_score_is_sigmoid(tmp_path_factory):
    torch.manual_seed(2)
    cfg = transformers.XLMRobertaConfig(**ENC, pad_token_id=1, num_labels=1)
    cfg.max_position_embeddings = 130
    hf = transformers.XLMRobertaForSequenceClassification(cfg).eval()
    path = _save(hf, tmp_path_factory, "xlmr-cls")
    llm = _llm(path)
    outs = llm.encode([_ids(p) for p in PROMPTS], PoolingParams(task="score"), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = torch.sigmoid(hf(torch.tensor([p])).logits[0])
        assert (o.outputs.data - ref).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="classifier"):
        llm.embed([_ids(PROMPTS[0])], use_tqdm=False)


@pytest.mark.parametrize("arch", ["Qwen3Model", "Qwen3ForCausalLM"])
def test_qwen3_embedder_last_token_matches_transformers(tmp_path_factory, arch):
    torch.manual_seed(3)
    cfg = transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    full = transformers.Qwen3ForCausalLM(cfg).eval()
    hf = full.model
    path = _save(hf if arch == "Qwen3Model" else full, tmp_path_factory, arch.lower())
    kw = {} if arch == "Qwen3Model" else {"runner": "pooling"}
    llm = _llm(path, pooler_config={"normalize": False}, num_gpu_blocks_override=64, **kw)
    assert llm.llm_engine.config.model_config.pooler_config.pooling_type == "LAST"
    outs = llm.embed([_ids(p) for p in PROMPTS], use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).last_hidden_state[0, -1]
        assert (torch.tensor(o.outputs.embedding) - ref).abs().max() <= 1e-4
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks  # no KV block held after the step


@pytest.mark.parametrize("max_runs", [0, 64])  # 0: the padded (gather + key mask) call; 64: one call per run
def test_encoder_batch_paths(monkeypatch, max_runs):
    from types import SimpleNamespace

    from pagedllm.models.bert import EncoderBatch

    monkeypatch.setattr(EncoderBatch, "MAX_RUNS", max_runs)
    lens = [7, 7, 5, 3, 3, 3, 1]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    batch = EncoderBatch.from_metadata(SimpleNamespace(query_start_loc_cpu=qsl), torch.device("cpu"))
    assert (batch.runs is None) == (max_runs == 0)
    torch.manual_seed(0)
    qkv = torch.randn(int(qsl[-1]), 3 * 4 * 8)
    got = batch.attend(qkv, 4, 0.3)
    for s, e in zip(qsl[:-1].tolist(), qsl[1:].tolist()):  # each request alone, plain SDPA
        q, k, v = qkv[s:e].view(e - s, 3, 4, 8).permute(1, 2, 0, 3)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3).transpose(0, 1).reshape(e - s, -1)
        assert (got[s:e] - want).abs().max() <= 1e-5
