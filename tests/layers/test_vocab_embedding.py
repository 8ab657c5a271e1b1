"""Vocab embedding / LM head: padding, TP row slicing, tying, logits through LogitsProcessor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagedllm.layers.vocab_embedding as vocab_mod
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, pad_vocab_size


def load(layer, name: str, tensor: torch.Tensor) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor)


def test_pad_vocab_size():
    assert [pad_vocab_size(v) for v in (500, 512, 49152, 151936, 1)] == [512, 512, 49152, 151936, 64]


def test_embedding_pads_zeroes_and_looks_up():
    torch.manual_seed(0)
    table = torch.randn(500, 16)
    emb = VocabParallelEmbedding(500, 16)
    emb.weight.data.fill_(7.0)  # stale values in the padding rows must be cleared by the loader
    load(emb, "weight", table)
    assert emb.weight.shape == (512, 16)
    assert bool((emb.weight[500:] == 0).all())
    ids = torch.tensor([0, 499, 3, 3])
    torch.testing.assert_close(emb(ids), F.embedding(ids, table))
    with pytest.raises(ValueError, match="vocab_size 500"):
        load(emb, "weight", torch.randn(501, 16))


def test_embedding_tp_rows(monkeypatch):
    monkeypatch.setattr(vocab_mod, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(vocab_mod, "get_tensor_model_parallel_world_size", lambda: 2)
    table = torch.arange(500, dtype=torch.float32)[:, None].expand(-1, 4)
    emb = VocabParallelEmbedding(500, 4)  # padded to 512: rank 1 holds rows 256..511, real up to 499
    load(emb, "weight", table)
    assert (emb.vocab_start_index, emb.vocab_end_index, emb.weight.shape[0]) == (256, 500, 256)
    torch.testing.assert_close(emb.weight[:244, 0], torch.arange(256, 500, dtype=torch.float32))
    assert bool((emb.weight[244:] == 0).all())


def test_lm_head_logits_and_tying():
    torch.manual_seed(0)
    table, hidden = torch.randn(500, 16), torch.randn(3, 16)
    head = ParallelLMHead(500, 16)
    load(head, "weight", table)
    logits = LogitsProcessor(500)(head, hidden)
    assert logits.shape == (3, 500) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ table.T)
    torch.testing.assert_close(LogitsProcessor(500, scale=0.5)(head, hidden), 0.5 * hidden @ table.T)

    emb = VocabParallelEmbedding(500, 16)
    load(emb, "weight", table)
    tied = ParallelLMHead(500, 16).tie_weights(emb)
    assert tied.weight is emb.weight
    torch.testing.assert_close(LogitsProcessor(500)(tied, hidden), hidden @ table.T)
    with pytest.raises(ValueError, match="tie"):
        ParallelLMHead(500, 32).tie_weights(emb)


def test_bf16_logits_stay_bf16():
    # No float32 copy of (T', vocab): the sampler casts where it needs float32 (as vLLM's does).
    head = ParallelLMHead(100, 8, params_dtype=torch.bfloat16)
    load(head, "weight", torch.randn(100, 8, dtype=torch.bfloat16))
    assert LogitsProcessor(100)(head, torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
