"""Token-budget scheduler: no prefill or decode phases, only tokens.

Each step hands out up to `max_num_batched_tokens` new tokens: running requests first (a decode
is one token, a prefill chunk many), then waiting requests in arrival order. A prompt longer than
the budget left simply gets a chunk now and the rest on later steps (chunked prefill). When the
pool has no block for a running request, the newest running request is preempted: its blocks
are freed and it goes back to the front of the waiting queue, to be recomputed or, with swap
preemption, resumed from its KV kept on the CPU (the policy object in core/preemption.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv, max_blocks_per_request
from pagedllm.core.preemption import PreemptionPolicy, make_preemption_policy
from pagedllm.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.core.scheduler_stats import KVSnapshotClock, SchedulerStats
from pagedllm.request import Request, RequestStatus


@dataclass
class _StepPlan:
    """What one schedule() has handed out so far."""

    budget: int  # tokens left of max_num_batched_tokens
    max_reqs: int  # requests this step may hold
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # num_scheduled's requests, in order


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        preemption_mode: str = "recompute",
        num_cpu_blocks: int = 0,
        pipeline_parallel_size: int = 1,
        sliding_window: int | None = None,  # every attention layer windowed (ModelConfig.kv_sliding_window)
    ) -> None:
        self.config = scheduler_config
        # PP (the engine core's batch queue): no request with its token in flight is scheduled, steps
        # carry sampled tokens (CachedRequestData.new_token_ids), a batch holds 1/P (`_batch_seats`).
        self.pp_size = pipeline_parallel_size
        self.use_pp = pipeline_parallel_size > 1
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(num_gpu_blocks, self.block_size, cache_config.enable_prefix_caching,
                                               sliding_window)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the runner must drop state for, reported on the next schedule(); the preempted
        # ones among them come back.
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Requests the runner has state for (seen since their last (re)admission).
        self._runner_knows: set[str] = set()
        self.preemption: PreemptionPolicy = make_preemption_policy(preemption_mode, num_cpu_blocks, self.block_size)
        self._kv_snapshots = KVSnapshotClock()

    # -- admission ---------------------------------------------------------------------------------
    def max_tokens_that_fit(self) -> int:
        return self.kv_cache_manager.num_blocks * self.block_size

    def max_blocks_held(self, num_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once (fewer behind a window)."""
        return max_blocks_per_request(num_tokens, self.block_size, self.kv_cache_manager.sliding_window,
                                      self.config.max_num_batched_tokens)

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError if it could never run, so it is never left waiting."""
        max_total = request.num_prompt_tokens + (request.max_tokens or 0)
        if request.num_prompt_tokens < 1:
            raise ValueError("the prompt is empty; it needs at least one token.")
        if max_total > self.config.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.config.max_model_len} tokens. However, you "
                f"requested {max_total} tokens ({request.num_prompt_tokens} in the prompt, "
                f"{request.max_tokens} for the completion). Please reduce the prompt or max_tokens."
            )
        if (held := self.max_blocks_held(max_total)) > self.kv_cache_manager.num_blocks:
            window = self.kv_cache_manager.sliding_window
            need = (f"{held * self.block_size} tokens (a {window}-token sliding window plus one step)"
                    if window and held < cdiv(max_total, self.block_size) else f"{max_total} tokens")
            raise ValueError(
                f"the request needs up to {need} of KV cache but the whole cache holds "
                f"{self.max_tokens_that_fit()} tokens ({self.kv_cache_manager.num_blocks} blocks of "
                f"{self.block_size}); it could never be scheduled."
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        # NOTE: one step hands out at most max_num_batched_tokens new tokens, in three parts:
        #  1. running requests, oldest first (`_schedule_running`): each gets what it still needs, a
        #     decode one token, a prefill chunk up to the budget left. When the pool has no block
        #     for one, the newest running request is preempted (the preemption policy keeps its KV
        #     on the CPU or lets it be recomputed) until it fits, or it was the newest itself.
        #  2. waiting requests, first come first served (`_schedule_waiting`), only if nothing was
        #     preempted this step, while budget, seats (max_num_seqs) and blocks last. Each starts
        #     after what is already computed: its prefix-cache hit, or the KV the policy kept.
        #  3. num_computed_tokens advances now (`_advance_computed`), so the next schedule() (async
        #     scheduling: while this step runs) already counts this step's work. A request whose
        #     newest token gets computed samples, and holds a placeholder until the token arrives.
        # A prompt longer than the budget left is just a chunk now and the rest later (chunked
        # prefill); there are no prefill and decode phases.
        plan = _StepPlan(budget=self.config.max_num_batched_tokens, max_reqs=self._batch_seats())
        preempted_any = self._schedule_running(plan)
        if not preempted_any:
            self._schedule_waiting(plan)
        sampling, needs_history = self._advance_computed(plan.scheduled)
        swap_out, swap_in = self.preemption.take_block_copies()
        out = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - plan.budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
            sampling_req_ids=sampling,
            needs_output_history=needs_history,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
        )
        if not out.is_empty:
            # An empty step is not run (the engine core drops it): these wait for one that is.
            self.finished_req_ids = set()
            self.preempted_req_ids = set()
        if self.kv_cache_manager.debug:
            self.kv_cache_manager.check_invariants()
            self.preemption.check_invariants()
        return out

    def _schedule_running(self, plan: _StepPlan) -> bool:
        """Part 1. A token sampled by the step still in flight counts as known (a placeholder), so the
        next decode is scheduled before it arrives. Returns whether anything was preempted."""
        # Once per running request per step: attributes are read into locals (host time per step,
        # BENCHMARKS.md issue 16).
        allocate_slots = self.kv_cache_manager.allocate_slots
        running = self.running
        num_scheduled = plan.num_scheduled
        cached_reqs = plan.cached_reqs
        scheduled = plan.scheduled
        runner_knows = self._runner_knows
        use_pp = self.use_pp
        max_reqs = plan.max_reqs
        max_model_len = self.config.max_model_len
        budget = plan.budget
        preempted_any = False
        i = 0
        while i < len(running) and budget > 0 and len(num_scheduled) < max_reqs:
            req = running[i]
            placeholders = req.num_output_placeholders
            if use_pp and placeholders:
                i += 1  # its token is still in the pipeline: it comes back before the request runs
                continue
            total = req.num_tokens + placeholders
            n = min(total - req.num_computed_tokens, budget)
            # With a placeholder in flight, the request may already have all it may produce.
            if n == 0 or (placeholders and (total >= max_model_len or (
                    req.max_tokens is not None and req.num_output_tokens + placeholders >= req.max_tokens))):
                i += 1  # its last token is still in flight and it may well be its last
                continue
            while True:
                new_blocks = allocate_slots(req, n)
                if new_blocks is not None:
                    break
                victim = running.pop()  # the newest
                self._preempt(victim)
                preempted_any = True
                if victim is req:
                    break
            if new_blocks is None:
                break  # req itself was preempted; everything after it too
            rid = req.request_id
            num_scheduled[rid] = n
            scheduled.append((req, n))
            budget -= n
            if rid in runner_knows:
                start = req.num_computed_tokens
                sampled = req.all_token_ids[max(start, req.num_prompt_tokens): start + n] if use_pp else []
                cached_reqs.append(
                    CachedRequestData(rid, [b.block_id for b in new_blocks] if new_blocks else [], start, sampled)
                )
            else:
                plan.new_reqs.append(self._new_request_data(req))
            i += 1
        plan.budget = budget
        return preempted_any

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Part 2, in queue order: the first request that does not fit stops the queue."""
        while (self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(plan.num_scheduled) < plan.max_reqs):
            req = self.waiting[0]
            admitted = self._admit(req, plan.budget)
            if admitted is None:
                break
            num_computed, n = admitted
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_computed
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.num_scheduled[req.request_id] = n
            plan.scheduled.append((req, n))
            plan.budget -= n
            plan.new_reqs.append(self._new_request_data(req))

    def _batch_seats(self) -> int:
        """Requests one batch may hold: max_num_seqs; with P pipeline stages an even share of the
        requests that can run, so the P batches in flight carry about 1/P each (vLLM V0's virtual
        engines split requests evenly): 6 running at P 2 -> 3 a batch, the other 3 in the next."""
        if not self.use_pp:
            return self.config.max_num_seqs
        can_run = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        return max(cdiv(can_run, self.pp_size), 1)

    def _admit(self, req: Request, budget: int) -> tuple[int, int] | None:
        """Blocks for a waiting request's first chunk: (tokens already computed, tokens this step),
        or None (nothing allocated) when it does not fit now."""
        kv = self.kv_cache_manager
        kept = self.preemption.resume_point(req)
        if kept is not None:
            # Resume where it stopped: fresh blocks for the kept prefix (copied back in) and the rest.
            if not self._fits_unchunked(req.num_tokens - kept, budget):
                return None
            req.num_computed_tokens = kept
            n = min(req.num_tokens - kept, budget)
            if kv.allocate_slots(req, n) is None:
                req.num_computed_tokens = 0
                return None
            self.preemption.resume(req, kv.get_block_ids(req.request_id, skipped_id=-1))
            return kept, n
        computed_blocks, num_hit_tokens = kv.get_computed_blocks(req)
        if not self._fits_unchunked(req.num_tokens - num_hit_tokens, budget):
            return None
        n = min(req.num_tokens - num_hit_tokens, budget)
        if kv.allocate_slots(req, n, computed_blocks) is None:
            return None
        return num_hit_tokens, n

    def _advance_computed(self, scheduled: list[tuple[Request, int]]) -> tuple[set[str], bool]:
        """Part 3: -> (requests that sample this step, whether any of them reads its past outputs)."""
        sampling: set[str] = set()
        needs_history = False
        for req, n in scheduled:
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:  # all known ones
                sampling.add(req.request_id)
                needs_history = needs_history or req.needs_output_history
                req.num_output_placeholders += 1
        return sampling, needs_history

    def _fits_unchunked(self, num_new_tokens: int, budget: int) -> bool:
        """With chunked prefill off a prompt runs whole in one step: it waits (and, first come
        first served, so does everything behind it) until a step has budget for all of it.
        max_num_batched_tokens >= max_model_len (SchedulerConfig) makes sure one step can."""
        return self.config.enable_chunked_prefill or num_new_tokens <= budget

    def _new_request_data(self, req: Request) -> NewRequestData:
        self._runner_knows.add(req.request_id)
        return NewRequestData(
            req_id=req.request_id,
            token_ids=list(req.all_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            output_token_ids=list(req.output_token_ids),
            sampling_params=req.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(req.request_id),
            num_computed_tokens=req.num_computed_tokens,
            pooling_params=req.pooling_params,
        )

    def _preempt(self, req: Request) -> None:
        self.preemption.preempt(req, self.kv_cache_manager.get_block_ids(req.request_id, skipped_id=-1))
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        if req.request_id in self._runner_knows:
            self._runner_knows.discard(req.request_id)
            self.finished_req_ids.add(req.request_id)
            self.preempted_req_ids.add(req.request_id)

    # -- results -----------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        sampling = scheduler_output.sampling_req_ids
        requests = self.requests
        sampled_token_ids = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        finished_from = RequestStatus.FINISHED_STOPPED
        if runner_output.prompt_logprobs:  # chunks mid-prefill too: kept on the request until its first output
            for req_id, (start, entries) in runner_output.prompt_logprobs.items():
                req = requests.get(req_id)
                if req is not None and req.status < finished_from:
                    req.add_prompt_logprobs(start, entries)
        for row, req_id in enumerate(runner_output.req_ids):
            if req_id not in sampling:
                continue  # mid-prefill: the sampled token belongs to no position yet
            req = requests.get(req_id)
            if req is None or req.status >= finished_from:
                continue  # finished or aborted while the step ran
            # A request preempted after this step was scheduled keeps the token: it was
            # sampled from a complete context.
            req.num_output_placeholders -= 1
            if req.pooling_params is not None:  # its whole prompt ran: done, with the pooled output
                assert runner_output.pooler_output is not None
                req.status = RequestStatus.FINISHED_STOPPED
                outputs.append(EngineCoreOutput(req_id, [], finish_reason="stop",
                                                pooling_output=runner_output.pooler_output[row]))
                self._free_request(req)
                continue
            token = sampled_token_ids[row]
            req.append_output_token_ids(token)
            self._check_stop(req, token)
            lp = [logprobs[row]] if logprobs is not None else None
            out = EngineCoreOutput(req_id, [token], lp, None, None, max(req.num_cached_tokens, 0))
            if req.prompt_logprobs is not None:  # the first output: they go with it, once
                out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
            if req.status >= finished_from:
                out.finish_reason = req.get_finished_reason()
                out.stop_reason = req.stop_reason
                self._free_request(req)
            outputs.append(out)
        return outputs

    def _check_stop(self, req: Request, token: int) -> None:
        params = req.sampling_params
        num_output = req.num_output_tokens
        if token in params.all_stop_token_ids and num_output >= params.min_tokens:
            req.status = RequestStatus.FINISHED_STOPPED
            # vLLM reports the stop token id for stop_token_ids, None for plain EOS.
            req.stop_reason = token if token in (params.stop_token_ids or []) else None
        elif req.max_tokens is not None and num_output >= req.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        elif req.num_tokens >= self.config.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED

    def finish_requests(self, request_ids: list[str], status: RequestStatus, stop_reason: str | None = None) -> None:
        """Abort (or stop, for stop strings found by the frontend) requests wherever they are."""
        assert RequestStatus.is_finished(status)
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished():
                continue
            req.status = status
            req.stop_reason = stop_reason
            self._free_request(req)

    def _free_request(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.preemption.drop(req)
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
        # A request preempted earlier is unknown to the runner's batch but may still hold worker
        # state that outlives preemption: report it too.
        if req.request_id in self._runner_knows or req.num_preemptions:
            self._runner_knows.discard(req.request_id)
            self.finished_req_ids.add(req.request_id)
            self.preempted_req_ids.discard(req.request_id)

    # -- introspection -----------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            kv_block_map=self._kv_snapshots.maybe_kv_block_map(kv, self.config.kv_snapshot_interval_s,
                                                             idle=not self.requests),
            num_swapped_reqs=self.preemption.num_held_requests(),
        )
