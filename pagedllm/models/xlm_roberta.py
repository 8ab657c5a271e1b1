"""XLM-RoBERTa (BGE-M3, bge-reranker-v2-m3): BERT's encoder with RoBERTa's positions and head.

Differences from BERT (models/bert.py), all in the embeddings and the classifier:
- positions start after the padding id: token i sits at position padding_idx + 1 + i (HF computes
  cumsum(input_ids != pad) + pad, the same for a prompt with no pad token inside it);
- one token type (type_vocab_size 1), so no segment ids, even for a cross-encoder's pair;
- the classification head is dense -> tanh -> out_proj on <s>, with no BertPooler before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.models.bert import BertEmbeddings, BertModel
from pagedllm.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class XLMRobertaEmbeddings(BertEmbeddings):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.padding_idx = int(config.pad_token_id)

    def position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        return positions + (self.padding_idx + 1)  # [0, 1, 2] -> [2, 3, 4] with pad id 1


class XLMRobertaModel(BertModel):
    embeddings_cls = XLMRobertaEmbeddings
    base_prefixes = ("roberta.",)
    uses_token_type_ids = False


class XLMRobertaClassificationHead(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_hidden)))


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """A cross-encoder (bge-reranker-v2-m3): <s> a </s></s> b </s> -> logits (num_labels,)."""

    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, quant_config, prefix)
        self.classifier = XLMRobertaClassificationHead(config)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """(R, hidden) <s> states -> (R, num_labels) logits."""
        return self.classifier(cls_hidden)
