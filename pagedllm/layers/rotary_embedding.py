"""Rotary position embedding (RoPE) with a precomputed cos/sin cache.

Supported `rope_type`s: "default", "linear" (position interpolation), "llama3" (Llama 3.1's
frequency-dependent scaling), "yarn" (DeepSeek V2/V3, Qwen2.5's long context) and "longrope"
(Phi-3 128K's su scaling). Settings come from `get_rope_parameters(config)`, which reads both
the transformers 5.x form (`config.rope_parameters = {"rope_theta": ..., "rope_type": ..., ...}`)
and the older one (`config.rope_theta` + `config.rope_scaling = {"type"/"rope_type": ..., ...}`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.cpu.build import load_cpu_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def get_rope_parameters(config: Any) -> dict[str, Any]:
    """One flat dict with at least rope_type and rope_theta, from either config format.

    LlamaConfig(rope_parameters={"rope_type": "llama3", "factor": 8.0, ...}) -> the same dict plus
    rope_theta; an old config with rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}
    -> {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type rope_parameters are not supported: {sorted(params)}")
    legacy_type = params.pop("type", None)
    params.setdefault("rope_type", legacy_type or "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    if params["rope_type"] in ("llama3", "yarn", "longrope") and params.get("original_max_position_embeddings") is None:
        # Same fallback as transformers: the pretraining length is the config's
        # original_max_position_embeddings (Phi-3) or else the model's max length.
        params["original_max_position_embeddings"] = (getattr(config, "original_max_position_embeddings", None)
                                                      or config.max_position_embeddings)
    if params["rope_type"] == "longrope" and params.get("factor") is None:
        params["factor"] = config.max_position_embeddings / params["original_max_position_embeddings"]
    return params


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` features of every head by position-dependent angles.

    neox style (HF Llama/Qwen) pairs feature i with i + rotary_dim/2; GPT-J style pairs 2i with 2i+1.
    cos_sin_cache is (max_position, rotary_dim): [cos(p * inv_freq) | sin(p * inv_freq)].
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        # float32 regardless of the model dtype: angles p * inv_freq reach 1e5 and need the precision.
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        # (rotary_dim / 2,): base^(-2i / rotary_dim)
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        return 1.0 / (base**exponent)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.base)
        t = torch.arange(self.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (max_position, rotary_dim / 2)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> torch.Tensor:
        t = x.shape[0]
        x = x.view(t, num_heads, self.head_size)
        rot, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if self.is_neox_style:
            rot = torch.cat((o1, o2), dim=-1)
        else:
            rot = torch.stack((o1, o2), dim=-1).flatten(-2)
        return torch.cat((rot, passthrough), dim=-1).reshape(t, num_heads * self.head_size)

    def forward(
        self,
        positions: torch.Tensor,  # (num_tokens,) absolute positions
        query: torch.Tensor,  # (num_tokens, num_heads * head_size)
        key: torch.Tensor,  # (num_tokens, num_kv_heads * head_size)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if query.is_cuda and self.is_neox_style:
            # Triton kernel, in place on the q/k views of the fused qkv output (same cache layout).
            from pagedllm.kernels.rotary import rotary_embedding

            rotary_embedding(positions, query, key, self.head_size, self.cos_sin_cache)
            return query, key
        if query.is_cpu and query.dtype == key.dtype == torch.float32:
            out = self._forward_cpu(positions, query, key)
            if out is not None:
                return out
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(query.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # (num_tokens, 1, rotary_dim / 2) each
        q = self._rotate(query, cos, sin, query.shape[-1] // self.head_size)
        k = self._rotate(key, cos, sin, key.shape[-1] // self.head_size)
        return q, k

    def _forward_cpu(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """q and k in one C call, bit-exact with `_rotate` (same products and sums, no FMA); None when
        the kernels are unavailable or the layout is not plain rows."""
        lib = load_cpu_kernels()
        cache = self.cos_sin_cache
        if (lib is None or query.dim() != 2 or key.dim() != 2 or query.stride(1) != 1 or key.stride(1) != 1
                or positions.dtype != torch.int64 or not positions.is_contiguous() or cache.dtype != torch.float32
                or not cache.is_contiguous() or query.shape[1] % self.head_size or key.shape[1] % self.head_size):
            return None
        t = query.shape[0]
        q_out = torch.empty((t, query.shape[1]), dtype=query.dtype)
        k_out = torch.empty((t, key.shape[1]), dtype=key.dtype)
        lib.rotary_embedding(
            positions.data_ptr(), query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0),
            q_out.data_ptr(), k_out.data_ptr(), t, query.shape[1] // self.head_size,
            key.shape[1] // self.head_size, self.head_size, self.rotary_dim, cache.data_ptr(),
            int(self.is_neox_style),
        )
        return q_out, k_out

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
                f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
                f"is_neox_style={self.is_neox_style}")


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Position interpolation: angles of position p are those of p / factor; the cache covers
    max_position * factor positions."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, scaling_factor: float) -> None:
        self.scaling_factor = scaling_factor
        super().__init__(head_size, rotary_dim, int(max_position_embeddings * scaling_factor), base,
                         is_neox_style)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        return super()._compute_inv_freq(base) / self.scaling_factor


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.

    With original_max_position 8192, low_freq_factor 1, high_freq_factor 4: wavelengths above 8192
    are divided by 8, below 2048 unchanged, in between interpolated linearly in 8192 / wavelength.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, scaling_factor: float, low_freq_factor: float, high_freq_factor: float,
                 orig_max_position: int) -> None:
        self.scaling_factor = scaling_factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.orig_max_position = orig_max_position
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq(base)
        low_freq_wavelen = self.orig_max_position / self.low_freq_factor
        high_freq_wavelen = self.orig_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (self.orig_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / self.scaling_factor + smooth * inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.scaling_factor, inv_freq)
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    """YaRN: frequencies with fewer than beta_slow rotations over the pretraining length are
    interpolated (divided by `factor`), those with more than beta_fast kept, a linear ramp between;
    cos and sin are scaled by the attention factor (0.1 * ln(factor) + 1 by default, or
    mscale / mscale_all_dim as DeepSeek sets). Same formulas as transformers' `_compute_yarn_parameters`."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, scaling_factor: float, orig_max_position: int,
                 beta_fast: float = 32.0, beta_slow: float = 1.0, mscale: float | None = None,
                 mscale_all_dim: float | None = None, attention_factor: float | None = None,
                 truncate: bool = True) -> None:
        self.scaling_factor = scaling_factor
        self.orig_max_position = orig_max_position
        self.beta_fast, self.beta_slow, self.truncate = beta_fast, beta_slow, truncate
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor,
                                                                                              mscale_all_dim)
            else:
                attention_factor = yarn_get_mscale(scaling_factor)
        self.attention_factor = float(attention_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        dim = self.rotary_dim

        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.orig_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation = 1 - ramp  # 1: keep the original frequency
        return (1.0 / (self.scaling_factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        return super()._compute_cos_sin_cache() * self.attention_factor


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 1 for scale <= 1, else 0.1 * mscale * ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class LongRoPEScalingRotaryEmbedding(RotaryEmbedding):
    """Phi-3's LongRoPE (su): per-frequency divisors, `short_factor` for positions below the pretraining
    length and `long_factor` from there on, cos/sin scaled by sqrt(1 + ln(factor) / ln(orig_max)).

    The cache row of position p uses the long factors when p >= original_max_position_embeddings.
    transformers switches a whole forward pass by its length instead: the two agree token for token
    while a prompt is shorter than the pretraining length (4096 for Phi-3), however long the
    generation; a longer prompt's first original_max positions use the short factors here and the
    long ones there (vLLM switches per batch, which matches neither exactly).
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, short_factor: list[float], long_factor: list[float], orig_max_position: int,
                 scaling_factor: float, attention_factor: float | None = None) -> None:
        if len(short_factor) != rotary_dim // 2 or len(long_factor) != rotary_dim // 2:
            raise ValueError(f"longrope short_factor / long_factor need {rotary_dim // 2} entries, got "
                             f"{len(short_factor)} / {len(long_factor)}")
        self.short_factor = torch.tensor(short_factor, dtype=torch.float32)
        self.long_factor = torch.tensor(long_factor, dtype=torch.float32)
        self.orig_max_position = orig_max_position
        if attention_factor is None:
            attention_factor = (1.0 if scaling_factor <= 1.0
                                else math.sqrt(1 + math.log(scaling_factor) / math.log(orig_max_position)))
        self.attention_factor = float(attention_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        t = torch.arange(self.max_position_embeddings, dtype=torch.float32)
        short = torch.outer(t, 1.0 / (self.short_factor * self.base**exponent))
        long = torch.outer(t, 1.0 / (self.long_factor * self.base**exponent))
        freqs = torch.where((t >= self.orig_max_position)[:, None], long, short)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_factor


def get_rope(
    head_size: int,
    max_position: int,
    rope_parameters: dict[str, Any] | None = None,
    is_neox_style: bool = True,
    rotary_dim: int | None = None,
    base: float | None = None,
) -> RotaryEmbedding:
    """Build the rotary embedding for `rope_parameters` (as returned by `get_rope_parameters`).

    `base` is the theta to use when rope_parameters has no rope_theta (default 10000);
    `rotary_dim` defaults to head_size * partial_rotary_factor.
    """
    params = dict(rope_parameters or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta") or base or 10000.0
    if rotary_dim is None:
        rotary_dim = int(head_size * params.get("partial_rotary_factor", 1.0))
    if rope_type == "default":
        return RotaryEmbedding(head_size, rotary_dim, max_position, theta, is_neox_style)
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(head_size, rotary_dim, max_position, theta, is_neox_style,
                                            float(_require(params, "factor", rope_type)))
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            head_size, rotary_dim, max_position, theta, is_neox_style,
            float(_require(params, "factor", rope_type)),
            float(_require(params, "low_freq_factor", rope_type)),
            float(_require(params, "high_freq_factor", rope_type)),
            int(params.get("original_max_position_embeddings") or max_position),
        )
    if rope_type == "yarn":
        optional = {k: float(params[k]) for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                                  "attention_factor") if params.get(k) is not None}
        return YaRNScalingRotaryEmbedding(
            head_size, rotary_dim, max_position, theta, is_neox_style, float(_require(params, "factor", rope_type)),
            int(params.get("original_max_position_embeddings") or max_position),
            truncate=bool(params.get("truncate", True)), **optional,
        )
    if rope_type == "longrope":
        return LongRoPEScalingRotaryEmbedding(
            head_size, rotary_dim, max_position, theta, is_neox_style,
            list(_require(params, "short_factor", rope_type)), list(_require(params, "long_factor", rope_type)),
            int(params.get("original_max_position_embeddings") or max_position),
            float(params.get("factor") or 1.0), params.get("attention_factor"),
        )
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")


def _require(params: dict[str, Any], key: str, rope_type: str) -> Any:
    if params.get(key) is None:
        raise ValueError(f"rope_type {rope_type!r} needs {key!r} in rope_parameters, got {params}")
    return params[key]
