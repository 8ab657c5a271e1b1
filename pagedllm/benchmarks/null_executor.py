"""An Executor with no model, for measuring everything but the model: the serving path's ceiling.

    pagedllm serve MODEL --distributed-executor-backend pagedllm.benchmarks.null_executor.NullExecutor
    pagedllm bench serve --base-url http://127.0.0.1:8000 --model MODEL --dataset-name w1 ...

The real scheduler, KV cache manager, engine core loop, process hop, detokenizer, stop checks and
HTTP server run; only the forward pass is gone. Each step "samples" a token that is a function of the
position, `(position * 7919 + 100) % min(vocab, 10000)` (ids a tokenizer decodes to ordinary text), and
returns at once. So tok/s against this executor is the most the server could deliver with an
infinitely fast GPU: if it is not far above the real run's tok/s, the host side is the bottleneck.
`step_delay_s` (a class attribute; subclass to change it) adds a fixed sleep per step, to mimic a
device step without a device. Constrained requests (structured outputs) take the same token when the
grammar allows it, else the lowest allowed id: the grammar path runs for real.

It never runs a real request's answer: the tokens mean nothing. Benchmarks only.
"""

from __future__ import annotations

import time

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.structured_output.bitmask import GrammarOutput


class _Done:
    """A handle whose step already finished."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def get(self) -> ModelRunnerOutput:
        return self.output


class NullExecutor(Executor):
    step_delay_s: float = 0.0
    # KV blocks reported when the config does not fix a number (num_gpu_blocks_override).
    default_num_blocks: int = 1 << 16

    def _init_executor(self) -> None:
        self.vocab = min(self.config.model_config.vocab_size, 10000)
        self._deferred: ModelRunnerOutput | None = None

    def determine_num_available_blocks(self) -> list[tuple[int, int]]:
        override = self.config.cache_config.num_gpu_blocks_override
        return [(override or self.default_num_blocks, 0)]

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def compile_or_warm_up_model(self) -> None:
        pass

    def execute_model(self, scheduler_output: SchedulerOutput) -> _Done | None:
        so = scheduler_output
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed.update((r.req_id, r.num_computed_tokens) for r in so.scheduled_cached_reqs)
        req_ids = list(so.num_scheduled_tokens)
        sampled = [((computed[rid] + so.num_scheduled_tokens[rid]) * 7919 + 100) % self.vocab for rid in req_ids]
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
        if so.has_structured_output_requests:
            self._deferred = output
            return None
        return _Done(output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> _Done:
        output, self._deferred = self._deferred, None
        assert output is not None, "sample_tokens without a deferred step"
        if grammar_output is not None:
            row_of = {rid: i for i, rid in enumerate(output.req_ids)}
            mask = grammar_output.grammar_bitmask  # int32 (k, ceil(V / 32)): bit j of word w allows 32w + j
            for k, rid in enumerate(grammar_output.structured_output_request_ids):
                i = row_of[rid]
                tok = output.sampled_token_ids[i]
                if not (int(mask[k, tok >> 5]) >> (tok & 31)) & 1:
                    words = mask[k].nonzero()
                    if len(words):
                        w = int(words[0])
                        bits = int(mask[k, w]) & 0xFFFFFFFF
                        output.sampled_token_ids[i] = 32 * w + (bits & -bits).bit_length() - 1
        return _Done(output)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
