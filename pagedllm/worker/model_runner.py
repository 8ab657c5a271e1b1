"""Runs one scheduled step: flat inputs -> forward -> logits of the last token per request -> sample.

Device-agnostic: on the CPU it uses the torch reference attention; on CUDA the Triton backend and,
for decode-only steps, CUDA graphs (worker/cuda_graphs.py).
"""

from __future__ import annotations

import logging
import math

import torch

from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import KV_CACHE_DTYPES, EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.host_copy import host_tensor, to_device_async
from pagedllm.loader.model_loader import load_model
from pagedllm.sample.metadata import RowInputs, SamplingMetadata
from pagedllm.sample.sampler import LogprobsTensors, Sampler
from pagedllm.structured_output.bitmask import GrammarOutput, apply_grammar_bitmask
from pagedllm.worker.cuda_graphs import CudaGraphRunner
from pagedllm.worker.input_batch import InputBatch, StepInputs
from pagedllm.worker.swap_space import CpuSwapSpace

logger = logging.getLogger(__name__)

GiB = 1 << 30


def resolve_kv_cache_dtype(config: EngineConfig) -> tuple[torch.dtype, str]:
    """The KV cache's element type and why: `kv_cache_dtype` when given; for "auto" the model dtype,
    except GGUF weights computed on their blocks on the CPU, whose cache is float16 (llama.cpp's
    default): a decode step there reads the whole cache, so half the bytes is a shorter step, and
    their compute is quantized already (greedy tokens then first differ from transformers' float32
    ones late, if at all: docs/CPU_PROFILE.md)."""
    asked = config.cache_config.cache_dtype
    if asked != "auto":
        return KV_CACHE_DTYPES[asked], "kv_cache_dtype"
    mc = config.model_config
    device = config.device_config.device
    if device == "cpu":
        from pagedllm.quantization.gguf import computes_on_gguf_blocks

        if computes_on_gguf_blocks(mc, torch.device(device)):
            return torch.float16, "auto: GGUF blocks computed on the CPU (--kv-cache-dtype float32 for float32)"
    return mc.dtype, "auto: the model dtype"


def kv_cache_bytes_per_block(config: EngineConfig) -> int:
    mc = config.model_config
    elem = torch.empty((), dtype=resolve_kv_cache_dtype(config)[0]).element_size()
    return 2 * mc.num_layers * config.cache_config.block_size * mc.num_kv_heads * mc.head_dim * elem


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device_config.device)
        self.dtype = config.model_config.dtype
        self.block_size = config.cache_config.block_size
        # vLLM's set_random_seed: dummy weights and unseeded sampling follow `seed`.
        torch.manual_seed(config.model_config.seed)
        self.model = load_model(config.model_config, self.device)
        self.vocab_size = config.model_config.vocab_size
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # After the model: "auto" on the CPU depends on whether the GGUF blocks are computed in place.
        self.kv_cache_dtype, why = resolve_kv_cache_dtype(config)
        logger.info("KV cache dtype: %s (%s)", str(self.kv_cache_dtype).removeprefix("torch."), why)
        self.backend = self._pick_backend()
        self.sampler = Sampler()
        self.input_batch = InputBatch(self.block_size)
        self.kv_caches: list[torch.Tensor] = []
        self.graph_runner: CudaGraphRunner | None = None
        self.swap_space: CpuSwapSpace | None = None
        self.step_id = 0
        self.last_sampled: torch.Tensor | None = None  # device ids of the newest step's samples
        self._deferred: tuple[StepInputs, torch.Tensor] | None = None  # a step waiting for its bitmask

    def _pick_backend(self):
        if self.device.type == "cuda":
            from pagedllm.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend()
        from pagedllm.attention.backend import TorchAttentionBackend
        from pagedllm.cpu.attention import CpuAttentionBackend

        # Decode steps in one C call per layer when the CPU kernels build here; else torch.
        return CpuAttentionBackend() if CpuAttentionBackend.available() else TorchAttentionBackend()

    # -- KV cache ----------------------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        """Blocks that fit: the override, else the CPU budget (cpu_kvcache_space GiB, default 4),
        else what profiling leaves on the GPU under gpu_memory_utilization."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        per_block = kv_cache_bytes_per_block(self.config)
        if self.device.type == "cpu":
            space = cc.cpu_kvcache_space if cc.cpu_kvcache_space is not None else 4.0
            return max(int(space * GiB) // per_block, 1)
        from pagedllm.worker.gpu_memory import profile_available_kv_bytes

        available = profile_available_kv_bytes(self, cc.gpu_memory_utilization)
        return max(available // per_block, 0)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        mc = self.config.model_config
        shape = (2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        # Unwritten slots are masked out of attention, but a masked value still meets a 0 weight,
        # so they must hold finite numbers: zeros. On the CPU a large torch.empty is a fresh
        # anonymous mapping (glibc mmaps anything over 32 MiB) that the OS zero-fills on first
        # touch, so start-up skips a multi-GiB memset and unused blocks cost no memory. Smaller
        # buffers may reuse heap memory with old contents, so they are zeroed explicitly.
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        fresh_mapping = self.device.type == "cpu" and math.prod(shape) * elem > 64 * (1 << 20)
        alloc = torch.empty if fresh_mapping else torch.zeros
        self.kv_caches = [alloc(shape, dtype=self.kv_cache_dtype, device=self.device) for _ in self.attn_layers]
        for layer, cache in zip(self.attn_layers, self.kv_caches):
            layer.bind_kv_cache(cache, self.backend)

    def init_swap_space(self, num_cpu_blocks: int) -> None:
        """Host blocks for swap preemption, shaped like the device cache."""
        self.swap_space = CpuSwapSpace(num_cpu_blocks, self.kv_caches)

    def release_kv_cache(self) -> None:
        for layer in self.attn_layers:
            layer.bind_kv_cache(None, self.backend)
        self.kv_caches = []

    def capture_model(self) -> None:
        """CUDA graphs for decode steps (GPU only; enforce_eager turns them off)."""
        if self.device.type != "cuda" or self.config.device_config.enforce_eager:
            return
        self.graph_runner = CudaGraphRunner(self)
        self.graph_runner.capture()

    # -- one step ----------------------------------------------------------------------------------
    def _metadata(self, inp: StepInputs) -> AttentionMetadata:
        dev = self.device
        qsl = torch.from_numpy(inp.query_start_loc)
        seq = torch.from_numpy(inp.seq_lens)
        q_lens = inp.query_start_loc[1:] - inp.query_start_loc[:-1]
        return AttentionMetadata(
            num_actual_tokens=int(inp.query_start_loc[-1]),
            num_reqs=len(inp.req_ids),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(inp.seq_lens.max()),
            query_start_loc=to_device_async(qsl, dev),
            seq_lens=to_device_async(seq, dev),
            block_table=to_device_async(torch.from_numpy(inp.block_table), dev),
            slot_mapping=to_device_async(torch.from_numpy(inp.slot_mapping), dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq,
        )

    def _fill_pending(self, input_ids: torch.Tensor, inp: StepInputs) -> None:
        """Async scheduling: tokens the previous step sampled go from device to device."""
        if inp.pending_positions:
            assert self.last_sampled is not None
            # One pinned copy (a pageable one may wait for the step in flight: host_copy.py).
            pos, rows = host_tensor([inp.pending_positions, inp.pending_rows], torch.int64, self.device)
            input_ids[pos] = self.last_sampled[rows]

    def forward(self, inp: StepInputs) -> torch.Tensor:
        """Hidden states of the last token of each request that samples: (len(sample_rows), hidden)."""
        if self.graph_runner is not None and self.graph_runner.can_run(inp):
            # Decode only: one token per request, and every request samples.
            return self.graph_runner.run(inp, self._fill_pending)
        md = self._metadata(inp)
        dev = self.device
        input_ids = to_device_async(torch.from_numpy(inp.input_ids), dev)
        self._fill_pending(input_ids, inp)
        positions = to_device_async(torch.from_numpy(inp.positions), dev)
        hidden = self.model(input_ids, positions, md)
        last = to_device_async(torch.from_numpy(inp.query_start_loc[1:][inp.sample_rows] - 1), dev)
        return hidden[last]

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> PendingOutput | None:
        """Launch one step. On a GPU this returns as soon as the work is queued; `get()` on the
        result waits for the sampled ids (the step's one host sync). None when the step has
        constrained requests: sampling then waits for `sample_tokens(grammar_output)`."""
        self.input_batch.update_states(so)
        self.step_id += 1
        if so.blocks_to_swap_out:
            assert self.swap_space is not None
            self.swap_space.swap_out(so.blocks_to_swap_out)
        if so.blocks_to_swap_in:
            assert self.swap_space is not None
            self.swap_space.swap_in(so.blocks_to_swap_in)
        if so.total_num_scheduled_tokens == 0:
            return PendingOutput(self, self.step_id, [], [], None, None, [])
        inp = self.input_batch.prepare_inputs(so)
        hidden = self.forward(inp)
        if not inp.sample_rows:
            return PendingOutput(self, self.step_id, inp.req_ids, [], None, None, [])
        logits = self.model.compute_logits(hidden)
        if so.has_structured_output_requests:
            # The grammar bitmask needs the tokens of the step in flight: the caller collects it
            # (while this forward runs) and then calls sample_tokens.
            self._deferred = (inp, logits)
            return None
        return self._sample(inp, logits, None)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingOutput:
        """Sample the step `execute_model` left unsampled (it returned None), under the grammar bitmask."""
        assert self._deferred is not None, "sample_tokens without a deferred step"
        (inp, logits), self._deferred = self._deferred, None
        return self._sample(inp, logits, grammar_output)

    def _sample(self, inp: StepInputs, logits: torch.Tensor, grammar_output: GrammarOutput | None) -> PendingOutput:
        states = [self.input_batch.requests[inp.req_ids[r]] for r in inp.sample_rows]
        if grammar_output is not None:
            row_of = {st.req_id: j for j, st in enumerate(states)}
            rows = [row_of[r] for r in grammar_output.structured_output_request_ids]
            logits = apply_grammar_bitmask(logits, grammar_output.grammar_bitmask, rows)
        # Only the repetition penalty reads the prompt, and at 1.0 it changes nothing, so other rows
        # skip copying theirs (256 rows of 100-400 prompt tokens, this list: 0.9 -> 0.5 ms a step on a
        # 2-core CPU).
        smd = SamplingMetadata.build(
            [
                RowInputs(
                    params=st.sampling_params,
                    prompt_token_ids=(st.token_ids[: st.num_prompt_tokens]
                                      if st.sampling_params.repetition_penalty != 1.0 else []),
                    output_token_ids=st.output_token_ids,
                    generator=st.generator,
                )
                for st in states
            ],
            self.vocab_size,
            self.device,
        )
        out = self.sampler(logits, smd)
        self.last_sampled = out.sampled_token_ids
        for j, st in enumerate(states):
            self.input_batch.mark_pending(st.req_id, self.step_id, j)
        return PendingOutput(self, self.step_id, inp.req_ids, inp.sample_rows, out.sampled_token_ids,
                             out.logprobs, [st.sampling_params.logprobs for st in states])


class PendingOutput:
    """A launched step's results, copied to the host in the background; `get()` waits for them."""

    def __init__(
        self,
        runner: ModelRunner,
        step_id: int,
        req_ids: list[str],
        sample_rows: list[int],
        sampled: torch.Tensor | None,
        logprobs: LogprobsTensors | None,
        num_logprobs: list[int | None],
    ) -> None:
        self.runner = runner
        self.step_id = step_id
        self.req_ids = req_ids
        self.sample_rows = sample_rows
        self.num_logprobs = num_logprobs
        self.event = None
        if sampled is not None and sampled.is_cuda:
            sampled = sampled.to("cpu", non_blocking=True)
            if logprobs is not None:
                logprobs = LogprobsTensors(*(t.to("cpu", non_blocking=True) for t in logprobs))
            self.event = torch.cuda.Event()
            self.event.record()
        self.sampled = sampled
        self.logprobs = logprobs

    def get(self) -> ModelRunnerOutput:
        if self.event is not None:
            self.event.synchronize()
        sampled = [0] * len(self.req_ids)
        logprobs: list | None = None
        if self.sampled is None:
            return ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=sampled)
        ids = self.sampled.tolist()
        batch = self.runner.input_batch
        for row, tok in zip(self.sample_rows, ids):
            sampled[row] = tok
            batch.append_sampled(self.req_ids[row], tok, self.step_id)
        if self.logprobs is not None:
            lp_ids, lps, ranks = self.logprobs.tolists()
            logprobs = [([], [], 0)] * len(self.req_ids)
            for j, (row, k) in enumerate(zip(self.sample_rows, self.num_logprobs)):
                if k is not None:
                    logprobs[row] = (lp_ids[j][: k + 1], lps[j][: k + 1], ranks[j])
        return ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=sampled, logprobs=logprobs)
