"""`EngineArgs`: what the user typed (LLM kwargs or CLI flags), resolved once into EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

import pagedllm.envs as envs
from pagedllm.config import (
    DEFAULT_CUDAGRAPH_MODE,
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_dtype,
    resolve_cudagraph_capture_sizes,
)
from pagedllm.engine.arg_cli import LOAD_FORMATS, TOKENIZER_MODES, add_engine_cli_args

logger = logging.getLogger(__name__)

# Keys of vLLM's compilation_config that mean something here; the compilation level ("mode", or
# "level" in older vLLM) is accepted and has no effect (there is no torch.compile to switch).
COMPILATION_CONFIG_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size", "cudagraph_mode", "mode", "level")


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    served_model_name: list[str] | str | None = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    load_format: str = "auto"
    quantization: str | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0
    cpu_kvcache_space: float | None = None
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool | None = None  # None: on (vLLM v1's default)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None  # None: on (vLLM v1's default)
    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    compilation_config: CompilationConfig | dict | int | str | None = None
    cuda_graph_sizes: list[int] | None = None  # older vLLM's spelling of the two above
    attention_backend: str | None = None  # vLLM's name of the one backend built per device, or auto
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    ray_address: str | None = None  # "auto" or "host:port" of a `ray start` cluster (Ray executor)
    preemption_mode: str | None = None
    max_logprobs: int = 20
    cpu_threads: int | None = None
    async_scheduling: bool | None = None  # None: on for CUDA, off on the CPU (nothing to overlap)
    # Not a vLLM argument: the server sets it when its web console is on (SchedulerConfig's field).
    kv_snapshot_interval_s: float = 0.0
    # vLLM's model-resolution and loading arguments (loader/source.py, loader/hf_cache.py).
    tokenizer_mode: str = "auto"  # auto | slow (mistral / custom tokenizers are not built)
    revision: str | None = None  # a branch, tag or commit of a hub id in the local HF cache
    download_dir: str | None = None  # an HF hub cache directory to look in first
    hf_overrides: dict[str, Any] | str | None = None  # keys set on the model's config (dict or JSON)
    generation_config: str = "auto"  # auto (the model's), vllm (none), or a directory
    disable_sliding_window: bool = False
    scheduling_policy: str = "fcfs"  # priority scheduling is not built
    disable_log_stats: bool = False  # the server's periodic stats log line
    # Pooling (pooling/config.py): vLLM's runner / convert, older vLLM's task, and the pooler.
    runner: str = "auto"
    convert: str = "auto"
    task: str | None = None
    pooler_config: Any = None
    override_pooler_config: Any = None

    def resolve_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}.")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device.")
        return self.device

    def create_engine_config(self) -> EngineConfig:
        if self.device in ("auto", "cuda") and envs.PAGEDLLM_PARALLEL_COMPILE and torch.cuda.is_available():
            from pagedllm.worker.compile_pool import start_compile_pool

            start_compile_pool(early=True)  # Triton compile processes import while the config and model load
        from pagedllm.loader.source import resolve_model
        from pagedllm.quantization.registry import build_quant_config, canonical_method, resolve_quantization

        if self.seed is None:
            # vLLM V1 read seed=None as 0 (every worker must share one seed); it failed late, in torch.manual_seed.
            logger.warning("seed=None is read as seed=0, as in vLLM V1; pass an integer seed.")
            self.seed = 0
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}.")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}.")
        if self.quantization is not None:
            canonical_method(self.quantization)  # an unbuilt method is refused before the model is read
        if self.tokenizer is not None and not os.path.exists(self.tokenizer):
            raise ValueError(f"tokenizer {self.tokenizer!r} is not a local path (no model hub is reached).")
        device = self.resolve_device()
        _check_attention_backend(self.attention_backend, device)
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(
                f"tokenizer_mode {self.tokenizer_mode!r} is not supported; choose one of {', '.join(TOKENIZER_MODES)} "
                "(mistral_common and custom tokenizers are not built)."
            )
        if self.scheduling_policy != "fcfs":
            raise ValueError(
                f"scheduling_policy {self.scheduling_policy!r} is not supported: requests are served first come, "
                "first served ('fcfs'); priority scheduling is not built."
            )
        source = resolve_model(
            self.model, trust_remote_code=self.trust_remote_code, revision=self.revision,
            download_dir=self.download_dir, hf_overrides=_parse_hf_overrides(self.hf_overrides),
            generation_config=self.generation_config,
        )
        hf = source.hf_config
        # The checkpoint's quantization_config against the user's choice; its settings parse at load.
        quantization = resolve_quantization(self.quantization, hf)
        if quantization not in (None, "gguf"):
            build_quant_config(quantization, hf, self.load_format)  # refuse unbuilt schemes at start
        config_dtype = getattr(hf, "dtype", None)
        if isinstance(config_dtype, str):
            config_dtype = getattr(torch, config_dtype, None)
        dtype = parse_dtype(self.dtype, config_dtype, device)
        derived_max = _derive_max_model_len(hf)
        from pagedllm.pooling.config import resolve_runner

        run = resolve_runner(self.runner, self.convert, self.task, self.pooler_config, self.override_pooler_config,
                             hf, source.path if source.kind == "hf_dir" else None)
        pooling = run.runner_type == "pooling"
        if run.max_model_len is not None:
            derived_max = min(derived_max, run.max_model_len)
        limit_from = "from max_position_embeddings"
        window = _smallest_window(hf) if self.disable_sliding_window else None
        if window is not None and window < derived_max:
            # vLLM's disable_sliding_window: the context is capped at the window, so it never slides.
            derived_max, limit_from = window, "capped at the sliding window by disable_sliding_window"
        max_model_len = self.max_model_len or derived_max
        if max_model_len > derived_max:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's maximum context ({derived_max}, "
                f"{limit_from})."
            )
        names = self.served_model_name or [self.model or source.default_name]
        if isinstance(names, str):
            names = [names]
        model_config = ModelConfig(
            model=str(self.model or source.path),
            served_model_name=tuple(names),
            hf_config=hf,
            source=source,
            dtype=dtype,
            max_model_len=max_model_len,
            load_format=self.load_format,
            tokenizer=self.tokenizer,
            skip_tokenizer_init=self.skip_tokenizer_init,
            trust_remote_code=self.trust_remote_code,
            seed=self.seed,
            quantization=quantization,
            generation_config=dict(source.generation_config),
            tokenizer_mode=self.tokenizer_mode,
            runner_type=run.runner_type,
            pooler_config=run.pooler_config,
        )
        parallel_config = ParallelConfig(
            self.tensor_parallel_size, self.pipeline_parallel_size, self.distributed_executor_backend,
            self.ray_address,
        )
        from pagedllm.distributed.utils import check_parallel_sizes

        check_parallel_sizes(hf, parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size)
        # `is None`, not `or`: --max-num-seqs 0 must reach SchedulerConfig's check, not become the default.
        max_num_seqs = self.max_num_seqs if self.max_num_seqs is not None else (256 if device == "cuda" else 64)
        chunked = True if self.enable_chunked_prefill is None else self.enable_chunked_prefill
        if pooling and (self.enable_chunked_prefill or self.enable_prefix_caching):
            raise ValueError("runner='pooling' runs every prompt whole in one step: enable_chunked_prefill and "
                             "enable_prefix_caching are not supported with it (pooling/runner.py).")
        chunked = chunked and not pooling
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 8192 if device == "cuda" else 2048
        if not chunked and self.max_num_batched_tokens is None:
            batched = max(batched, max_model_len)  # every prompt must fit one step (as vLLM)
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", batched)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        compilation = self._compilation_dict()
        sizes_arg, max_size_arg = self._cudagraph_size_args(compilation)
        capture_sizes, dropped = resolve_cudagraph_capture_sizes(sizes_arg, max_size_arg, max_num_seqs, batched)
        if dropped:
            logger.warning(
                "CUDA graph sizes %s are not captured: a decode batch has at most min(max_num_seqs, "
                "max_num_batched_tokens) = %d rows.", dropped, min(max_num_seqs, batched),
            )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                swap_space=self.swap_space,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=(not pooling) if self.enable_prefix_caching is None else self.enable_prefix_caching,
                cpu_kvcache_space=self.cpu_kvcache_space if self.cpu_kvcache_space is not None else _env_kvcache_space(),
                cache_dtype=self.kv_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=chunked,
                async_scheduling=(device == "cuda") if self.async_scheduling is None else self.async_scheduling,
                kv_snapshot_interval_s=self.kv_snapshot_interval_s,
            ),
            parallel_config=parallel_config,
            device_config=DeviceConfig(device=device, enforce_eager=self.enforce_eager, cpu_threads=self.cpu_threads),
            compilation_config=CompilationConfig(capture_sizes, self._cudagraph_mode(compilation)),
            preemption_mode=self.preemption_mode or "recompute",
            max_logprobs=self.max_logprobs,
        )

    def _compilation_dict(self) -> dict | None:
        """The user's `compilation_config` as a dict of the keys it sets (None: none given or a
        level int, which changes nothing here). A dict, a JSON string, a level int or a
        CompilationConfig are accepted, as in vLLM; unknown keys are refused."""
        cc = self.compilation_config
        if isinstance(cc, str):
            text = cc.strip()
            try:
                cc = int(text) if text.lstrip("-").isdigit() else json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"compilation_config must be a JSON object or a level int, got {text!r}: {e}.") from e
        if isinstance(cc, CompilationConfig):
            cc = {"cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes), "cudagraph_mode": cc.cudagraph_mode}
        if isinstance(cc, bool) or not (cc is None or isinstance(cc, (int, dict))):
            raise ValueError(f"compilation_config must be a dict, a JSON string or a level int, got {cc!r}.")
        if isinstance(cc, int):
            logger.info("compilation_config level %d has no effect: pagedllm runs no torch.compile.", cc)
            return None
        if cc is not None:
            unknown = sorted(set(cc) - set(COMPILATION_CONFIG_KEYS))
            if unknown:
                raise ValueError(
                    f"compilation_config keys {unknown} are not supported; supported: {', '.join(COMPILATION_CONFIG_KEYS)} "
                    "(the level has no effect: there is no torch.compile here)."
                )
        return cc

    @staticmethod
    def _cudagraph_mode(cc: dict | None) -> str:
        """vLLM's `compilation_config.cudagraph_mode` from `_compilation_dict`'s dict (default
        FULL_AND_PIECEWISE), validated by CompilationConfig; an enum member's name is taken as its string."""
        mode = (cc or {}).get("cudagraph_mode")
        if mode is None:
            return DEFAULT_CUDAGRAPH_MODE
        return str(getattr(mode, "name", mode)).upper()

    def _cudagraph_size_args(self, cc: dict | None) -> tuple[list[int] | tuple[int, ...] | None, int | None]:
        """(cudagraph_capture_sizes, max_cudagraph_capture_size) from wherever the user set them:
        the two arguments, a `compilation_config` (dict, JSON string, level int, or a
        CompilationConfig), or older vLLM's `cuda_graph_sizes` (one value: the largest size;
        several: the list). Setting the same thing two ways is an error, as in vLLM. cc: the
        `_compilation_dict`, parsed once by the caller."""
        sizes, max_size = self.cudagraph_capture_sizes, self.max_cudagraph_capture_size
        if cc is not None:
            for key, top in (("cudagraph_capture_sizes", sizes), ("max_cudagraph_capture_size", max_size)):
                if cc.get(key) is not None and top is not None:
                    raise ValueError(f"{key} and compilation_config.{key} are mutually exclusive.")
            if cc.get("cudagraph_capture_sizes") is not None:
                sizes = cc["cudagraph_capture_sizes"]
            if cc.get("max_cudagraph_capture_size") is not None:
                max_size = cc["max_cudagraph_capture_size"]
        if self.cuda_graph_sizes is not None:
            if sizes is not None or max_size is not None:
                raise ValueError("cuda_graph_sizes (older vLLM) and cudagraph_capture_sizes / "
                                 "max_cudagraph_capture_size are mutually exclusive.")
            old = list(self.cuda_graph_sizes)
            logger.warning("cuda_graph_sizes is older vLLM's name: use cudagraph_capture_sizes (a list) or "
                           "max_cudagraph_capture_size (one value).")
            if len(old) == 1:
                max_size = old[0]
            else:
                sizes = old
        return sizes, max_size

    # -- command line ------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> argparse.ArgumentParser:
        """The engine flags (engine/arg_cli.py) in an "engine" group of `parser`."""
        return add_engine_cli_args(parser, model_positional)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if hasattr(args, f.name):
                kwargs[f.name] = getattr(args, f.name)
        if getattr(args, "model_tag", None):
            if kwargs.get("model") and kwargs["model"] != args.model_tag:
                raise ValueError(f"two models given: {args.model_tag!r} and --model {kwargs['model']!r}.")
            kwargs["model"] = args.model_tag
        return cls(**kwargs)


# The attention backend built for each device, under vLLM's AttentionBackendEnum name.
ATTENTION_BACKENDS = {"cuda": "TRITON_ATTN", "cpu": "CPU_ATTN"}
# vLLM's other backend names: accepted with a warning (a launch script naming one still runs).
VLLM_ATTENTION_BACKENDS = frozenset({
    "FLASH_ATTN", "FLASH_ATTN_VLLM_V1", "TRITON_ATTN_VLLM_V1", "XFORMERS", "XFORMERS_VLLM_V1", "FLASHINFER",
    "FLASHINFER_VLLM_V1", "FLASHINFER_MLA", "TORCH_SDPA", "TORCH_SDPA_VLLM_V1", "ROCM_FLASH", "ROCM_ATTN",
    "ROCM_AITER_FA", "ROCM_AITER_MLA", "ROCM_AITER_UNIFIED_ATTN", "TRITON_MLA", "CUTLASS_MLA", "FLASHMLA",
    "FLASH_ATTN_MLA", "PALLAS", "IPEX", "FLEX_ATTENTION", "TREE_ATTN", "DUAL_CHUNK_FLASH_ATTN",
    "DIFFERENTIAL_FLASH_ATTN", "NO_ATTENTION",
} | set(ATTENTION_BACKENDS.values()))


def _check_attention_backend(name: str | None, device: str) -> None:
    """vLLM's attention_backend: "auto" / None, or the name of the backend this device runs
    (our own kernels: TRITON_ATTN on a GPU, CPU_ATTN on the CPU). Another of vLLM's backend names
    runs ours instead, with one warning; a name vLLM does not know either is an error."""
    if name is None or name.lower() == "auto" or name.upper() == ATTENTION_BACKENDS[device]:
        return
    if name.upper() in VLLM_ATTENTION_BACKENDS:
        logger.warning(
            "attention_backend %r is not built here: pagedllm runs its own %s kernels on %s instead.",
            name, ATTENTION_BACKENDS[device], device,
        )
        return
    raise ValueError(
        f"attention_backend {name!r} is not an attention backend name; leave it unset, or pass 'auto' or "
        f"{ATTENTION_BACKENDS[device]!r} (pagedllm's own kernels on {device})."
    )


# vLLM's CPU backend sizes its KV cache from this variable (GiB); --cpu-kvcache-space wins over it.
VLLM_CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def _env_kvcache_space() -> float | None:
    value = envs.VLLM_CPU_KVCACHE_SPACE
    if not value:
        return None
    try:
        space = float(value)
    except ValueError:
        raise ValueError(f"{VLLM_CPU_KVCACHE_SPACE_ENV} must be a number of GiB, got {value!r}.") from None
    return space if space > 0 else None  # vLLM: 0 means "the default"


def _parse_hf_overrides(value: dict[str, Any] | str | None) -> dict[str, Any]:
    """--hf-overrides as vLLM takes it: a dict, or a JSON object on the command line."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"hf_overrides must be a JSON object, got {value!r}: {e}.") from e
    if not isinstance(value, dict):
        raise ValueError(
            f"hf_overrides must be a dict of config keys (a callable is not supported), got {type(value).__name__}."
        )
    return value


def _smallest_window(hf_config: Any) -> int | None:
    """The smallest attention window of any layer (None: no layer has one)."""
    from pagedllm.models.utils import sliding_window_for_layer

    windows = [w for i in range(int(getattr(hf_config, "num_hidden_layers", 0) or 0))
               if (w := sliding_window_for_layer(hf_config, i))]
    return min(windows) if windows else None


def _derive_max_model_len(hf_config: Any) -> int:
    """The model's context (max_position_embeddings or its older names). A sliding window does not
    cap it: the window layers mask keys older than the window in the paged attention (vLLM's default,
    not disable_sliding_window)."""
    limit = 2048
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            limit = v
            break
    return limit
