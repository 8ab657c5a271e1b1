"""Runs one scheduled step: flat inputs -> forward -> logits of the last token per request -> sample.

The Worker (worker/worker.py) owns the device, the model and the KV cache; the runner owns what a
step needs: the per-request input state (worker/input_batch.py), the sampler and, on a GPU, the
decode-step CUDA graphs (worker/cuda_graphs.py). Device-agnostic: on the CPU the model's attention
runs the CPU backend or the torch reference; on CUDA the Triton backend.

Reading a step's result (`PendingOutput.get`) changes nothing here: the runner takes the sampled
tokens into its input state when it prepares the next step (`_take_collected`).
"""

from __future__ import annotations

import logging

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.distributed.parallel_state import get_pp_group
from pagedllm.distributed.pipeline import forward_stage
from pagedllm.distributed.utils import num_kv_heads_per_rank
from pagedllm.host_copy import host_tensor, to_device_async
from pagedllm.sample.metadata import RowInputs, SamplingMetadata
from pagedllm.sample.sampler import LogprobsTensors, Sampler
from pagedllm.structured_output.bitmask import GrammarOutput, apply_grammar_bitmask
from pagedllm.structured_output.gate import GrammarGate
from pagedllm.worker import prompt_logprobs
from pagedllm.worker.cuda_graphs import CudaGraphRunner
from pagedllm.worker.gated_cpu_sample import GatedCpuSample
from pagedllm.worker.input_batch import CachedRequestState, InputBatch, StepInputs
from pagedllm.worker.mixed_graphs import (
    MixedGraphRunner,
    active_parameters,
    has_experts,
    mixed_capture_sizes,
    mixed_graph_token_cap,
)
from pagedllm.worker.pending_output import PendingOutput  # also imported from here (executor, worker)

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        self.sampler = Sampler()
        self.pp_group = get_pp_group()  # one stage of one rank unless pipeline parallel
        self.input_batch = InputBatch(self.block_size, device)
        self.graph_runner: CudaGraphRunner | None = None
        self.mixed_graph_runner: MixedGraphRunner | None = None  # steps with prefill chunks
        self.step_id = 0
        self.last_sampled: torch.Tensor | None = None  # device ids of the newest step's samples
        self._deferred: tuple[StepInputs, torch.Tensor] | None = None  # a step waiting for its bitmask
        self._hidden_all: torch.Tensor | None = None  # this forward's hidden states, every token's row
        self._prompt_lp: tuple | None = None  # this step's prompt logprobs, until its PendingOutput takes them
        # Launched steps that sampled, oldest first, until the input batch has taken their tokens.
        self._uncollected: list[PendingOutput] = []
        # (membership, sampling req ids) -> the SamplingMetadata built for them (_sampling_metadata).
        self._smd_cache: tuple[tuple[int, list[str]], SamplingMetadata] | None = None
        # Gated sampling (structured_output/gate.py): the device copy of the bitmask rows, and on the
        # CPU the gated step whose sampling waits until its output or its tokens are first needed.
        self._gate_mask: torch.Tensor | None = None
        self._gate_pinned: set[int] = set()  # host bitmask addresses found pinned
        self._gated_cpu: GatedCpuSample | None = None
        self._gated_prep: tuple | None = None  # the deferred gated step's _prepare_gated, for sample_tokens(gate)
        self.gate_waits: dict[str, int] = {}  # which device wait each gated step used (counts)

    def make_graph_runner(self, tuning: bool = True) -> CudaGraphRunner | None:
        """The decode-graph runner, not captured yet; None where no graphs are captured (CPU,
        enforce_eager). With pipeline parallelism each stage captures its own."""
        if (self.device.type != "cuda" or self.config.device_config.enforce_eager
                or not self.config.compilation_config.decode_graphs):
            return None
        mc = self.config.model_config
        return CudaGraphRunner(
            self.model, self.device, self.config.compilation_config.cudagraph_capture_sizes,
            mc.max_model_len, self.block_size,
            num_kv_heads_per_rank(mc.num_kv_heads, self.config.parallel_config.tensor_parallel_size), tuning,
            self.pp_group,  # each stage its own graphs, activations through static buffers
        )

    def capture_model(self, tuning: bool = True, runner: CudaGraphRunner | None = None) -> None:
        """CUDA graphs for decode steps (GPU only; enforce_eager turns them off). The KV cache must
        be bound: the graphs read it where it lives. tuning: time each size with both BLAS
        libraries and let batches pad up (worker/graph_plan.py). runner: one `make_graph_runner`
        already built."""
        runner = runner or self.make_graph_runner(tuning)
        if runner is not None:
            runner.capture()
            self.graph_runner = runner
        mixed = self.make_mixed_graph_runner(runner.pool if runner is not None else None)
        if mixed is not None:
            mixed.capture()
            self.mixed_graph_runner = mixed

    def make_mixed_graph_runner(self, pool: object = None, capture: bool = True) -> MixedGraphRunner | None:
        """Graphs for steps with prefill chunks (worker/mixed_graphs.py), where they apply: CUDA,
        cudagraph_mode FULL_AND_PIECEWISE / FULL, one pipeline stage, no MLA layers. capture=False:
        the same padded path run eagerly (tests, any device)."""
        if capture and (self.device.type != "cuda" or self.config.device_config.enforce_eager
                        or not self.config.compilation_config.mixed_graphs):
            return None
        from pagedllm.attention.mla import MLAAttention

        if self.pp_group.world_size > 1 or any(isinstance(m, MLAAttention) for m in self.model.modules()):
            return None
        sc, mc = self.config.scheduler_config, self.config.model_config
        cap = mixed_graph_token_cap(active_parameters(self.model), has_experts(self.model))
        return MixedGraphRunner(self.model, self.device, mixed_capture_sizes(sc.max_num_batched_tokens, cap),
                                sc.max_num_seqs, mc.max_model_len, self.block_size, pool=pool, capture=capture)

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
            k = len(inp.pending_positions)
            if inp.pending_positions == inp.pending_rows == list(range(k)):
                # A steady decode batch: row i's token is the previous step's sample i. A slice
                # copy on the device, nothing from the host.
                input_ids[:k] = self.last_sampled[:k]
                return
            # One pinned copy (a pageable one may wait for the step in flight: host_copy.py).
            pos, rows = host_tensor([inp.pending_positions, inp.pending_rows], torch.int64, self.device)
            input_ids[pos] = self.last_sampled[rows]

    def forward(self, inp: StepInputs) -> torch.Tensor | None:
        """Hidden states of the last token of each request that samples: (len(sample_rows), hidden)."""
        if self.graph_runner is not None and self.graph_runner.can_run(inp):
            # One token per request. A 1-token prefill chunk among decodes samples nothing: its row goes.
            hidden = self.graph_runner.run(inp, self._fill_pending)
            self._hidden_all = hidden  # one row per request (one token each): the prompt logprobs' rows
            if hidden is None or len(inp.sample_rows) == len(inp.req_ids):
                return hidden
            return hidden[inp.sample_rows]
        dev = self.device
        if self.mixed_graph_runner is not None and self.mixed_graph_runner.can_run(inp):
            hidden = self.mixed_graph_runner.run(inp, self._fill_pending)
        else:
            md = self._metadata(inp)
            input_ids = to_device_async(torch.from_numpy(inp.input_ids), dev)
            self._fill_pending(input_ids, inp)
            positions = to_device_async(torch.from_numpy(inp.positions), dev)
            hidden = forward_stage(self.model, input_ids, positions, md, self.pp_group)
            if hidden is None:  # an earlier pipeline stage: its activations went to the next one
                return None
        self._hidden_all = hidden
        last = to_device_async(torch.from_numpy(inp.query_start_loc[1:][inp.sample_rows] - 1), dev)
        return hidden[last]

    def _take_collected(self) -> None:
        """Sampled tokens of the steps the engine has read (in launch order) join the input batch,
        before this step's deltas apply (a preempted request's state is rebuilt from them)."""
        n = 0
        for pending in self._uncollected:
            ids = pending.sampled_ids
            if ids is None:
                break  # not read yet: its tokens stay in flight (read from last_sampled on the device)
            self.input_batch.append_sampled_rows(pending.req_ids, pending.sample_rows, ids, pending.step_id)
            n += 1
        del self._uncollected[:n]

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> PendingOutput | None:
        """Launch one step. On a GPU this returns as soon as the work is queued; `get()` on the
        result waits for the sampled ids (the step's one host sync). None when the step has
        constrained requests: sampling then waits for `sample_tokens(grammar_output)`."""
        if self._gated_cpu is not None:
            self._gated_cpu.sample()  # its tokens are this step's inputs (CPU: no stream orders it)
        self._take_collected()
        self.input_batch.update_states(so)
        self.step_id += 1
        if so.total_num_scheduled_tokens == 0:
            return PendingOutput(self.step_id, [], [], None, None, [])
        inp = self.input_batch.prepare_inputs(so)
        job = None
        if self.input_batch.prompt_logprob_ids:
            job = prompt_logprobs.plan(inp.req_ids, inp.query_start_loc, inp.positions, self.input_batch.requests.get)
        self._hidden_all = None
        hidden = self.forward(inp)
        self._prompt_lp = None
        if job is not None and self._hidden_all is not None:
            self._prompt_lp = (job, *prompt_logprobs.compute(job, self._hidden_all, self.model.compute_logits,
                                                              self.vocab_size))
        self._hidden_all = None
        if not inp.sample_rows:
            return self._with_prompt_logprobs(PendingOutput(self.step_id, inp.req_ids, [], None, None, []))
        if hidden is None:
            # A stage before the last: its activations went on; it waits for nothing back, so it
            # can start the next batch at once (the sampled tokens reach it in a later
            # SchedulerOutput). The engine never reads this output.
            return PendingOutput(self.step_id, inp.req_ids, [], None, None, [])
        logits = self.model.compute_logits(hidden)
        if so.grammar_gate is not None:
            # Gated: the sampling is launched by sample_tokens(gate), once the engine core has posted
            # the gate's fill (EngineCore._step_gated, grammar_step.py, says why); its host work is done here.
            self._deferred = (inp, logits)
            self._gated_prep = self._prepare_gated(inp, logits, so.grammar_gate)
            return None
        if so.has_structured_output_requests:
            # The grammar bitmask needs the tokens of the step in flight: the caller collects it
            # (while this forward runs) and then calls sample_tokens.
            self._deferred = (inp, logits)
            return None
        return self._sample(inp, logits, None)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | GrammarGate | None) -> PendingOutput:
        """Sample the step `execute_model` left unsampled (it returned None), under the grammar bitmask;
        a GrammarGate (gated sampling): under the bitmask its fillers fill, waiting on the device."""
        assert self._deferred is not None, "sample_tokens without a deferred step"
        (inp, logits), self._deferred = self._deferred, None
        if isinstance(grammar_output, GrammarGate):
            prep, self._gated_prep = self._gated_prep, None
            assert prep is not None and prep[0] is grammar_output, "sample_tokens with another step's gate"
            return self._sample_gated(inp, logits, prep)
        return self._sample(inp, logits, grammar_output)

    def _sampling_metadata(self, inp: StepInputs, states: list[CachedRequestState]) -> SamplingMetadata:
        """The batch's SamplingMetadata, rebuilt only when the sampling rows change (vLLM caches it too).

        Every field is a function of the rows' request states (the same objects while no request
        joins or leaves the batch: InputBatch.membership) and their params, except min_tokens'
        count of tokens still to generate: a batch with a min_tokens row is rebuilt every step.
        The output token lists are the states' live lists, so a cached build still sees each step's
        new tokens; the sampler only reads the metadata's tensors."""
        key = (self.input_batch.membership, [inp.req_ids[r] for r in inp.sample_rows])
        cached = self._smd_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        # Only the repetition penalty reads the prompt, and at 1.0 it changes nothing, so other rows
        # skip copying theirs (host time a step: BENCHMARKS.md, "Measurements behind code decisions").
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
        self._smd_cache = None if smd.min_tokens else (key, smd)
        return smd

    def _prepare_gated(self, inp: StepInputs, logits: torch.Tensor, gate: GrammarGate) -> tuple:
        """A gated step's host work before its sampling launch, done with its forward (the core's
        collect and job come between): its rows, metadata, the device buffer for its mask."""
        states = [self.input_batch.requests[inp.req_ids[r]] for r in inp.sample_rows]
        ids = gate.request_ids
        all_rows = ids == [st.req_id for st in states]
        if not logits.is_cuda:
            return gate, states, all_rows, None, None
        md = self._sampling_metadata(inp, states)
        rows = None
        if not all_rows:
            row_of = {st.req_id: j for j, st in enumerate(states)}
            rows = host_tensor([row_of[r] for r in ids], torch.int32, logits.device)
        k, words = gate.bitmask.shape
        if gate.bitmask.data_ptr() not in self._gate_pinned:  # the manager's few buffers, asked once each
            if not gate.bitmask.is_pinned():
                raise RuntimeError("gated sampling needs its bitmask in pinned (or registered) host memory: a "
                                   "pageable copy would read the buffer before its fill")
            self._gate_pinned.add(gate.bitmask.data_ptr())
        if self._gate_mask is None or self._gate_mask.shape[0] < k or self._gate_mask.shape[1] != words:
            self._gate_mask = torch.empty((max(k, self.config.scheduler_config.max_num_seqs), words),
                                          dtype=torch.int32, device=logits.device)
        return gate, states, all_rows, md, rows

    def _sample_gated(self, inp: StepInputs, logits: torch.Tensor, prep: tuple) -> PendingOutput:
        """Sample a gated step now, in stream order: wait for its flag words on the device, copy its
        bitmask rows up, sample under them (structured_output/gate.py). Called once the gate's fill
        is posted: whatever here synchronizes the device (a kernel's first load, an allocation)
        then waits for the fill, not for this thread. On the CPU the same, when the step's output or
        tokens are first needed (`GatedCpuSample`), or at once under gate.SYNC_AT_LAUNCH_S."""
        from pagedllm.structured_output import gate as gate_mod

        gate, states, all_rows, md, rows = prep
        if not logits.is_cuda:
            pending = self._finish_sample(inp, states, None, None)
            self._gated_cpu = GatedCpuSample(self, pending, inp, states, logits, gate, all_rows)
            if gate_mod.SYNC_AT_LAUNCH_S is not None:
                self._gated_cpu.sample(gate_mod.SYNC_AT_LAUNCH_S)  # the device's worst case: a sync here
            return pending
        k = gate.bitmask.shape[0]
        how = gate_mod.device_wait(gate)
        self.gate_waits[how] = self.gate_waits.get(how, 0) + 1
        mask = self._gate_mask[:k]
        mask.copy_(gate.bitmask, non_blocking=True)  # queued behind the wait: reads the filled rows
        if all_rows:
            out = self.sampler(logits, md, mask)
        else:
            from pagedllm.kernels.grammar_bitmask import apply_bitmask_inplace

            out = self.sampler(apply_bitmask_inplace(logits if logits.stride(1) == 1 else logits.contiguous(),
                                                     mask, rows), md, None)
        return self._finish_sample(inp, states, out.sampled_token_ids, out.logprobs)

    def _sample(self, inp: StepInputs, logits: torch.Tensor, grammar_output: GrammarOutput | None) -> PendingOutput:
        states = [self.input_batch.requests[inp.req_ids[r]] for r in inp.sample_rows]
        mask = None
        if grammar_output is not None:
            ids = grammar_output.structured_output_request_ids
            if logits.is_cuda and ids == [st.req_id for st in states]:
                # Every row constrained, in batch order (a batch of JSON answers): the sampler
                # applies the mask, inside its sampling kernel where it can.
                mask = to_device_async(grammar_output.grammar_bitmask, logits.device)
            else:
                row_of = {st.req_id: j for j, st in enumerate(states)}
                logits = apply_grammar_bitmask(logits, grammar_output.grammar_bitmask, [row_of[r] for r in ids])
        out = self.sampler(logits, self._sampling_metadata(inp, states), mask)
        return self._finish_sample(inp, states, out.sampled_token_ids, out.logprobs)

    def _with_prompt_logprobs(self, pending: PendingOutput) -> PendingOutput:
        """The step's prompt logprobs (execute_model computed them beside the forward) go with its output."""
        if self._prompt_lp is not None:
            pending.attach_prompt_logprobs(*self._prompt_lp)
            self._prompt_lp = None
        return pending

    def _finish_sample(self, inp: StepInputs, states: list[CachedRequestState], sampled: torch.Tensor | None,
                       logprobs: LogprobsTensors | None) -> PendingOutput:
        """The step's PendingOutput and the states' in-flight marks (sampled None: a gated CPU
        step, whose tokens `GatedCpuSample.sample` sets later)."""
        pending = self._with_prompt_logprobs(PendingOutput(self.step_id, inp.req_ids, inp.sample_rows, sampled,
                                                           logprobs, [st.sampling_params.logprobs for st in states]))
        if self.pp_group.world_size > 1:
            # Pipeline parallel: every stage, this one too, takes the tokens from the scheduler's
            # next step for the request (CachedRequestData.new_token_ids); none is in flight.
            return pending
        self.last_sampled = sampled
        step_id = self.step_id
        for j, st in enumerate(states):  # InputBatch.mark_pending, on the states at hand
            st.pending_step, st.pending_row = step_id, j
        self._uncollected.append(pending)
        return pending
