"""Worker: one device's share of the engine. It owns the device, the model and the KV cache; its
ModelRunner prepares inputs, runs and samples.

An Executor (pagedllm/executor/) drives one worker per rank through the same calls, in this order:

    init_device()                     pick the device, CPU threads, the seed
    load_model()                      weights in; the attention backend chosen
    determine_num_available_blocks()  -> (num_gpu_blocks, num_cpu_blocks) that fit this device
    initialize_cache(gpu, cpu)        the minimum over every worker, allocated and bound
    compile_or_warm_up_model()        Triton variants compiled, CUDA graphs captured
    execute_model(scheduler_output)   each step; -> a PendingOutput whose get() waits for it

`rank` / `local_rank` / `distributed_init_method` name this worker's place in a tensor x pipeline
parallel group; with one worker they are 0, 0 and None. Only the driver worker (the first tensor
rank of the last pipeline stage) returns outputs in a multi-worker executor.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.layer import Attention
from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.distributed.parallel_state import get_pp_group
from pagedllm.distributed.utils import num_kv_heads_per_rank
from pagedllm.envs import KernelSwitches, kernel_switches, use_triton_cache_dir
from pagedllm.loader.model_loader import load_model
from pagedllm.pooling.runner import encoder_num_blocks, make_model_runner
from pagedllm.structured_output.bitmask import GrammarOutput
from pagedllm.worker import compile_pool
from pagedllm.worker.compile_pool import close_compile_pool, start_compile_pool
from pagedllm.worker.cuda_graphs import CudaGraphRunner
from pagedllm.worker.kv_cache import KVCache, kv_cache_bytes_per_block, resolve_kv_cache_dtype
from pagedllm.worker.model_runner import ModelRunner, PendingOutput
from pagedllm.worker.precompile import can_precompile, precompile_startup, warm_marker
from pagedllm.worker.swap_space import CpuSwapSpace
from pagedllm.worker.warmup import WarmupShape, warmup_kernels

logger = logging.getLogger(__name__)


def triton_version() -> str:
    import triton

    return triton.__version__


@contextlib.contextmanager
def start_phase(name: str):
    """Log how long one start-up phase took (vLLM's "... took X s" lines): the cold / warm start
    breakdown a user reads in the log."""
    t0 = time.monotonic()
    yield
    logger.info("start-up: %s took %.2f s", name, time.monotonic() - t0)

GiB = 1 << 30


def pick_attention_backend(device: torch.device, switches: KernelSwitches) -> AttentionBackend:
    if device.type == "cuda":
        from pagedllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(fused_qkv_prep=switches.fused_qkv, fused_decode=switches.fused_decode)
    from pagedllm.attention.backend import TorchAttentionBackend
    from pagedllm.cpu.attention import CpuAttentionBackend

    # Decode steps in one C call per layer when the CPU kernels build here; else torch.
    return CpuAttentionBackend() if CpuAttentionBackend.available() else TorchAttentionBackend()


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None, is_driver_worker: bool = True) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        self.device: torch.device | None = None
        self.model: torch.nn.Module | None = None
        self.model_runner: ModelRunner | None = None
        self.kv_cache: KVCache | None = None
        self.swap_space: CpuSwapSpace | None = None
        self.kernel_switches = kernel_switches()  # read once; steps never read the environment
        self._graphs: CudaGraphRunner | None = None  # built before the capture, for the parallel compile
        self._precompiled = False
        self._marker: Path | None = None  # worker/precompile.py warm_marker, written once a start completes
        self._memory_baseline = 0  # non-torch GPU bytes at init_device: not this engine's (gpu_memory.py)
        self._profile_kept = False  # the memory profile was read back, not run (PAGEDLLM_KEEP_MEMORY_PROFILE)

    # -- start-up ----------------------------------------------------------------------------------
    def init_device(self) -> None:
        dc = self.config.device_config
        if dc.cpu_threads is not None:
            if dc.cpu_threads < 1:
                raise ValueError(f"cpu_threads must be >= 1, got {dc.cpu_threads}.")
            torch.set_num_threads(dc.cpu_threads)
        if dc.device == "cuda" and self.config.parallel_config.world_size > 1:
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device(dc.device)
        if self.device.type == "cuda":
            with start_phase("CUDA init"):  # paid by the first CUDA call anyway; its own line in the log
                torch.cuda.init()
            # Before any kernel compiles: compiled variants persist under the user's cache directory.
            from pagedllm.worker.gpu_memory import startup_baseline

            self._memory_baseline = startup_baseline(self.device, self.config.cache_config.gpu_memory_utilization)
            logger.info("Triton cache: %s", use_triton_cache_dir())
            if self.kernel_switches.parallel_compile:
                start_compile_pool(early=True)  # unless EngineArgs did already: their imports overlap the model load
        # vLLM's set_random_seed: dummy weights and unseeded sampling follow `seed`.
        torch.manual_seed(self.config.model_config.seed)

    def load_model(self) -> None:
        assert self.device is not None, "init_device() first"
        config = self.config
        with start_phase(f"model load ({config.model_config.load_format} weights)"):
            self.model = load_model(config.model_config, self.device)
        # After the model: "auto" on the CPU depends on whether the GGUF blocks are computed in place.
        dtype, why = resolve_kv_cache_dtype(config)
        logger.info("KV cache dtype: %s (%s)", str(dtype).removeprefix("torch."), why)
        mc = config.model_config
        attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # This rank's KV heads only (tensor parallel), for this stage's layers only (pipeline).
        kv_heads = num_kv_heads_per_rank(mc.num_kv_heads, config.parallel_config.tensor_parallel_size)
        self.kv_cache = KVCache(attn_layers, pick_attention_backend(self.device, self.kernel_switches), dtype,
                                self.device, config.cache_config.block_size, kv_heads, mc.head_dim)
        self.model_runner = make_model_runner(config, self.model, self.device)

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(GPU blocks, CPU swap blocks) that fit this worker: the override, else the CPU budget
        (cpu_kvcache_space GiB, default 4), else what profiling leaves on the GPU under
        gpu_memory_utilization; CPU blocks are swap_space GiB when preemption swaps, else 0."""
        assert self.model is not None and self.kv_cache is not None and self.model_runner is not None
        config = self.config
        cc = config.cache_config
        per_block = kv_cache_bytes_per_block(config, get_pp_group().rank_in_group)
        num_cpu_blocks = int(cc.swap_space * GiB) // per_block if config.preemption_mode == "swap" else 0
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override, num_cpu_blocks
        if not self.kv_cache.attn_layers:  # an encoder (pooling): blocks are bookkeeping, no memory
            return encoder_num_blocks(config), 0
        if self.kv_cache.device.type == "cpu":
            space = cc.cpu_kvcache_space if cc.cpu_kvcache_space is not None else 4.0
            return max(int(space * GiB) // per_block, 1), num_cpu_blocks
        from pagedllm.worker.gpu_memory import profile_available_kv_bytes

        sc = config.scheduler_config
        self._precompile()  # the profile's variants too: before it
        kept = self._kept_profile_path()
        from pagedllm.worker.gpu_memory import load_kept_profile

        self._profile_kept = kept is not None and load_kept_profile(kept) is not None  # the warm-up runs its layout
        with start_phase("memory profiling"):
            available = profile_available_kv_bytes(
                self.model, self.model_runner.sampler, self.kv_cache,
                max_num_batched_tokens=sc.max_num_batched_tokens, max_num_seqs=sc.max_num_seqs,
                max_model_len=config.model_config.max_model_len, vocab_size=config.model_config.vocab_size,
                max_logprobs=config.max_logprobs, gpu_memory_utilization=cc.gpu_memory_utilization,
                baseline_non_torch=self._memory_baseline, kept=kept,
            )
        return max(available // per_block, 0), num_cpu_blocks

    def _kept_profile_path(self) -> Path | None:
        """Where this configuration's memory profile is kept (worker/gpu_memory.py), with
        PAGEDLLM_KEEP_MEMORY_PROFILE=1 on one CUDA device; else None (profile every start)."""
        import pagedllm.envs as envs

        if not envs.PAGEDLLM_KEEP_MEMORY_PROFILE or self.config.parallel_config.world_size > 1:
            return None
        from pagedllm.worker.gpu_memory import kept_profile_path, source_fingerprint

        assert self.model is not None and self.kv_cache is not None
        config, sc, cc = self.config, self.config.scheduler_config, self.config.cache_config
        return kept_profile_path([
            torch.cuda.get_device_name(self.kv_cache.device), torch.cuda.get_device_properties(self.kv_cache.device).total_memory,
            torch.__version__, torch.version.cuda, triton_version(), source_fingerprint(), self.kernel_switches,
            type(self.model).__name__, [(n, tuple(p.shape), str(p.dtype)) for n, p in self.model.named_parameters()],
            self.kv_cache.dtype, cc.block_size, sc.max_num_batched_tokens, sc.max_num_seqs,
            config.model_config.max_model_len, config.model_config.vocab_size, config.max_logprobs,
            self.config.device_config.enforce_eager,
        ])

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        assert self.kv_cache is not None
        with start_phase(f"KV cache allocation ({num_gpu_blocks} blocks)"):
            self.kv_cache.allocate(num_gpu_blocks)
        if num_cpu_blocks:
            # Host blocks for swap preemption, shaped like the device cache.
            self.swap_space = CpuSwapSpace(num_cpu_blocks, self.kv_cache.tensors)

    def compile_or_warm_up_model(self) -> None:
        """Compile the eager path's Triton variants, then capture the decode CUDA graphs (GPU only)."""
        assert self.model is not None and self.model_runner is not None and self.kv_cache is not None
        mc = self.config.model_config
        if self.kv_cache.tensors and mc.runner_type == "generate":  # the warm-up samples from logits
            self._precompile()  # done before the memory profile unless there was none
            with start_phase("kernel warm-up"):
                warmup_kernels(self.model, self.model_runner.sampler, self.kv_cache.device, mc.dtype,
                               self._warmup_shape(), profile_step=self._profile_kept)
        with start_phase("CUDA graph capture"):
            self.model_runner.capture_model(self.kernel_switches.graph_tuning, self._graph_runner())
        close_compile_pool()  # if no parallel compile ran (a pooling model, no generate warm-up)
        if self._marker is not None:
            try:  # the next start of this configuration finds every variant in the cache
                self._marker.parent.mkdir(parents=True, exist_ok=True)
                self._marker.touch()
            except OSError:
                pass

    def _warmup_shape(self) -> WarmupShape:
        mc = self.config.model_config
        return WarmupShape(
            block_size=self.config.cache_config.block_size, max_model_len=mc.max_model_len,
            max_num_batched_tokens=self.config.scheduler_config.max_num_batched_tokens,
            vocab_size=mc.vocab_size, hidden_size=int(mc.hf_config.hidden_size),
            max_num_seqs=self.config.scheduler_config.max_num_seqs,
        )

    def _graph_runner(self) -> CudaGraphRunner | None:
        assert self.model_runner is not None
        if self._graphs is None:
            self._graphs = self.model_runner.make_graph_runner(self.kernel_switches.graph_tuning)
        return self._graphs

    def _precompile(self) -> None:
        """Once: the start-up's Triton variants compiled in parallel (worker/precompile.py), for a
        generating CUDA model without routed experts, with PAGEDLLM_PARALLEL_COMPILE=1 or the compile
        processes a prestarted engine process forked on a fresh machine."""
        assert self.model is not None and self.kv_cache is not None and self.model_runner is not None
        if self._precompiled:
            return
        self._precompiled = True
        mc = self.config.model_config
        # PAGEDLLM_PARALLEL_COMPILE=1, or compile processes forked by the prestarted engine process
        # (compile_pool.fork_compile_pool: a fresh machine).
        wanted = self.kernel_switches.parallel_compile or compile_pool.current() is not None
        if not (wanted and mc.runner_type == "generate"
                and self.kv_cache.attn_layers and can_precompile(self.model, self.kv_cache.device)):
            close_compile_pool()
            return
        sc, cc = self.config.scheduler_config, self.config.cache_config
        self._marker = warm_marker([
            torch.__version__, triton_version(), torch.cuda.get_device_name(self.kv_cache.device), self.kernel_switches,
            [(n, tuple(p.shape), str(p.dtype)) for n, p in self.model.named_parameters()], self.kv_cache.dtype,
            mc.max_model_len, cc.block_size, sc.max_num_batched_tokens, sc.max_num_seqs,
            self.config.compilation_config.cudagraph_capture_sizes, self.config.device_config.enforce_eager,
        ])
        if self._marker.exists():
            close_compile_pool()
            logger.info("Triton cache holds this start-up's kernel variants (%s): no parallel compile", self._marker)
            return
        start_compile_pool()  # a new configuration on a cache that holds another's variants (start_compile_pool)
        with start_phase("parallel Triton compile"):
            precompile_startup(self.model, self.kv_cache, self._graph_runner(), self._warmup_shape(),
                               self.config.scheduler_config.max_num_seqs, mc.dtype)

    # -- serving -----------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingOutput | None:
        """Block copies of swap preemption first (queued before the forward pass), then the step
        (None when it waits for `sample_tokens`: constrained requests)."""
        so = scheduler_output
        if so.blocks_to_swap_out or so.blocks_to_swap_in:
            assert self.swap_space is not None, "swap blocks scheduled without a swap space"
            if so.blocks_to_swap_out:
                self.swap_space.swap_out(so.blocks_to_swap_out)
            if so.blocks_to_swap_in:
                self.swap_space.swap_in(so.blocks_to_swap_in)
        assert self.model_runner is not None
        return self.model_runner.execute_model(so)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingOutput:
        assert self.model_runner is not None
        return self.model_runner.sample_tokens(grammar_output)

    def check_health(self) -> None:
        """In-process there is nothing to probe: a failed step raises in execute_model."""

    def shutdown(self) -> None:
        """Unbind and drop the KV cache so its memory can be freed when the engine is dropped."""
        close_compile_pool()
        if self.kv_cache is not None:
            self.kv_cache.release()
        self.swap_space = None
