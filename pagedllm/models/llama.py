"""Llama-family decoder: Llama 2/3/3.1, SmolLM2, Mistral, Qwen2 (same graph, different biases).

    embed_tokens -> N x [RMSNorm -> attention(qkv_proj, rope, paged attn, o_proj) -> +residual
                         RMSNorm -> mlp(gate_up_proj, SiluAndMul, down_proj)     -> +residual]
                 -> RMSNorm -> (compute_logits) lm_head

Inputs are one flat batch of tokens from many requests; `attn_metadata` says which request each
token belongs to. The residual stream is carried beside the hidden states so every RMSNorm can
fuse the residual add (vLLM's layout).

Pipeline parallelism: a stage builds only its layers [start_layer, end_layer) (the others are
`PPMissingLayer`s, so parameter names keep their layer numbers); the first stage embeds, the last
norms and owns the LM head. A stage that is not the last returns `IntermediateTensors` (hidden
states and residual) for the next one, which passes them back in as `intermediate_tensors`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.cpu.decoder import run_cpu_decoder_stack
from pagedllm.distributed.parallel_state import get_pp_group
from pagedllm.distributed.utils import get_pp_indices
from pagedllm.kernels.quantized_activation import QuantizedActivation, ScaledOutput
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.quant_fusion import rms_norm_into, silu_and_mul_into
from pagedllm.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters
from pagedllm.layers.tp import get_tensor_model_parallel_world_size
from pagedllm.layers.utils import divide
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.utils import (
    IntermediateTensors,
    PPMissingLayer,
    StackedParamsMapping,
    load_weights_with_mapping,
    sliding_window_for_layer,
)
from pagedllm.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def get_head_dim(config: PretrainedConfig) -> int:
    """config.head_dim when set (Qwen3: 128 with hidden 1024 / 16 heads = 64), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        quant_config: QuantizationConfig | None = None,
        bias: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"{prefix}: unsupported hidden_act {hidden_act!r}; only 'silu' is supported")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    @property
    def input_linear(self) -> nn.Module:
        """The one linear that reads forward's input (layers/quant_fusion.py)."""
        return self.gate_up_proj

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        # (T, hidden) -> (T, 2 * intermediate / tp) -> (T, intermediate / tp) -> (T, hidden)
        return self.forward_from_gate_up(self.gate_up_proj(x))

    def forward_from_gate_up(self, gate_up: torch.Tensor | ScaledOutput) -> torch.Tensor:
        # int4 batch-1 decode: the activation in the GEMV (an int4 gate_up_proj is never W8A8, so its output is
        # never a ScaledOutput; the check keeps a mixed checkpoint off the int4 path all the same)
        if not isinstance(gate_up, ScaledOutput) and self.down_proj.fuses_silu_and_mul(gate_up):
            return self.down_proj.forward_silu_and_mul(gate_up)
        # a W8A8 down_proj gets its input quantized by the activation kernel, which also applies a deferring
        # FP8 gate_up_proj's scales (a ScaledOutput; materialized first where the kernel does not apply)
        return self.down_proj(silu_and_mul_into(self.act_fn, gate_up, self.down_proj))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        bias: bool = False,
        bias_o_proj: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.hidden_size = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_num_heads
        self.num_heads = divide(self.total_num_heads, tp_size, f"{prefix}: num_attention_heads")
        # Fewer KV heads than ranks: each rank keeps one (replicated) KV head.
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = get_head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5

        self.qkv_proj = QKVParallelLinear(
            self.hidden_size, self.head_dim, self.total_num_heads, self.total_num_kv_heads, bias=bias,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim, self.hidden_size, bias=bias_o_proj,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = rotary_emb  # one instance shared by all layers (its cache can be 64 MB)
        self.attn = Attention(self.num_heads, self.head_dim, self.scaling, self.num_kv_heads,
                              prefix=f"{prefix}.attn",
                              sliding_window=(sliding_window_for_layer(config, layer_index(prefix))
                                              if getattr(config, "sliding_window", None) else None))

    @property
    def input_linear(self) -> nn.Module:
        """The one linear that reads forward's hidden_states (layers/quant_fusion.py); a subclass whose
        forward reads them otherwise must return None."""
        return self.qkv_proj

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor | QuantizedActivation,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.forward_from_qkv(positions, self.qkv_proj(hidden_states), attn_metadata)

    def forward_from_qkv(self, positions: torch.Tensor, qkv: torch.Tensor | ScaledOutput,
                         attn_metadata: AttentionMetadata) -> torch.Tensor:
        # qkv (T, q_size + 2 * kv_size): split, rope, K/V write and attention (one fused prep kernel on
        # the Triton backend), then o_proj; a ScaledOutput (a deferring FP8 qkv_proj) has its scales applied
        # in those fused kernels, or is materialized by Attention.forward_qkv
        attn_output = self.attn.forward_qkv(qkv, positions, self.rotary_emb, attn_metadata)  # (T, q_size)
        return self.o_proj(attn_output)


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(
        self,
        config: PretrainedConfig,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        qkv_bias, o_bias = self.attention_biases(config)
        self.self_attn = self.attention_cls(
            config, rotary_emb, quant_config, bias=qkv_bias, bias_o_proj=o_bias, prefix=f"{prefix}.self_attn"
        )
        self.mlp = self.make_mlp(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_mlp(self, config: PretrainedConfig, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """The feed-forward block; MoE models return their sparse block here (see `layer_index`)."""
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, quant_config,
                        bias=getattr(config, "mlp_bias", False), prefix=prefix)

    @staticmethod
    def attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        """(bias of q/k/v, bias of o_proj). Llama: both follow config.attention_bias."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # int4 batch-1 decode: each residual add + RMSNorm runs inside the GEMV after it (qkv_proj,
        # gate_up_proj) where the layers are the plain Llama ones and the quant method fuses it; a W8A8
        # qkv_proj / gate_up_proj gets its input quantized by the norm (layers/quant_fusion.py)
        attn, mlp = self.self_attn, self.mlp
        attn_in, mlp_in = getattr(attn, "input_linear", None), getattr(mlp, "input_linear", None)
        if residual is None:  # first layer: the residual stream starts as the embeddings
            residual = hidden_states
            hidden_states = attn(positions, rms_norm_into(self.input_layernorm, hidden_states, None, attn_in),
                                 attn_metadata)
        elif type(attn).forward is LlamaAttention.forward and attn.qkv_proj.fuses_rms_norm(hidden_states):
            qkv, residual = attn.qkv_proj.forward_rms_norm(hidden_states, residual, self.input_layernorm)
            hidden_states = attn.forward_from_qkv(positions, qkv, attn_metadata)
        else:
            hidden_states, residual = rms_norm_into(self.input_layernorm, hidden_states, residual, attn_in)
            hidden_states = attn(positions, hidden_states, attn_metadata)
        if type(mlp).forward is LlamaMLP.forward and mlp.gate_up_proj.fuses_rms_norm(hidden_states):
            gate_up, residual = mlp.gate_up_proj.forward_rms_norm(hidden_states, residual,
                                                                   self.post_attention_layernorm)
            return mlp.forward_from_gate_up(gate_up), residual
        hidden_states, residual = rms_norm_into(self.post_attention_layernorm, hidden_states, residual, mlp_in)
        return mlp(hidden_states), residual


def _plain(layer: nn.Module) -> bool:
    """A decoder layer whose forward is LlamaDecoderLayer's with Llama's attention and MLP blocks: its o_proj
    output and its input reach a residual add + RMSNorm through quant_fusion.rms_norm_into, its qkv_proj output
    Attention.forward_qkv, its gate_up_proj output quant_fusion.silu_and_mul_into (all take a ScaledOutput)."""
    return (isinstance(layer, LlamaDecoderLayer) and type(layer).forward is LlamaDecoderLayer.forward
            and type(layer.self_attn).forward is LlamaAttention.forward
            and type(layer.self_attn).forward_from_qkv is LlamaAttention.forward_from_qkv
            and type(layer.mlp).forward is LlamaMLP.forward
            and type(layer.mlp).forward_from_gate_up is LlamaMLP.forward_from_gate_up)


def mark_deferred_scales(layers: Iterable[nn.Module]) -> None:
    """PAGEDLLM_FP8_DEFER_SCALES=1: let each plain layer's FP8 linears that PAGEDLLM_FP8_DEFER_LINEARS names hand
    their consumer a ScaledOutput (kernels/scaled_mm.py DEFER_SCALES), which applies the scales:

        qkv      Attention.forward_qkv: the fused prep / decode kernels (else materialized there)
        o        the post-attention residual add + RMSNorm (quant_fusion.rms_norm_into)
        gate_up  SwiGLU's activation (quant_fusion.silu_and_mul_into)
        down     the next layer's input residual add + RMSNorm, so only where the next layer of this stage is
                 plain too: the last layer's feeds the final norm or the next pipeline stage, which take tensors
    """
    # The switch read from envs, not kernels/scaled_mm (which imports Triton): a CPU engine never imports it.
    from pagedllm.envs import environment_variables

    if not environment_variables["PAGEDLLM_FP8_DEFER_SCALES"]():
        return
    names = environment_variables["PAGEDLLM_FP8_DEFER_LINEARS"]()
    local = list(layers)
    for i, layer in enumerate(local):
        if not _plain(layer):
            continue
        attn, mlp = layer.self_attn, layer.mlp
        linears = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj}
        if i + 1 < len(local) and _plain(local[i + 1]):
            linears["down"] = mlp.down_proj
        for name, linear in linears.items():
            if name in names:
                linear.defer_output_scales = True


class Qwen2DecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return True, False  # Qwen2 always has q/k/v biases and no o_proj bias


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        self.config = config
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.start_layer, self.end_layer = get_pp_indices(config.num_hidden_layers, pp.rank_in_group, pp.world_size)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                   prefix=f"{prefix}.embed_tokens")
            if self.is_first_stage else PPMissingLayer()
        )
        rotary_emb = get_rope(get_head_dim(config), config.max_position_embeddings,
                              get_rope_parameters(config), is_neox_style=True)
        self.layers = nn.ModuleList(
            decoder_layer_cls(config, rotary_emb, quant_config, prefix=f"{prefix}.layers.{i}")
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if self.is_last_stage else PPMissingLayer()
        mark_deferred_scales(self.layers[self.start_layer:self.end_layer])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        if self.is_first_stage:
            hidden_states = self.embed_tokens(input_ids)  # (T, hidden)
            residual = None
            if hidden_states.is_cpu and self.is_last_stage:
                # The whole stack in one C call where the CPU kernels take it (cpu/decoder.py).
                out = run_cpu_decoder_stack(self, hidden_states, positions, attn_metadata)
                if out is not None:
                    return out
        else:
            if intermediate_tensors is None:
                raise ValueError("a pipeline stage after the first needs the previous stage's intermediate_tensors")
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        if not self.is_last_stage:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections that live fused in one parameter here (used by quantization configs).
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    stacked_params_mapping: StackedParamsMapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    model_cls: type[LlamaModel] = LlamaModel  # the decoder stack (Gemma: its own embedding scale, ropes)

    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.model = self.model_cls(config, quant_config, prefix=_join(prefix, "model"),
                                decoder_layer_cls=self.decoder_layer_cls)
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                          prefix=_join(prefix, "lm_head"))
            if getattr(config, "tie_word_embeddings", False) and self.model.is_first_stage:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions (T,) int64 -> hidden_states (T, hidden) on the last pipeline stage,
        IntermediateTensors (hidden_states, residual) on the others."""
        return self.model(input_ids, positions, attn_metadata, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states (T', hidden), usually one row per request -> logits (T', vocab_size) in the
        model dtype (the sampler casts to float32 where it needs to)."""
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (model.layers.0.self_attn.q_proj.weight, ...) in one call."""
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        first, last = self.model.is_first_stage, self.model.is_last_stage

        def skip(name: str) -> bool:
            # rotary_emb.inv_freq: a buffer old checkpoints saved; the cache here is recomputed.
            return "rotary_emb.inv_freq" in name or (tied and name.startswith("lm_head."))

        def rename(name: str) -> str:
            # Tied weights on a last stage that does not embed: its LM head loads the embedding table.
            if tied and last and not first and name.startswith("model.embed_tokens."):
                return "lm_head." + name.removeprefix("model.embed_tokens.")
            return name

        kept = ((rename(n), t) for n, t in weights if not skip(n))
        return load_weights_with_mapping(self, kept, self.stacked_params_mapping)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral has Llama's graph plus a sliding window on every layer (4096 in v0.1, none in v0.2+):
    a token attends to the last `sliding_window` positions, itself included. Every layer has the
    window, so the KV cache frees the blocks that fall out of it during the request
    (core/kv_cache_manager.py)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen2DecoderLayer


def layer_index(prefix: str) -> int:
    """"model.layers.7.mlp" -> 7: the decoder layer a module belongs to (MoE placement, sliding windows)."""
    parts = prefix.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    raise ValueError(f"{prefix!r} names no decoder layer (no 'layers.N')")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
