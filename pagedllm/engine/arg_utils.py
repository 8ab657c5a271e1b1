"""`EngineArgs`: what the user typed (LLM kwargs or CLI flags), resolved once into EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_dtype,
)

# Quantization methods that are built: GGUF ("gguf"), computed on its blocks on the CPU, dequantized on a GPU.
SUPPORTED_QUANTIZATION: tuple[str, ...] = ("gguf",)
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


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
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    preemption_mode: str | None = None
    max_logprobs: int = 20
    cpu_threads: int | None = None
    async_scheduling: bool | None = None  # None: on for CUDA, off on the CPU (nothing to overlap)

    def resolve_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}.")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device.")
        return self.device

    def create_engine_config(self) -> EngineConfig:
        from pagedllm.loader.source import resolve_model

        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}.")
        if self.quantization is not None and self.quantization not in SUPPORTED_QUANTIZATION:
            raise ValueError(
                f"quantization={self.quantization!r} is not supported yet; built: {', '.join(SUPPORTED_QUANTIZATION)} "
                "(GGUF files: blocks computed in place on the CPU, dequantized on a GPU)."
            )
        if self.tokenizer is not None and not os.path.exists(self.tokenizer):
            raise ValueError(f"tokenizer {self.tokenizer!r} is not a local path (no model hub is reached).")
        device = self.resolve_device()
        source = resolve_model(self.model)
        hf = source.hf_config
        config_dtype = getattr(hf, "dtype", None)
        if isinstance(config_dtype, str):
            config_dtype = getattr(torch, config_dtype, None)
        dtype = parse_dtype(self.dtype, config_dtype, device)
        derived_max = _derive_max_model_len(hf)
        max_model_len = self.max_model_len or derived_max
        if max_model_len > derived_max:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's maximum context ({derived_max}, "
                "from max_position_embeddings, or its sliding window: sliding-window attention is not built)."
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
            quantization=self.quantization,
            generation_config=dict(source.generation_config),
        )
        max_num_seqs = self.max_num_seqs or (256 if device == "cuda" else 64)
        batched = self.max_num_batched_tokens or (8192 if device == "cuda" else 2048)
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                swap_space=self.swap_space,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=True if self.enable_prefix_caching is None else self.enable_prefix_caching,
                cpu_kvcache_space=self.cpu_kvcache_space,
                cache_dtype=self.kv_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_model_len,
                async_scheduling=(device == "cuda") if self.async_scheduling is None else self.async_scheduling,
            ),
            parallel_config=ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size),
            device_config=DeviceConfig(device=device, enforce_eager=self.enforce_eager, cpu_threads=self.cpu_threads),
            preemption_mode=self.preemption_mode or "recompute",
            max_logprobs=self.max_logprobs,
        )

    # -- command line ------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> argparse.ArgumentParser:
        g = parser.add_argument_group("engine")
        if model_positional:
            g.add_argument("model_tag", nargs="?", default=None, help="model path, GGUF file or preset")
        g.add_argument("--model", default=None, help="HF model dir, .gguf file, or preset (qwen3-0.6b, llama3-8b)")
        g.add_argument("--tokenizer", default=None)
        g.add_argument("--skip-tokenizer-init", action="store_true")
        g.add_argument("--trust-remote-code", action="store_true")
        g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "float16", "half", "bfloat16"])
        g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--load-format", default="auto", choices=list(LOAD_FORMATS))
        g.add_argument("--quantization", "-q", default=None)
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        g.add_argument("--swap-space", type=float, default=4.0, help="CPU swap space per GPU, GiB")
        g.add_argument("--cpu-kvcache-space", type=float, default=None, help="KV cache GiB when on the CPU")
        g.add_argument("--kv-cache-dtype", default="auto",
                       help="KV cache element type: auto (the model dtype; float16 for GGUF weights computed on "
                            "the CPU), float16, bfloat16 or float32")
        g.add_argument("--num-gpu-blocks-override", type=int, default=None)
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
        g.add_argument("--max-num-seqs", type=int, default=None)
        g.add_argument("--max-num-batched-tokens", type=int, default=None)
        g.add_argument("--enforce-eager", action="store_true")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
        g.add_argument("--preemption-mode", default=None, choices=["recompute", "swap"])
        g.add_argument("--max-logprobs", type=int, default=20)
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="overlap scheduling with the running step (default: on for CUDA)")
        g.add_argument("--cpu-threads", type=int, default=None, help="torch threads on the CPU (default: all cores)")
        return parser

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


def _derive_max_model_len(hf_config: Any) -> int:
    """The model's context, capped at its sliding window when it has one: sliding-window attention
    is not built, so past the window the outputs would differ from the model's (as vLLM's
    disable_sliding_window does)."""
    limit = 2048
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            limit = v
            break
    window = getattr(hf_config, "sliding_window", None)
    if isinstance(window, int) and window > 0 and getattr(hf_config, "use_sliding_window", True):
        limit = min(limit, window)
    return limit
