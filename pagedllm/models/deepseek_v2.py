"""DeepSeek V2 / V3 (without MTP): Multi-head Latent Attention and routed + shared experts.

Attention (MLA, see `pagedllm.attention.mla`):
    q = q_proj(x)  or  q_b_proj(RMSNorm(q_a_proj(x)))      (T, H, nope + rope)
    [c_kv | k_pe] = kv_a_proj_with_mqa(x); c_kv = kv_a_layernorm(c_kv)     one latent per token
    rope on q_pe and k_pe (interleaved pairs: transformers' complex / rope_interleave form), the cache
    keeps [c_kv | k_pe]; decodes attend in latent space with kv_b_proj absorbed, prefill chunks over
    the latents expanded through it (attention/mla_prefill.py); o_proj.
    scale = (nope + rope)^-0.5, times mscale^2 under YaRN with mscale_all_dim (as transformers).
MLP: dense for the first first_k_dense_replace layers, then
    V2: softmax router (topk_method greedy | group_limited_greedy), renormalised when norm_topk_prob
    V3: sigmoid router + e_score_correction_bias, noaux_tc groups (top-2 sum), norm_topk_prob
    both: weights * routed_scaling_factor, + shared experts (n_shared_experts * moe_intermediate_size).
The router's logits are float32, as transformers computes them; its weight is kept in the model dtype
(DeepSeek's checkpoints store it in bf16, so that is exact there) and on CUDA one bf16 GEMM with fp32
output computes x @ W^T: the same products as transformers' fp32 GEMM, without the fp32 copy of x.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.mla import MLAAttention
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagedllm.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters, yarn_get_mscale
from pagedllm.layers.tp import get_tensor_model_parallel_world_size
from pagedllm.layers.utils import divide
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel, layer_index
from pagedllm.models.utils import load_weights_with_mapping, single_stage
from pagedllm.quantization.base import QuantizationConfig, UnquantizedLinearMethod

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


class DeepseekV2MLAAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.num_heads = divide(config.num_attention_heads, tp, f"{prefix}: num_attention_heads")
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        h, heads, qk = config.hidden_size, config.num_attention_heads, self.nope + self.rope
        bias = bool(getattr(config, "attention_bias", False))
        # q_proj (or q_a_proj) and kv_a_proj_with_mqa read the same x: one GEMM of both (vLLM's
        # fused_qkv_a_proj) on one rank, unquantized, without biases. Its rows: [q (q_a_out) | latent (r + rope)].
        # The latent alone is 576 columns, a GEMM too narrow to fill the GPU at decode sizes.
        self.q_a_out = self.q_lora_rank or heads * qk
        self.fuse_qkv_a = tp == 1 and quant_config is None and not bias
        if self.fuse_qkv_a:
            self.fused_qkv_a_proj = MergedColumnParallelLinear(h, [self.q_a_out, self.kv_lora_rank + self.rope],
                                                               bias=False, prefix=f"{prefix}.fused_qkv_a_proj")
        if self.q_lora_rank:
            if not self.fuse_qkv_a:
                self.q_a_proj = ReplicatedLinear(h, self.q_lora_rank, bias=bias, quant_config=quant_config,
                                                 prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk, bias=False, quant_config=quant_config,
                                                 prefix=f"{prefix}.q_b_proj")
        elif not self.fuse_qkv_a:
            self.q_proj = ColumnParallelLinear(h, heads * qk, bias=False, quant_config=quant_config,
                                               prefix=f"{prefix}.q_proj")
        if not self.fuse_qkv_a:
            self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_lora_rank + self.rope, bias=bias,
                                                       quant_config=quant_config,
                                                       prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        # Absorbed into the attention (its weight is read as W_UK / W_UV), so it stays dense.
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope + self.v_head_dim), bias=False,
                                              prefix=f"{prefix}.kv_b_proj")
        if not isinstance(self.kv_b_proj.quant_method, UnquantizedLinearMethod):
            raise ValueError(f"{prefix}.kv_b_proj must be unquantized (MLA absorbs its weight)")
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, h, bias=bias, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb
        scale = qk**-0.5
        params = get_rope_parameters(config)
        if params["rope_type"] != "default" and params.get("mscale_all_dim"):
            scale *= yarn_get_mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.rope, scale, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        t, hh = hidden_states.shape[0], self.num_heads
        if self.fuse_qkv_a:
            qkv_a = self.fused_qkv_a_proj(hidden_states)  # (T, q_a_out + r + rope): views below
            q, latent = qkv_a[:, : self.q_a_out], qkv_a[:, self.q_a_out :]
            if self.q_lora_rank:
                q = self.q_b_proj(self.q_a_layernorm(q))
        else:
            if self.q_lora_rank:
                q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
            else:
                q = self.q_proj(hidden_states)
            latent = self.kv_a_proj_with_mqa(hidden_states)
        q = q.view(t, hh, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        r = self.kv_lora_rank
        w = self.kv_b_proj.weight.view(hh, self.nope + self.v_head_dim, r)
        if self.attn.uses_fused_prep(latent, self.rotary_emb):
            # One kernel (kernels/mla_prep.py): the latent normed and rotated in place and written to
            # the cache, the rotated q_pe written into the absorbed query's last features.
            from pagedllm.kernels.mla_prep import mla_prep

            query = torch.empty((t, hh, r + self.rope), dtype=q.dtype, device=q.device)  # (T, H, W)
            n = attn_metadata.num_actual_tokens
            mla_prep(positions, q_pe, query[..., r:], latent, self.kv_a_layernorm.weight,
                     self.kv_a_layernorm.variance_epsilon, self.rotary_emb.cos_sin_cache, self.attn.kv_cache,
                     attn_metadata.slot_mapping, n)
            return self.o_proj(self.attn.forward_mla_prepared(q_nope, query, latent, w, attn_metadata))
        if latent.is_cuda and self.rotary_emb.is_neox_style:
            # The Triton rotary kernel rotates the strided q_pe / k_pe views in place: no copies.
            kv_c = self.kv_a_layernorm(latent[:, :r])
            k_pe = latent[:, r:]
            self.rotary_emb(positions, q_pe, k_pe)
        else:
            kv_c = self.kv_a_layernorm(latent[:, :r].contiguous())
            q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(t, hh * self.rope).contiguous(),
                                         latent[:, r:].contiguous())
            q_pe = q_pe.view(t, hh, self.rope)
        out = self.attn.forward_mla(q_nope, q_pe, kv_c, k_pe, w, attn_metadata)
        return self.o_proj(out)

    def deinterleave_rope_rows(self) -> None:
        """Reorder the rope features that q_proj (q_b_proj) and kv_a_proj_with_mqa produce from
        interleaved pairs (x0 x1)(x2 x3)... to halves (x0 x2 ... | x1 x3 ...): neox rotary on the
        new order is the interleaved rotary on the old one, features permuted alike for q_pe and
        k_pe, so every score q_pe . k_pe is unchanged, and the fused Triton rotary kernel (neox
        only) runs instead of ~18 torch ops. Worked example, rope 4: rows [a0 a1 a2 a3] -> [a0 a2 a1 a3];
        pairs (a0, a1), (a2, a3) become (new0, new2), (new1, new3), neox's pairs."""
        perm = torch.cat([torch.arange(0, self.rope, 2), torch.arange(1, self.rope, 2)])
        if self.q_lora_rank:
            q_rows = self.q_b_proj.weight.data
        else:
            q_rows = (self.fused_qkv_a_proj.weight.data[: self.q_a_out] if self.fuse_qkv_a
                      else self.q_proj.weight.data)
        w = q_rows.view(self.num_heads, self.nope + self.rope, -1)
        w[:, self.nope :] = w[:, self.nope :][:, perm.to(w.device)].clone()
        if self.fuse_qkv_a:  # (tensor, first rope row): the latent's rows follow q's
            kv_rows = [(self.fused_qkv_a_proj.weight.data, self.q_a_out + self.kv_lora_rank)]
        else:
            kv = self.kv_a_proj_with_mqa
            kv_rows = [(p.data, self.kv_lora_rank) for p in (kv.weight, kv.bias) if p is not None]
        for data, start in kv_rows:
            rows = data[start : start + self.rope]
            rows.copy_(rows[perm.to(data.device)].clone())


class DeepseekV2MoE(nn.Module):
    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None, prefix: str,
                 scoring_func: str = "softmax", topk_method: str | None = None) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"{prefix}: unsupported hidden_act {config.hidden_act!r}; only 'silu' is supported")
        method = topk_method or getattr(config, "topk_method", None) or "greedy"
        if method not in _TOPK_METHODS:
            raise ValueError(f"{prefix}: topk_method {method!r} is not supported; supported: {list(_TOPK_METHODS)}")
        num_experts = config.n_routed_experts
        grouped = method in ("group_limited_greedy", "noaux_tc")
        n_shared = getattr(config, "n_shared_experts", None) or 0
        # Unquantized: the shared experts run inside the fused MoE as experts E .. E + n_shared - 1
        # (layers/fused_moe/layer.py), one launch sequence instead of the shared MLP's four.
        self.fused_shared = n_shared if quant_config is None else 0
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(
            num_experts, config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)), scoring_func=scoring_func,
            num_expert_group=config.n_group if grouped else None, topk_group=config.topk_group if grouped else None,
            e_score_correction_bias=method == "noaux_tc",
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
            num_fused_shared_experts=self.fused_shared, quant_config=quant_config, prefix=f"{prefix}.experts",
        )
        self.shared_experts = (LlamaMLP(config.hidden_size, config.moe_intermediate_size * n_shared, config.hidden_act,
                                        quant_config, prefix=f"{prefix}.shared_experts")
                               if n_shared and not self.fused_shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, hidden); with the shared experts fused (no separate MLP to add) on one CUDA
        rank, the (T, top_k + shared, hidden) expert outputs unsummed: the next layer's residual add +
        RMSNorm sums them (kernels/rmsnorm.py), so the sum is no kernel of its own (as Qwen's blocks)."""
        if self.shared_experts is None and self.experts.can_leave_topk_unsummed(x):
            return self.experts(x, router_logits(x, self.gate.weight), sum_topk=False)
        out = self.experts(x, router_logits(x, self.gate.weight))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


_MM_OUT_DTYPE = [True]  # torch.mm(..., out_dtype=) usable here; set False on its first failure


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # (T, E) float32
    """x (T, hidden) @ weight (E, hidden)^T in float32. 16-bit inputs on CUDA: one tensor-core GEMM
    with an fp32 output (exact products, fp32 sums); elsewhere both operands cast to fp32."""
    if x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) and _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # a torch without mm's out_dtype: the fp32 GEMM from now on
            _MM_OUT_DTYPE[0] = False
    return torch.nn.functional.linear(x.float(), weight.float())


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention_cls = DeepseekV2MLAAttention
    scoring_func = "softmax"
    topk_method: str | None = None  # None: config.topk_method (V2); V3 always routes noaux_tc

    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        nn.Module.__init__(self)
        self.self_attn = self.attention_cls(config, rotary_emb, quant_config, prefix=f"{prefix}.self_attn")
        self.mlp = self.make_mlp(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_mlp(self, config, quant_config, prefix):
        index = layer_index(prefix)
        if index >= (getattr(config, "first_k_dense_replace", 0) or 0) and config.n_routed_experts:
            return DeepseekV2MoE(config, quant_config, prefix, self.scoring_func, self.topk_method)
        return super().make_mlp(config, quant_config, prefix)


class DeepseekV2Model(LlamaModel):
    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 decoder_layer_cls: type[nn.Module] = DeepseekV2DecoderLayer) -> None:
        nn.Module.__init__(self)
        from pagedllm.layers.vocab_embedding import VocabParallelEmbedding

        self.config = config
        single_stage(self, type(self).__name__)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                                   prefix=f"{prefix}.embed_tokens")
        # Interleaved pairs (GPT-J style) on the rope part only; V3 with rope_interleave=False uses neox halves.
        # Unquantized checkpoints get their rope rows reordered at load (deinterleave_rope_rows) and
        # then rotate neox style; quantized weights keep their rows and the interleaved rotary.
        interleaved = getattr(config, "rope_interleave", True) is not False
        self.rope_deinterleaved = interleaved and quant_config is None
        rotary_emb = get_rope(config.qk_rope_head_dim, config.max_position_embeddings, get_rope_parameters(config),
                              is_neox_style=not interleaved or self.rope_deinterleaved)
        self.layers = nn.ModuleList(decoder_layer_cls(config, rotary_emb, quant_config, prefix=f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = DeepseekV2DecoderLayer
    model_cls = DeepseekV2Model
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    stacked_params_mapping = [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj",
                                                      self.config.n_routed_experts or 0)
        num_layers = self.config.num_hidden_layers
        tied = bool(getattr(self.config, "tie_word_embeddings", False))

        def skip(name: str) -> bool:
            parts = name.split(".")
            # V3's multi-token-prediction layers (model.layers.61 in DeepSeek-V3) are not run.
            mtp = len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= num_layers
            return mtp or "rotary_emb.inv_freq" in name or (tied and name.startswith("lm_head."))

        n_shared = getattr(self.config, "n_shared_experts", None) or 0
        fused_shared = n_shared if self.quant_config is None and self.config.n_routed_experts else 0
        if fused_shared:  # the shared MLP's tensors as experts E .. E + n_shared - 1 (DeepseekV2MoE)
            mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj",
                                                          self.config.n_routed_experts + fused_shared)
            weights = (piece for n, t in weights for piece in FusedMoE.split_shared_expert_weights(
                n, t, ".mlp.shared_experts.", ".mlp.experts.", self.config.n_routed_experts, fused_shared))
        renamed = ((n.replace(".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias"), t)
                   for n, t in weights)
        stacked = list(self.stacked_params_mapping)
        if getattr(self.model.layers[0].self_attn, "fuse_qkv_a", False):  # DeepseekV2MLAAttention's one GEMM
            q_name = ".q_a_proj" if getattr(self.config, "q_lora_rank", None) else ".q_proj"
            stacked += [(".fused_qkv_a_proj", q_name, 0), (".fused_qkv_a_proj", ".kv_a_proj_with_mqa", 1)]
        loaded = load_weights_with_mapping(self, renamed, mapping + stacked, skip)
        if self.model.rope_deinterleaved:
            for layer in self.model.layers:
                layer.self_attn.deinterleave_rope_rows()
        return loaded


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    scoring_func = "sigmoid"
    topk_method = "noaux_tc"


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    decoder_layer_cls = DeepseekV3DecoderLayer
