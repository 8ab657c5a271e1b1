"""Token embedding and LM head, split over TP ranks by vocabulary rows.

The vocabulary is padded to a multiple of `padding_size` (64, as vLLM) so it splits evenly and
the LM-head matmul gets a friendly shape: vocab 49152 stays 49152, vocab 151936 stays, vocab 500
becomes 512. Padding rows are zero; their logits are cut off by `LogitsProcessor`.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.tp import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pagedllm.layers.utils import check_shape, divide, set_weight_attrs
from pagedllm.quantization.base import QuantizationConfig, QuantizeMethodBase, UnquantizedEmbeddingMethod

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


class VocabParallelEmbedding(nn.Module):
    """Embedding table; rank r holds padded rows [r * per_rank, (r + 1) * per_rank)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings  # the real vocabulary size
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_group = get_tp_group()
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.num_embeddings_per_partition = divide(self.num_embeddings_padded, self.tp_size, "vocab")
        # Real (unpadded) vocab rows this rank holds: [vocab_start_index, vocab_end_index).
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        # (A tiny vocabulary over many ranks leaves a rank only padding: end == start, no real rows.)
        self.vocab_end_index = max(min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings),
                                   self.vocab_start_index)
        self.params_dtype = params_dtype or torch.get_default_dtype()
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method: QuantizeMethodBase = method or UnquantizedEmbeddingMethod()
        self.quant_method.create_weights(
            self, embedding_dim, [self.num_embeddings_per_partition], embedding_dim,
            self.num_embeddings_padded, self.params_dtype, weight_loader=self.weight_loader,
        )

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's vocab rows from the full (vocab, hidden) tensor; zero the padding rows."""
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: embedding takes no shard id, got {shard_id!r}")
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            check_shape(self.prefix, param.shape, loaded_weight.shape)
            param.data.copy_(loaded_weight)
            return
        if loaded_weight.shape[output_dim] != self.num_embeddings:
            raise ValueError(f"{self.prefix}: checkpoint has {loaded_weight.shape[output_dim]} vocab rows, "
                             f"config says vocab_size {self.num_embeddings}")
        n = self.vocab_end_index - self.vocab_start_index
        dst = param.data.narrow(output_dim, 0, n)
        src = loaded_weight.narrow(output_dim, self.vocab_start_index, n)
        check_shape(self.prefix, dst.shape, src.shape)
        dst.copy_(src)
        param.data.narrow(output_dim, n, param.shape[output_dim] - n).zero_()

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """input_ (num_tokens,) token ids -> (num_tokens, embedding_dim)."""
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_)
        # Ids outside this rank's rows look up row 0 and are zeroed; the all-reduce fills them in.
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local = torch.where(outside, 0, input_ - self.vocab_start_index)
        out = self.quant_method.embedding(self, local)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out, group=self.tp_group)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"num_embeddings_padded={self.num_embeddings_padded}, tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection hidden -> vocab logits, split over ranks like the embedding.

    It has no forward: `LogitsProcessor` runs `quant_method.apply(lm_head, hidden, bias)`.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, padding_size, quant_config, prefix)
        if bias:
            b = nn.Parameter(torch.empty(self.num_embeddings_per_partition, dtype=self.params_dtype),
                             requires_grad=False)
            set_weight_attrs(b, {"output_dim": 0, "weight_loader": self.weight_loader})
            self.register_parameter("bias", b)
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Share the embedding table (tie_word_embeddings): the same Parameter object, one copy."""
        if (embed_tokens.num_embeddings_padded, embed_tokens.embedding_dim) != (
            self.num_embeddings_padded, self.embedding_dim
        ):
            raise ValueError(f"{self.prefix}: cannot tie to an embedding of another shape")
        self.weight = embed_tokens.weight
        self.quant_method = embed_tokens.quant_method
        return self

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead has no forward; call LogitsProcessor(lm_head, hidden_states)")
