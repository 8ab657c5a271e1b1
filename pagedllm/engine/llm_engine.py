"""LLMEngine: the synchronous frontend used by `LLM` (and the CLI): text in, RequestOutputs out."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from pagedllm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.introspection import SchedulerView
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.loader import hf_configs
from pagedllm.outputs import RequestOutput
from pagedllm.request import RequestStatus
from pagedllm.sampling_params import SamplingParams


def load_tokenizer(config: EngineConfig) -> Any:
    mc = config.model_config
    if mc.skip_tokenizer_init:
        return None
    from pagedllm.loader.tokenizer import get_tokenizer

    return get_tokenizer(mc.source, mc.tokenizer, mc.trust_remote_code, use_fast=mc.tokenizer_mode != "slow")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.engine_core = EngineCore(config)
        # The start completed: the next one reads its model config back without transformers'
        # config modules (loader/hf_configs.py).
        hf_configs.remember()
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Core requests added and not yet scheduled: the step that schedules one sets its
        # RequestMetrics.first_scheduled_time and time_in_queue (as vLLM's offline outputs carry).
        self._unscheduled: dict[str, Any] = {}

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this engine was started with skip_tokenizer_init; it has no tokenizer.")
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validate everything first, then queue: a bad request leaves no trace."""
        arrival_time = arrival_time if arrival_time is not None else time.time()
        prep = self.processor.process_request(request_id, prompt, params, arrival_time)
        added: list[str] = []
        try:
            for request, state in zip(prep.requests, prep.states):
                self.engine_core.add_request(request)
                added.append(request.request_id)
                self.output_processor.add_request(state)
                self._unscheduled[request.request_id] = request
        except ValueError:
            self.engine_core.abort_requests(added)
            self.output_processor.abort_requests(added)
            for rid in added:
                self._unscheduled.pop(rid, None)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def step(self) -> list[RequestOutput]:
        step_start = time.time()
        core_outputs = self.engine_core.step()
        self._mark_scheduled(step_start)
        outputs, stops = self.output_processor.process_outputs(core_outputs)
        if stops:
            self.engine_core.stop_requests(stops)
        return outputs

    def _mark_scheduled(self, step_start: float) -> None:
        states = self.output_processor.request_states
        waiting = RequestStatus.WAITING  # not a finished status: the requests still queued, skipped
        for rid, req in [(rid, req) for rid, req in self._unscheduled.items() if req.status != waiting]:
            del self._unscheduled[rid]
            st = states.get(rid)
            if st is not None and st.metrics.first_scheduled_time is None and req.status != RequestStatus.FINISHED_ABORTED:
                st.metrics.first_scheduled_time = step_start
                st.metrics.time_in_queue = step_start - st.metrics.arrival_time

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_unfinished_requests()

    def run_to_completion(self, request_ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[Any]:
        """Step until every request in `request_ids` (added, FINAL_ONLY) has finished; their outputs
        in that order. An error (Ctrl-C included) aborts the ones still running before it propagates,
        so no KV block stays held. Used by `LLM.generate` and the pooling calls alike. use_tqdm may be
        a tqdm-like class (vLLM's `use_tqdm: bool | Callable[..., tqdm]`), called as tqdm is."""
        finished: dict[str, Any] = {}
        bar_cls = use_tqdm if callable(use_tqdm) else tqdm
        bar = bar_cls(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self.abort_request([i for i in request_ids if i not in finished])
            raise
        finally:
            bar.close()
        return [finished[i] for i in request_ids]

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.scheduler.get_num_unfinished_requests()

    # -- vLLM V0-style introspection (monitoring code reads these; see engine/introspection.py) -------
    @property
    def scheduler(self) -> SchedulerView:
        return SchedulerView(self.engine_core.scheduler)

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model_config

    @property
    def cache_config(self) -> CacheConfig:
        return self.config.cache_config

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.config.scheduler_config

    @property
    def parallel_config(self) -> ParallelConfig:
        return self.config.parallel_config

    @property
    def device_config(self) -> DeviceConfig:
        return self.config.device_config

    def get_model_config(self) -> ModelConfig:
        return self.config.model_config

    def shutdown(self) -> None:
        """Drop the core (model, KV cache, CUDA graphs): `del llm` relies on this (entrypoints/llm.py)."""
        core, self.engine_core = self.engine_core, None  # type: ignore[assignment]
        if core is not None:
            core.shutdown()  # the executor lets its workers go
