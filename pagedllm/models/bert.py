"""BERT encoders for the pooling runner: BertModel (sentence embedders such as all-MiniLM-L6-v2)
and BertForSequenceClassification (cross-encoders).

    word + position + token_type embeddings -> LayerNorm
      -> N x [qkv (one GEMM) -> bidirectional attention per request -> dense -> +residual, LayerNorm
              -> dense, GELU -> dense -> +residual, LayerNorm]
      -> hidden states (T, hidden), one flat batch of every request's tokens

Attention is bidirectional and keeps no KV cache: the pooling runner schedules each prompt whole
in one step (chunked prefill and prefix caching are off for pooling), so a request's tokens all sit
in this step's batch and attend to each other only. The linears run on the flat (unpadded) tokens;
only attention pads, to the longest prompt of the step (`EncoderBatch`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers.dense import dense, dense_into
from pagedllm.layers.linear import QKVParallelLinear, ReplicatedLinear
from pagedllm.models.utils import StackedParamsMapping, load_weights_with_mapping
from pagedllm.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass
class EncoderBatch:
    """How the flat batch maps onto a padded (num_reqs, max_len) one, computed once per forward.

        query_start_loc [0, 3, 4] -> lens [3, 1], max_len 3
        gather [0, 1, 2, 3, 3, 3]  (padded slot -> flat row; a pad repeats its request's first row)
        flat [0, 1, 2, 3]  (flat row -> padded slot: request * max_len + offset), key_mask [[1,1,1],[1,0,0]]

    A pad slot holds a real (finite) row, so a masked key meets weight 0 without a zero fill; pad
    queries compute rows nobody reads. When the step's requests form a few runs of equal length
    (LLM.embed submits prompts longest first, as sentence-transformers batches them), each run is
    one unmasked SDPA call on views of the flat batch instead, with no gather at all.
    """

    num_reqs: int
    max_len: int
    gather: torch.Tensor | None  # (R * max_len,) int64; None when every request has max_len tokens
    flat: torch.Tensor | None  # (T,) int64
    key_mask: torch.Tensor | None  # (R, 1, 1, max_len) bool, True = a real key
    runs: list[tuple[int, int, int]] | None = None  # (first token, requests, length) of equal-length runs

    # More runs than this: one padded call (each SDPA call starts its threads; on 2 loaded cores
    # that cost more than the gather; on one thread the two paths cost the same end to end).
    MAX_RUNS = 4

    @classmethod
    def from_metadata(cls, md: AttentionMetadata, device: torch.device) -> EncoderBatch:
        qsl = md.query_start_loc_cpu.to(torch.int64)
        starts, lens = qsl[:-1], qsl[1:] - qsl[:-1]
        num_reqs, max_len = len(lens), int(lens.max())
        if bool((lens == max_len).all()):
            return cls(num_reqs, max_len, None, None, None)
        runs: list[tuple[int, int, int]] = []
        for start, n in zip(starts.tolist(), lens.tolist()):
            if runs and runs[-1][2] == n:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, n)
            else:
                runs.append((start, 1, n))
        if len(runs) <= cls.MAX_RUNS:
            return cls(num_reqs, max_len, None, None, None, runs)
        slot = torch.arange(max_len)[None, :]  # (1, max_len)
        real = slot < lens[:, None]  # (R, max_len)
        gather = torch.where(real, starts[:, None] + slot, starts[:, None]).reshape(-1)
        req = torch.repeat_interleave(torch.arange(num_reqs), lens)
        flat = req * max_len + torch.arange(int(qsl[-1])) - starts[req]
        return cls(num_reqs, max_len, gather.to(device), flat.to(device), real.to(device)[:, None, None, :])

    def attend(self, qkv: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
        """qkv (T, 3 * heads * head_dim) -> (T, heads * head_dim), each request attending to itself.

        One SDPA call per equal-length run, or one padded call for the step (see MAX_RUNS)."""
        width = qkv.shape[1] // 3
        head_dim = width // num_heads
        if self.runs is not None:
            outs = []
            for start, g, n in self.runs:
                seg = qkv[start:start + g * n]
                q, k, v = seg.view(g, n, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
                o = F.scaled_dot_product_attention(q, k, v, scale=scale)  # (g, heads, n, head_dim)
                # SDPA lays its output out as its query: (g, n, heads, head_dim) here, so this is a view.
                outs.append(o.transpose(1, 2).reshape(g * n, width))
            return outs[0] if len(outs) == 1 else torch.cat(outs)  # one copy for the step, not one per run
        r, n = self.num_reqs, self.max_len
        padded = qkv if self.gather is None else qkv.index_select(0, self.gather)  # (R * n, 3 * width)
        # (R, n, 3, heads, head_dim) -> q, k, v (R, heads, n, head_dim), strided views
        q, k, v = padded.view(r, n, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.key_mask, scale=scale).transpose(1, 2)
        if self.gather is None:
            return o.reshape(r * n, width)
        # Back to flat rows: one row gather on the contiguous (R * n, width) output (SDPA's CPU
        # kernel writes (R, n, heads, head_dim)), not advanced indexing on the strided view.
        return o.reshape(r * n, width).index_select(0, self.flat)


class BertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        pet = getattr(config, "position_embedding_type", "absolute")
        if pet not in (None, "absolute"):
            raise ValueError(f"position_embedding_type {pet!r} is not supported; only 'absolute' is built.")

    def position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        return positions  # BERT: 0, 1, 2, ... (RoBERTa shifts them: xlm_roberta.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(input_ids)  # (T, hidden), this call's own buffer: add in place
        x += self.position_embeddings(self.position_ids(positions))
        if token_type_ids is None:
            x += self.token_type_embeddings.weight[0]
        else:
            x += self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        if config.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"{prefix}: hidden_act {config.hidden_act!r} is not supported (gelu variants are).")
        self.act = "gelu" if config.hidden_act == "gelu" else "gelu_tanh"
        self.num_heads = heads
        self.scale = (h // heads) ** -0.5
        self.qkv_proj = QKVParallelLinear(h, h // heads, heads, heads, bias=True, quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        self.attn_out = ReplicatedLinear(h, h, bias=True, quant_config=quant_config, prefix=f"{prefix}.attn_out")
        self.attn_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.intermediate = ReplicatedLinear(h, config.intermediate_size, bias=True, quant_config=quant_config,
                                             prefix=f"{prefix}.intermediate")
        self.output = ReplicatedLinear(config.intermediate_size, h, bias=True, quant_config=quant_config,
                                       prefix=f"{prefix}.output")
        self.out_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        # x is this layer's own input (the embeddings' or the previous layer's LayerNorm output):
        # the residual adds accumulate into it, then into the attention norm's output.
        attn = batch.attend(self.qkv_proj(x), self.num_heads, self.scale)  # (T, hidden)
        x = self.attn_norm(dense_into(x, attn, self.attn_out.weight, self.attn_out.bias))
        y = dense(x, self.intermediate.weight, self.intermediate.bias, self.act)  # (T, intermediate)
        return self.out_norm(dense_into(x, y, self.output.weight, self.output.bias))


class BertModel(nn.Module):
    """The encoder; `forward` gives the last hidden states of every token, (T, hidden)."""

    embeddings_cls: type[BertEmbeddings] = BertEmbeddings
    # Checkpoint prefixes of the base model inside task models (BertForSequenceClassification's
    # "bert.", RoBERTa's "roberta."), stripped on load.
    base_prefixes = ("bert.",)
    uses_token_type_ids = True
    stacked_params_mapping: StackedParamsMapping = [
        (".qkv_proj", ".attention.self.query", "q"),
        (".qkv_proj", ".attention.self.key", "k"),
        (".qkv_proj", ".attention.self.value", "v"),
    ]
    # HF's names of the other per-layer weights -> ours.
    renames = (
        (".attention.output.dense.", ".attn_out."),
        (".attention.output.LayerNorm.", ".attn_norm."),
        (".intermediate.dense.", ".intermediate."),
        (".output.dense.", ".output."),
        (".output.LayerNorm.", ".out_norm."),
        ("encoder.layer.", "layers."),
    )

    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.embeddings = self.embeddings_cls(config)
        self.layers = nn.ModuleList(
            BertLayer(config, quant_config, prefix=f"layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.pooler = self.make_pooler(config)

    @staticmethod
    def make_pooler(config: PretrainedConfig) -> nn.Module | None:
        return None  # BertModel's pooler (dense + tanh on [CLS]) is not part of an embedding

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        batch = EncoderBatch.from_metadata(attn_metadata, input_ids.device)
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers:
            x = layer(x, batch)
        return x

    def hf_to_ours(self, name: str) -> str | None:
        """A checkpoint tensor's name here, or None for tensors an embedding does not use."""
        for p in self.base_prefixes:
            if name.startswith(p):
                name = name[len(p):]
                break
        if name.endswith("position_ids") or name.startswith(("cls.", "lm_head.")):
            return None  # buffers, masked-LM heads
        if name.startswith("pooler.") and self.pooler is None:
            return None  # BertModel's pooler: an embedding does not use it
        if "attention.self." in name:
            return name.replace("encoder.layer.", "layers.")
        for old, new in self.renames:
            name = name.replace(old, new)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((n2, t) for n, t in weights if (n2 := self.hf_to_ours(n)) is not None)
        return load_weights_with_mapping(self, renamed, self.stacked_params_mapping)


class BertPooler(nn.Module):
    """HF's BertPooler: tanh(dense(hidden of [CLS]))."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_hidden))


class BertForSequenceClassification(BertModel):
    """A cross-encoder: [CLS] a [SEP] b [SEP] with segment ids 0 / 1 -> logits (num_labels,).

    The pooling runner takes the [CLS] row of `forward`'s output and calls `classify` on it."""

    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, quant_config, prefix)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    @staticmethod
    def make_pooler(config: PretrainedConfig) -> nn.Module | None:
        return BertPooler(config)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """(R, hidden) [CLS] states -> (R, num_labels) logits."""
        return self.classifier(self.pooler(cls_hidden))
