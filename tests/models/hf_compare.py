"""Test harness: a tiny random HF model, the same weights in a pagedllm model, and a paged KV cache.

`PagedRunner.step({req_id: new_tokens})` runs one engine-like step: the new tokens of every request
in one flat batch, block tables grown on demand from a shuffled free list (so blocks are never
contiguous), K/V written to the cache, logits of every new token returned per request.
"""

from __future__ import annotations

import random

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from pagedllm.attention.backend import TorchAttentionBackend
from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import build_metadata
from pagedllm.models.registry import resolve_model_cls

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=500, max_position_embeddings=128, initializer_range=0.1)


def make_hf_model(config: PretrainedConfig, seed: int = 0) -> nn.Module:
    """Random fp32 HF model; norm weights and biases perturbed so that loading them matters."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return model


def make_paged_model(config: PretrainedConfig, hf_model: nn.Module) -> nn.Module:
    model = resolve_model_cls(config)(config).eval()
    model.load_weights(hf_model.state_dict().items())
    return model


@torch.no_grad()
def hf_logits(hf_model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    """(len(token_ids), vocab) logits of every position, no cache."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


class PagedRunner:
    def __init__(self, model: nn.Module, num_blocks: int = 48, block_size: int = 4, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        for module in model.modules():  # model order: layer 0's attention first
            if isinstance(module, Attention):
                cache = torch.zeros(2, num_blocks, block_size, module.num_kv_heads, module.head_dim)
                module.bind_kv_cache(cache, TorchAttentionBackend())
        self.tokens: dict[str, list[int]] = {}
        self.block_tables: dict[str, list[int]] = {}

    @torch.no_grad()
    def step(self, new_tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        req_ids = list(new_tokens)
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for req in req_ids:
            start = len(self.tokens.setdefault(req, []))
            self.tokens[req].extend(new_tokens[req])
            seq_len = len(self.tokens[req])
            table = self.block_tables.setdefault(req, [])
            while len(table) * self.block_size < seq_len:
                table.append(self.free_blocks.pop())
            input_ids.extend(new_tokens[req])
            positions.extend(range(start, seq_len))
            query_lens.append(len(new_tokens[req]))
            seq_lens.append(seq_len)
        md = build_metadata(query_lens, seq_lens, [self.block_tables[r] for r in req_ids], self.block_size)
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), md)
        assert hidden.shape == (len(input_ids), self.model.config.hidden_size)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return dict(zip(req_ids, logits.split(query_lens), strict=True))
