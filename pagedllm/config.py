"""Frozen, validated engine configuration.

`EngineArgs` (engine/arg_utils.py) holds what a user typed; `create_engine_config()` resolves it into
these frozen objects once. Values discovered at run time (the number of KV blocks found by
profiling) live in `KVCacheInfo` (pagedllm/executor/abstract.py), never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


# --kv-cache-dtype values this build honours, in vLLM's spelling, besides "auto" (the model runner
# resolves it: the model dtype, or float16 for GGUF weights computed on their blocks on the CPU).
# "fp8" is e4m3 (as vLLM on CUDA) with per-tensor k/v scales from the checkpoint, else 1.0;
# fp8_e5m2 and the other 8-bit caches are not built.
KV_CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                   "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def parse_dtype(dtype: str | torch.dtype, config_dtype: torch.dtype | None, device: str) -> torch.dtype:
    """Resolve the run dtype: "auto" -> float32 on CPU (fastest exact path there), else the
    checkpoint's dtype with float32 checkpoints run in bfloat16 on a GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device == "cpu":
            return torch.float32
        if config_dtype in (torch.float16, torch.bfloat16):
            return config_dtype
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}.")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user passed (or the embedded default's path)
    served_model_name: tuple[str, ...]
    hf_config: Any  # transformers.PretrainedConfig
    source: Any  # pagedllm.loader.source.ModelSource
    dtype: torch.dtype
    max_model_len: int
    load_format: str = "auto"
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    seed: int = 0
    quantization: str | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)
    tokenizer_mode: str = "auto"  # auto | slow
    # vLLM's runner: "generate" (sample tokens) or "pooling" (embed / score / classify: pooling/).
    runner_type: str = "generate"
    pooler_config: Any = None  # pagedllm.pooling.config.PoolerConfig when runner_type == "pooling"

    def __post_init__(self) -> None:
        if self.runner_type not in ("generate", "pooling"):
            raise ValueError(f"runner must be generate or pooling, got {self.runner_type!r}.")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        if not self.served_model_name:
            raise ValueError("served_model_name must name at least one model.")

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)

    @property
    def kv_sliding_window(self) -> int | None:
        """The largest window when every attention layer has one (Mistral v0.1, Phi-3): the KV cache
        frees blocks behind it (core/kv_cache_manager.py). None when any layer attends globally
        (Gemma 2/3 interleave both: every block is kept) or for pooling models."""
        from pagedllm.models.utils import sliding_window_for_layer

        num_layers = getattr(self.hf_config, "num_hidden_layers", None)
        if self.runner_type != "generate" or not num_layers:
            return None
        windows = [sliding_window_for_layer(self.hf_config, i) for i in range(int(num_layers))]
        return None if None in windows else max(windows)

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.generation_config.get("eos_token_id"), getattr(self.hf_config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return ids


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out blocks
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    cpu_kvcache_space: float | None = None  # GiB for the KV cache when running on the CPU
    cache_dtype: str = "auto"  # vLLM's kv_cache_dtype: "auto" or a KV_CACHE_DTYPES key

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}.")
        if self.cpu_kvcache_space is not None and self.cpu_kvcache_space <= 0:
            raise ValueError(f"cpu_kvcache_space must be > 0 GiB, got {self.cpu_kvcache_space}.")
        if self.cache_dtype != "auto" and self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.cache_dtype!r} is not supported; choose one of auto, "
                f"{', '.join(KV_CACHE_DTYPES)} (fp8_e5m2 and int8 KV caches are not built)."
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while step N runs on the device (vLLM's async scheduling).
    async_scheduling: bool = False
    # How often the scheduler's stats carry a map of the KV block pool (the web console's block
    # map); 0 = never. The server sets it when the web console is on.
    kv_snapshot_interval_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.kv_snapshot_interval_s < 0:
            raise ValueError(f"kv_snapshot_interval_s must be >= 0, got {self.kv_snapshot_interval_s}.")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len})."
            )


# vLLM's distributed_executor_backend values (pagedllm/executor/abstract.py maps them to classes).
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


def is_executor_qualname(backend: object) -> bool:
    """'package.module.Class': a custom Executor subclass named as vLLM accepts one."""
    return isinstance(backend, str) and "." in backend and all(part.isidentifier() for part in backend.split("."))


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni": one worker in the engine core's process; "mp": one worker process per rank; "ray": Ray
    # actors. None resolves to "uni" for one worker, else "mp" (as vLLM on one node), or "ray" when
    # a ray_address is given. As in vLLM, also the fully qualified name of an Executor subclass
    # ("package.module.Class"), imported where the engine core runs (executor/abstract.py).
    distributed_executor_backend: str | None = None
    # The Ray cluster to join ("auto": the one `ray start` runs on this node; "host:port"; None: a
    # local one started for this engine). Only the Ray executor reads it.
    ray_address: str | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        backend = self.distributed_executor_backend
        if backend is None:
            # Resolved once here, as frozen configs resolve their own defaults.
            default = "ray" if self.ray_address else ("uni" if self.world_size == 1 else "mp")
            object.__setattr__(self, "distributed_executor_backend", default)
        elif backend not in EXECUTOR_BACKENDS and not is_executor_qualname(backend):
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)} or the fully "
                f"qualified name of an Executor subclass ('package.module.Class'), got {backend!r}."
            )
        elif backend == "uni" and self.world_size != 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one worker, but tensor_parallel_size x "
                f"pipeline_parallel_size is {self.world_size}; use 'mp' or 'ray'."
            )
        if self.ray_address is not None and self.distributed_executor_backend != "ray":
            raise ValueError(
                f"ray_address={self.ray_address!r} is only used by distributed_executor_backend='ray', "
                f"not {self.distributed_executor_backend!r}."
            )


@dataclass(frozen=True)
class DeviceConfig:
    device: str  # "cpu" or "cuda"
    enforce_eager: bool = False
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}.")


# Our default capture sizes stop at 512 rows (as vLLM's default does).
MAX_DEFAULT_CAPTURE_SIZE = 512


def resolve_cudagraph_capture_sizes(
    capture_sizes: list[int] | tuple[int, ...] | None,
    max_capture_size: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> tuple[tuple[int, ...], list[int]]:
    """The decode batch sizes to capture as CUDA graphs (vLLM's `cudagraph_capture_sizes` and
    `max_cudagraph_capture_size`), and the asked sizes dropped because no decode batch has them.

    A decode batch has at most min(max_num_seqs, max_num_batched_tokens) rows, so no size above
    that is ever replayed; a batch larger than the largest size runs eagerly.
    - neither given (our default): 1, 2, 4, then every multiple of 8 up to that largest batch
      (capped at 512), plus the largest batch itself. max_num_seqs 100 -> [1, 2, 4, 8, ..., 96, 100]
    - max_cudagraph_capture_size N: vLLM's pattern, [1, 2, 4] + multiples of 8 below 256 +
      multiples of 16 from 256, up to N. N 300 -> [1, 2, 4, 8, ..., 248, 256, 272, 288]
    - cudagraph_capture_sizes: exactly these (sorted, duplicates dropped); with both, N must equal
      the list's largest size.
    """
    largest_batch = min(max_num_seqs, max_num_batched_tokens)
    if capture_sizes is not None:
        if isinstance(capture_sizes, (str, bytes)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in capture_sizes
        ):
            raise ValueError(f"cudagraph_capture_sizes must be a list of ints, got {capture_sizes!r}.")
        if not capture_sizes or min(capture_sizes) < 1:
            raise ValueError(f"cudagraph_capture_sizes must be a non-empty list of sizes >= 1, got {list(capture_sizes)}.")
        asked = sorted(set(capture_sizes))
        if max_capture_size is not None and max_capture_size != asked[-1]:
            raise ValueError(
                f"max_cudagraph_capture_size ({max_capture_size}) must equal the largest of "
                f"cudagraph_capture_sizes ({asked[-1]}) when both are given."
            )
    elif max_capture_size is not None:
        if isinstance(max_capture_size, bool) or not isinstance(max_capture_size, int) or max_capture_size < 1:
            raise ValueError(f"max_cudagraph_capture_size must be an int >= 1, got {max_capture_size!r}.")
        n = max_capture_size
        asked = [s for s in (1, 2, 4) if s <= n] + list(range(8, min(n + 1, 256), 8)) + list(range(256, n + 1, 16))
    else:
        top = min(largest_batch, MAX_DEFAULT_CAPTURE_SIZE)
        asked = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
        if asked[-1] != top:
            asked.append(top)
    kept = tuple(s for s in asked if s <= largest_batch)
    dropped = [s for s in asked if s > largest_batch]
    if not kept:
        raise ValueError(
            f"no CUDA graph capture size is <= the largest decode batch, min(max_num_seqs, "
            f"max_num_batched_tokens) = {largest_batch}: got {asked}."
        )
    return kept, dropped


DEFAULT_CUDAGRAPH_MODE = "FULL_AND_PIECEWISE"  # vLLM's default
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL", "FULL_DECODE_ONLY", "NONE")


@dataclass(frozen=True)
class CompilationConfig:
    """vLLM's compilation config, the part this engine has: which decode batch sizes are captured
    as CUDA graphs (resolved by `resolve_cudagraph_capture_sizes`) and which steps replay graphs
    (`cudagraph_mode`). There is no torch.compile here: the kernels are hand-written Triton, so
    vLLM's compilation levels have nothing to switch.

    cudagraph_mode, vLLM's names:
        FULL_AND_PIECEWISE (default), FULL   decode-only steps replay the decode graphs, and steps
                                             with prefill chunks replay full graphs captured per
                                             token count (worker/mixed_graphs.py). vLLM captures
                                             those piecewise around attention; here the attention
                                             kernel takes fixed grids, so the whole forward is one
                                             graph, up to 8192 tokens (fewer for large dense models:
                                             mixed_graphs.mixed_graph_token_cap)
        FULL_DECODE_ONLY                     decode graphs only; other steps run eagerly
        NONE                                 no CUDA graphs (as enforce_eager)
    PIECEWISE (graphs of the pieces between attention calls, for every step) is not built.
    """

    cudagraph_capture_sizes: tuple[int, ...]
    cudagraph_mode: str = DEFAULT_CUDAGRAPH_MODE

    def __post_init__(self) -> None:
        sizes = self.cudagraph_capture_sizes
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"cudagraph_capture_sizes must be ascending, distinct and >= 1, got {sizes}.")
        if self.cudagraph_mode == "PIECEWISE":
            raise ValueError("cudagraph_mode PIECEWISE is not built: pagedllm captures full graphs (no torch.compile "
                             "to split them); use FULL_AND_PIECEWISE (decode and mixed steps as full graphs), "
                             "FULL_DECODE_ONLY or NONE.")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got {self.cudagraph_mode!r}.")

    @property
    def decode_graphs(self) -> bool:
        return self.cudagraph_mode != "NONE"

    @property
    def mixed_graphs(self) -> bool:
        """Steps with prefill chunks replay graphs too (worker/mixed_graphs.py)."""
        return self.cudagraph_mode in ("FULL_AND_PIECEWISE", "FULL")

    @property
    def max_cudagraph_capture_size(self) -> int:
        return self.cudagraph_capture_sizes[-1]


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    compilation_config: CompilationConfig
    preemption_mode: str = "recompute"
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}.")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}.")
