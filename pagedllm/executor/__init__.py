"""Executors: how the engine core reaches its workers (one per tensor x pipeline rank)."""

from pagedllm.executor.abstract import Executor, KVCacheInfo, ModelRunnerOutputHandle

__all__ = ["Executor", "KVCacheInfo", "ModelRunnerOutputHandle"]
